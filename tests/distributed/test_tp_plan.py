"""The plan checks as pure functions over plans and configs (no process group, no weights)."""

from types import SimpleNamespace

import pytest

from hf_tpu.distributed.tp_plan import TensorParallelConfigError, check_world, fix_plan, weight_placement

LLAMA_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
QWEN3_PLAN = LLAMA_PLAN | {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
KEYS = {"embedding_key": "model.embed_tokens", "head_key": "lm_head"}


def cfg(heads=8, kv=2, vocab=1000, tied=False):
    return SimpleNamespace(
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied
    )


def test_divisible_plan_is_untouched():
    report = fix_plan(LLAMA_PLAN, cfg(kv=2), 2, **KEYS)
    assert report.plan == LLAMA_PLAN and report.fixes == []


def test_tp_size_one_or_empty_plan_is_untouched():
    assert fix_plan(LLAMA_PLAN, cfg(kv=1), 1, **KEYS).plan == LLAMA_PLAN
    assert fix_plan({}, cfg(kv=1), 4, **KEYS).plan == {}


def test_kv_heads_not_divisible_replicates_attention_only():
    report = fix_plan(QWEN3_PLAN, cfg(heads=4, kv=2), 4, **KEYS)
    assert report.kinds() == ["replicate_attention"]
    assert not [k for k in report.plan if ".self_attn" in k]  # q/k/v/o and the q/k norms dropped together
    assert report.plan["model.layers.*.mlp.up_proj"] == "colwise"
    assert report.plan["lm_head"] == "colwise_gather_output"
    assert "2 KV heads" in report.fixes[0].reason and "4 attention heads" not in report.fixes[0].reason


def test_query_heads_not_divisible_replicates_attention():
    report = fix_plan(LLAMA_PLAN, cfg(heads=6, kv=6), 4, **KEYS)
    assert report.kinds() == ["replicate_attention"]
    assert "6 KV heads and 6 attention heads" in report.fixes[0].reason


def test_user_rule_that_cannot_work_is_an_error_not_rewritten():
    with pytest.raises(TensorParallelConfigError, match=r"k_proj.*2 KV heads.*tp_size"):
        fix_plan(LLAMA_PLAN, cfg(kv=2), 4, user_rules={"model.layers.*.self_attn.k_proj"}, **KEYS)


def test_user_rule_that_expects_split_heads_is_an_error():
    with pytest.raises(TensorParallelConfigError, match="o_proj"):
        fix_plan(LLAMA_PLAN, cfg(kv=2), 4, user_rules={"model.layers.*.self_attn.o_proj"}, **KEYS)


def test_user_rule_compatible_with_replication_is_kept():
    plan = LLAMA_PLAN | {"model.layers.*.self_attn.k_proj": "colwise_gather_output"}
    report = fix_plan(plan, cfg(kv=2), 4, user_rules={"model.layers.*.self_attn.k_proj"}, **KEYS)
    assert report.kinds() == ["replicate_attention"]
    assert report.plan["model.layers.*.self_attn.k_proj"] == "colwise_gather_output"
    assert "model.layers.*.self_attn.q_proj" not in report.plan
    assert "your rules kept: k_proj" in report.fixes[0].reason


def test_user_rules_elsewhere_do_not_block_the_fix():
    plan = LLAMA_PLAN | {"model.layers.*.mlp.down_proj": "rowwise"}
    report = fix_plan(plan, cfg(kv=2), 4, user_rules={"model.layers.*.mlp.down_proj"}, **KEYS)
    assert report.kinds() == ["replicate_attention"]
    assert report.plan["model.layers.*.mlp.down_proj"] == "rowwise"


def test_uneven_vocab_is_reported_and_kept_sharded():
    report = fix_plan(LLAMA_PLAN, cfg(kv=4, vocab=1001), 4, **KEYS)
    assert report.kinds() == ["uneven_vocab"]
    assert report.plan == LLAMA_PLAN
    assert "251 rows, the last 248" in report.fixes[0].reason


def test_vocab_smaller_than_tp_size_is_an_error():
    with pytest.raises(TensorParallelConfigError, match="fewer than tp_size=4"):
        fix_plan(LLAMA_PLAN, cfg(kv=4, vocab=3), 4, **KEYS)


def test_tied_embeddings_with_matching_layouts_are_kept():
    report = fix_plan(LLAMA_PLAN, cfg(kv=4, tied=True), 4, **KEYS)
    assert report.fixes == []


def test_tied_embeddings_default_mismatch_is_aligned():
    plan = dict(LLAMA_PLAN)
    del plan["model.embed_tokens"]  # head splits the vocab, the embedding would stay whole
    report = fix_plan(plan, cfg(kv=4, tied=True), 4, **KEYS)
    assert report.kinds() == ["tie_embeddings"]
    assert report.plan["model.embed_tokens"] == "embedding_rowwise"
    plan = LLAMA_PLAN | {"model.embed_tokens": "embedding_colwise"}  # hidden split vs vocab split
    report = fix_plan(plan, cfg(kv=4, tied=True), 4, **KEYS)
    assert "model.embed_tokens" not in report.plan and "lm_head" not in report.plan


def test_tied_embeddings_user_mismatch_is_an_error():
    plan = LLAMA_PLAN | {"model.embed_tokens": "embedding_colwise"}
    with pytest.raises(TensorParallelConfigError, match="tied"):
        fix_plan(plan, cfg(kv=4, tied=True), 4, user_rules={"model.embed_tokens"}, **KEYS)


def test_untied_embeddings_may_differ():
    plan = LLAMA_PLAN | {"model.embed_tokens": "embedding_colwise"}
    assert fix_plan(plan, cfg(kv=4, tied=False), 4, **KEYS).fixes == []


def test_text_config_of_a_composite_model_is_used():
    text = cfg(heads=8, kv=2)
    composite = SimpleNamespace(get_text_config=lambda decoder=True: text)
    assert fix_plan(LLAMA_PLAN, composite, 4, **KEYS).kinds() == ["replicate_attention"]


def test_weight_placement():
    assert weight_placement("embedding_rowwise", embedding=True) == "shard0"
    assert weight_placement("embedding_colwise", embedding=True) == "shard1"
    assert weight_placement("colwise_gather_output", embedding=False) == "shard0"
    assert weight_placement("rowwise", embedding=False) == "shard1"
    assert weight_placement(None, embedding=False) == "replicate"


def test_check_world():
    check_world(4, 4, world_size=4, launched=True)
    with pytest.raises(TensorParallelConfigError, match=r"WORLD_SIZE=2\. Launch with --nproc_per_node=4"):
        check_world(4, 4, world_size=2, launched=True)
    with pytest.raises(TensorParallelConfigError, match="Launch with tp_size=8, or --nproc_per_node=4"):
        check_world(4, 4, world_size=8, launched=True)
    with pytest.raises(TensorParallelConfigError, match="Launch with tp_size=4, or --nproc_per_node=3"):
        check_world(3, 3, world_size=4, launched=True)
    with pytest.raises(TensorParallelConfigError, match="not started by a launcher"):
        check_world(2, 2, world_size=None, launched=False)


def test_integration_patches_and_reverts():
    from transformers.distributed import mixin
    from transformers.generation import utils as generation_utils

    import hf_tpu

    def current():
        return (
            mixin.DistributedMixin._resolve_parallel_plans,
            mixin.initialize_distributed_mesh,
            generation_utils.get_kv_heads_per_rank,
        )

    before = current()
    with hf_tpu.enabled("tensor_parallel"):
        assert current()[0] is not before[0]
        assert current()[1].__wrapped__ is before[1] and current()[2].__wrapped__ is before[2]
        # the static cache holds one KV head per rank under the "repeat" strategy, upstream's count otherwise
        plan = {"model.layers.*.self_attn.k_proj": "hf_tpu_kv_head_select_2"}
        assert generation_utils.get_kv_heads_per_rank(plan, 2, 4) == 1
        assert generation_utils.get_kv_heads_per_rank({"x.k_proj": "colwise"}, 8, 4) == 2
    assert current() == before


def test_repeat_kv_heads_keeps_queries_sharded():
    report = fix_plan(QWEN3_PLAN, cfg(heads=8, kv=2), 4, kv_heads_strategy="repeat", **KEYS)
    assert report.kinds() == ["repeat_kv_heads"]
    assert report.plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert report.plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert report.plan["model.layers.*.self_attn.k_proj"] == "hf_tpu_kv_head_select_2"
    assert report.plan["model.layers.*.self_attn.v_proj"] == "hf_tpu_kv_head_select_2"
    assert report.plan["model.layers.*.self_attn"] == "hf_tpu_local_gqa_8"
    assert report.plan["model.layers.*.self_attn.k_norm"] == "replicated_with_grad_allreduce"


def test_repeat_kv_heads_falls_back_to_replication_when_it_cannot_apply():
    # tp_size=3 is not a multiple of 2 KV heads; 6 query heads would divide, but the KV heads cannot be spread.
    report = fix_plan(LLAMA_PLAN, cfg(heads=6, kv=2, vocab=999), 3, kv_heads_strategy="repeat", **KEYS)
    assert report.kinds() == ["replicate_attention"]
    with pytest.raises(ValueError, match="kv_heads_strategy"):
        fix_plan(LLAMA_PLAN, cfg(), 4, kv_heads_strategy="nope", **KEYS)
