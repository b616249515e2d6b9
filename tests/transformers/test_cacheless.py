"""Generation without a cache (``use_cache=False``, or a model that keeps none): hf_tpu's loop recomputes the whole
sequence each step in one compiled graph over a bucket-long buffer, token-identical to upstream's ``generate`` on
the CPU, with one small copy each way per step and no compile for a second prompt length in the bucket."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import generation

GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}



@pytest.fixture(scope="module")
def openai_gpt(from_config):
    # OpenAI GPT's forward takes no cache: every step recomputes the whole sequence (upstream's loop too)
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    config = OpenAIGPTConfig(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    return from_config(OpenAIGPTLMHeadModel, config)


@pytest.fixture(scope="module")
def mpt(from_config):
    # MPT's config turns the cache off (use_cache=False), so its generate runs without one; ALiBi, no position_ids
    from transformers import MptConfig, MptForCausalLM

    config = MptConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
    assert not config.use_cache
    return from_config(MptForCausalLM, config)


def _copies_per_step(tpu, ids, **kw) -> tuple[float, float]:
    with hf_tpu.sim.stats() as short:
        tpu.generate(ids, max_new_tokens=2, **kw)
    with hf_tpu.sim.stats() as long:
        tpu.generate(ids, max_new_tokens=12, **kw)
    return (long.h2d_copies - short.h2d_copies) / 10, (long.d2h_copies - short.d2h_copies) / 10


@pytest.mark.parametrize("family", ["openai_gpt", "mpt"])
def test_two_prompt_lengths_in_one_bucket_match_cpu_with_no_compile_for_the_second(family, request, prompts):
    cpu, tpu = request.getfixturevalue(family)
    first, second = prompts([5])[0], prompts([11], seed=1)[0]
    kw = {**GREEDY, "max_new_tokens": 8}
    assert torch.equal(tpu.generate(first, **kw), cpu.generate(first, **kw))
    with hf_tpu.sim.stats() as s:
        got = tpu.generate(second, **kw)
    assert torch.equal(got, cpu.generate(second, **kw))
    assert s.compiles == 0 and s.shape_signatures <= 4
    assert {k[0] for k in generation.compiled_graphs(tpu)} == {"cacheless_prefill", "cacheless_decode"}
    h2d, d2h = _copies_per_step(tpu, second, **GREEDY)
    assert h2d <= 1 and d2h <= 1


def test_a_left_padded_batch_and_the_device_sampling_plan_match_cpu(openai_gpt, prompts):
    cpu, tpu = openai_gpt
    ids, mask = prompts([4, 9])
    # positions (OpenAI GPT takes position_ids) and the mask of a padded row as upstream's; a repetition penalty
    # and an n-gram ban run in the graph on the device history
    kw = {**GREEDY, "attention_mask": mask, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2}
    assert torch.equal(tpu.generate(ids, max_new_tokens=8, **kw), cpu.generate(ids, max_new_tokens=8, **kw))
    kinds = {k[0] for k in generation.compiled_graphs(tpu)}
    assert "cacheless_decode+repetition_penalty+no_repeat_ngram(2)" in kinds, kinds
    h2d, d2h = _copies_per_step(tpu, ids, **kw)
    assert h2d <= 1 and d2h <= 1


def test_use_cache_false_on_a_model_with_a_cache_runs_without_one(prompts, from_config):
    from transformers import LlamaForCausalLM

    from hf_tpu.testing import tiny_config

    cpu, tpu = from_config(LlamaForCausalLM, tiny_config("llama", vocab_size=96, num_hidden_layers=1))
    ids, mask = prompts([3, 7])
    kw = {**GREEDY, "attention_mask": mask, "max_new_tokens": 6, "use_cache": False}
    assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert [k[0] for k in generation.compiled_graphs(tpu)] == ["cacheless_prefill", "cacheless_decode"]


def test_use_cache_false_on_a_class_with_its_own_prepare_inputs_runs_without_one(prompts, from_config):
    # Phi3 overrides prepare_inputs_for_generation (it calls upstream's, which moves the inputs onto the model's
    # device): the check that the override makes no inputs of its own compared tpu tensors with host ones, failed
    # on a tpu model, and sent every use_cache=False call of such a class to upstream's loop
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=37, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cpu, tpu = from_config(Phi3ForCausalLM, config)
    ids, mask = prompts([3, 7])
    kw = {**GREEDY, "attention_mask": mask, "max_new_tokens": 6, "use_cache": False}
    assert hf_tpu.transformers.explain(tpu, input_ids=ids, **kw).loop == "cacheless"
    assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert [k[0] for k in generation.compiled_graphs(tpu)] == ["cacheless_prefill", "cacheless_decode"]


def test_warmup_compiles_the_graphs_and_strict_mode_then_compiles_nothing(openai_gpt, prompts):
    from transformers import OpenAIGPTLMHeadModel

    cpu, _ = openai_gpt
    tpu = OpenAIGPTLMHeadModel(cpu.config).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    report = hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[1], max_new_tokens=6, strict=True, progress=False)
    assert {k[0] for k in report.graphs} == {"cacheless_prefill", "cacheless_decode"}
    try:
        for n in (3, 9, 16):
            ids = prompts([n], seed=n)[0]
            with hf_tpu.sim.stats() as s:
                got = tpu.generate(ids, max_new_tokens=6, **GREEDY)
            assert torch.equal(got, cpu.generate(ids, max_new_tokens=6, **GREEDY))
            assert s.compiles == 0
        with pytest.raises(generation.RecompileError, match="cacheless_prefill graph for batch=2"):
            tpu.generate(prompts([3, 5])[0], max_new_tokens=6, **GREEDY)  # batch 2 was never warmed
    finally:
        generation.configure(tpu, strict=False)


def tiny_rwkv_config():
    from transformers import RwkvConfig

    return RwkvConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=64,
    )  # fmt: skip


def test_a_model_with_a_cache_of_its_own_runs_without_one(prompts, from_config):
    # RWKV keeps its recurrent state in a cache class of its own, which has no bucketed form: the loop without a
    # cache serves it (the padding after the sequence never reaches the state of the positions before it)
    from transformers import RwkvForCausalLM

    config = tiny_rwkv_config()
    cpu, tpu = from_config(RwkvForCausalLM, config)
    generation.WARNED.clear()
    kw = {**GREEDY, "max_new_tokens": 6}
    first, second = prompts([5])[0], prompts([9], seed=1)[0]
    with pytest.warns(UserWarning, match="keeps its own cache type.*generate runs hf_tpu's loop without a cache"):
        assert torch.equal(tpu.generate(first, **kw), cpu.generate(first, **kw))
    with hf_tpu.sim.stats() as s:
        assert torch.equal(tpu.generate(second, **kw), cpu.generate(second, **kw))
    assert s.compiles == 0
    assert {k[0] for k in generation.compiled_graphs(tpu)} == {"cacheless_prefill", "cacheless_decode"}
    # warm-up of a fresh model compiles the graphs without a cache
    fresh = RwkvForCausalLM(config).eval().to("tpu")
    report = hf_tpu.warmup(fresh, max_prompt_len=8, batch_sizes=[1], max_new_tokens=8, progress=False)
    assert {k[0] for k in report.graphs} == {"cacheless_prefill", "cacheless_decode"}


@pytest.mark.tpu_precision("medium")
def test_whether_a_cache_changes_the_outputs_is_asked_in_float32_at_any_precision(from_config):
    # the check that keeps a model whose forward reads its cache past the layers' update off the loop without a cache
    # asks upstream's loop (with the model's own cache) and a forward without one: at a TPU's default precision (one
    # bfloat16 pass) a tiny Llama's one-token step and full forward differ by ~1e-3 of the logits, which read as a
    # model that computes otherwise with a cache; the check runs at 'highest' and puts the setting back
    from transformers import DoryForCausalLM, LlamaForCausalLM, RwkvForCausalLM

    from hf_tpu.testing import tiny_config
    from hf_tpu.transformers._loops.cacheless import cache_changes_outputs

    _, llama = from_config(LlamaForCausalLM, tiny_config("llama"))
    assert cache_changes_outputs(llama) is None
    assert torch.get_float32_matmul_precision() == "medium"
    _, rwkv = from_config(RwkvForCausalLM, tiny_rwkv_config())
    assert cache_changes_outputs(rwkv) is None  # its own cache (``state``), as upstream's loop runs it
    _, dory = from_config(DoryForCausalLM, tiny_config("dory", vocab_size=96, recurrent_kv_cache_mode="last_loop"))
    assert "outputs with a cache differ from its outputs without one" in cache_changes_outputs(dory)


def test_the_buffer_keeps_within_the_position_table_of_a_model_numbering_its_tokens(prompts, from_config):
    # TrOCR numbers its tokens itself (no position_ids): past its 24 positions a bucket's padding would have none
    from transformers import TrOCRConfig, TrOCRForCausalLM

    config = TrOCRConfig(
        vocab_size=96, d_model=32, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64,
        max_position_embeddings=24,
    )  # fmt: skip
    cpu, tpu = from_config(TrOCRForCausalLM, config)
    kw = {**GREEDY, "max_new_tokens": 12, "use_cache": False}  # a cache bucket past the 24 positions
    for n, seed in ((5, 0), (9, 1)):
        ids = prompts([n], seed=seed)[0]
        assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert generation.compiled_graphs(tpu) == [("cacheless_prefill", 1, 24), ("cacheless_decode", 1, 24)]
    assert generation.plan_shapes(tpu, 1, 9, 12).cache_bucket > 24


def test_the_graphs_are_stored_in_and_loaded_from_the_persistent_compile_cache(openai_gpt, prompts, tmp_path):
    from transformers import OpenAIGPTLMHeadModel

    cpu, _ = openai_gpt
    reports = []
    for _ in range(2):  # a second model (a new process would do the same): loaded, not compiled
        tpu = OpenAIGPTLMHeadModel(cpu.config).eval()
        tpu.load_state_dict(cpu.state_dict())
        tpu = tpu.to("tpu")
        kw = {"max_prompt_len": 16, "batch_sizes": [1], "max_new_tokens": 6, "progress": False}
        reports.append(hf_tpu.warmup(tpu, cache_dir=tmp_path, **kw))
    assert (reports[0].new_compiles, reports[1].new_compiles, reports[1].from_cache) == (2, 0, 2)
    ids, kw = prompts([7])[0], {**GREEDY, "max_new_tokens": 6}
    with hf_tpu.sim.stats() as s:
        assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert s.compiles == 0
