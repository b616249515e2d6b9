"""The cache probe's CPU fallback: models whose forward reads a tensor value (which the ``meta`` device has not) are
sized by a run on the CPU of a copy with zero weights, to exactly the shapes the real model writes. A forward that
replaces its own modules on its first run only (BigBird's block-sparse attention) runs hf_tpu's loop after that run."""

from __future__ import annotations

import pytest
import torch

from hf_tpu.transformers import explain
from hf_tpu.transformers._cache.static import static_cache_problem
from hf_tpu.transformers._cache.probe import CacheProbeError, _probe_config, _run_probe, cache_shapes
from hf_tpu.transformers._cache.probe_cpu import ZeroWeightProducts, cpu_probe
from hf_tpu.transformers._upstream import cache_name

_TOKENS = {"vocab_size": 96, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
# Each reads a value in its forward: a padding check of its bidirectional mask (.all()), an expert loop (.tolist(),
# .item() over a nonzero result).
CONFIGS = {
    "megatron-bert": ("MegatronBertConfig", "MegatronBertForCausalLM", _SMALL),
    "big_bird": ("BigBirdConfig", "BigBirdForCausalLM", {**_SMALL, "attention_type": "original_full"}),
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_key_value_heads": 2, "kv_channels": 8,
         "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "longcat_flash": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
         "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 4, "ffn_hidden_size": 64,
         "expert_ffn_hidden_size": 16, "n_routed_experts": 4, "zero_expert_num": 1, "moe_topk": 2},
    ),
}


def _model(name: str, **overrides):
    import transformers

    config_class, model_class, fields = CONFIGS[name]
    config = getattr(transformers, config_class)(**{**_TOKENS, **fields, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def _written(model) -> list[tuple]:
    """What the real model's layers write into upstream's cache, run on the CPU with its own weights."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), **{cache_name(): cache}, use_cache=True)
    return [(la.keys.shape[1::2], la.values.shape[1::2], la.keys.dtype) for la in cache.layers]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_cpu_fallback_sizes_the_cache_as_the_real_model_writes_it(name):
    model = _model(name)
    written = _written(model)

    def kv(shapes):
        return [((s["kv"][0], s["kv"][1]), (s["kv"][0], s["kv"][2]), s["kv"][3] or model.dtype) for s in shapes]

    with cpu_probe(model, _probe_config(model)) as probe:  # the fallback itself, whether or not meta runs the model
        on_cpu, cross = _run_probe(model, probe, "cpu")
    assert cross is None and kv(on_cpu) == written
    shapes, cross = cache_shapes(model)  # meta, or the CPU where meta cannot run it (upstream's code decides which)
    assert cross is None and kv(shapes) == written
    assert static_cache_problem(model) is None


def test_the_cpu_copy_holds_no_weights_and_computes_what_zero_weights_compute():
    model = _model("megatron-bert", vocab_size=4096, tie_word_embeddings=True)
    dense = _model("megatron-bert", vocab_size=4096, tie_word_embeddings=True)
    with torch.no_grad():
        for p in dense.parameters():
            p.zero_()
    ids = torch.tensor([[5, 6, 7]])
    with cpu_probe(model, model.config) as probe, torch.no_grad():
        params = list(probe.parameters())
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in params)  # one element each
        assert probe.get_output_embeddings().weight is probe.get_input_embeddings().weight  # tied weights stay tied
        got = probe(input_ids=ids, use_cache=False).logits  # every matrix product with a zero weight answered
    with torch.no_grad():
        want = dense(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)


def test_products_and_gathers_of_zero_weights_are_never_materialized():
    # Materialized, each of these would take more than a 64-bit host's whole address space (128 TiB): the
    # allocation fails at once, whatever the host's overcommit policy, if the mode lets one through.
    weight = torch.zeros(()).expand(8, 1 << 45)
    experts = torch.zeros(()).expand(4, 1 << 23, 1 << 23)
    wide = torch.ones(()).expand(2, 1 << 45)  # an input as wide as the weight
    with ZeroWeightProducts([weight, experts]):
        out = torch.nn.functional.linear(wide, weight, torch.arange(8.0))  # addmm: the bias, broadcast
        picked = experts[torch.tensor([0, 2])]  # an expert's weights per token: still a broadcast zero
        per_token = torch.bmm(torch.ones(()).expand(2, 1, 1 << 23), picked.transpose(1, 2))
    assert torch.equal(out, torch.arange(8.0).expand(2, 8))
    assert per_token.shape == (2, 1, 1 << 23) and not per_token.any()


def test_the_copy_of_a_model_no_host_could_hold_is_built_without_allocating_a_weight():
    import transformers

    config = transformers.MegatronBertConfig(**{**CONFIGS["megatron-bert"][2], **_TOKENS, "vocab_size": 1 << 40})
    with torch.device("meta"):
        model = transformers.MegatronBertForCausalLM(config)  # its embedding alone: 128 TiB in float32
    with cpu_probe(model, config) as probe:
        weight = probe.get_input_embeddings().weight
        assert weight.shape == (1 << 40, 32) and weight.untyped_storage().nbytes() <= weight.element_size()
        positions = probe.bert.embeddings.position_ids  # a buffer: computed on the CPU as the class computes it
        assert torch.equal(positions, torch.arange(config.max_position_embeddings)[None])


def _block_sparse_pair(model_class=None):
    """(cpu, tpu): a tiny BigBird decoder with its default block-sparse attention, the same weights on each device."""
    import transformers

    model_class = model_class or transformers.BigBirdForCausalLM
    cpu = _model("big_bird", attention_type="block_sparse", is_decoder=True, max_position_embeddings=64)
    tpu = model_class(cpu.config).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def test_a_forward_that_replaces_its_own_modules_once_runs_the_loop_like_cpu():
    # BigBird's block-sparse attention swaps itself for full attention on a short input or with a cache, as upstream's
    # first generate does to the model: the probe sees its copy do it, then the real model does it once, eagerly,
    # before the first trace, and its modules stay put from then on.
    import hf_tpu.sim

    cpu, tpu = _block_sparse_pair()
    sparse = type(tpu.bert.encoder.layer[0].attention.self)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    g = torch.Generator().manual_seed(0)
    short, long = torch.randint(3, 96, (1, 5), generator=g), torch.randint(3, 96, (1, 11), generator=g)  # one bucket
    assert torch.equal(tpu.generate(short, **kw), cpu.generate(short, **kw))
    assert static_cache_problem(tpu) is None and explain(tpu).loop == "cached"  # hf_tpu's loop
    swapped = type(tpu.bert.encoder.layer[0].attention.self)
    assert swapped is not sparse and swapped is type(cpu.bert.encoder.layer[0].attention.self)  # as upstream swaps
    with hf_tpu.sim.stats() as second:
        got = tpu.generate(long, **kw)
    assert torch.equal(got, cpu.generate(long, **kw))
    assert second.compiles == 0 and second.shape_signatures <= 4


def test_a_forward_that_replaces_its_own_modules_on_every_run_is_refused_with_its_reason():
    import transformers

    class SwapsOnEveryRun(transformers.BigBirdForCausalLM):
        def forward(self, *args, **kwargs):
            self.bert.set_attention_type("block_sparse")  # new block-sparse modules, which the forward swaps again
            return super().forward(*args, **kwargs)

    _, tpu = _block_sparse_pair(SwapsOnEveryRun)
    sparse = tpu.bert.encoder.layer[0].attention.self
    with pytest.raises(CacheProbeError, match=r"replaces 2 of its own modules .*, and again on every later run"):
        cache_shapes(tpu)
    assert "and again on every later run" in static_cache_problem(tpu)
    assert tpu.bert.encoder.layer[0].attention.self is sparse  # refused before the model itself ran
