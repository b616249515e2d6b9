"""experts_forward in transformers' experts interface: routings, tiny MoE models, registration, torch.compile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax", reason="the ragged-dot kernel runs in JAX: pip install 'hf-tpu[kernels]'")

from ragged_helpers import experts_reference, make_experts, routing, tiny_moe

import hf_tpu
from hf_tpu.kernels import register_experts, registered_experts, unregister_experts, use_ragged_dot_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kind", "top_k", "num_tokens"),
    # num_tokens * top_k is 8 throughout, so that the cases share one compiled program per dtype
    [
        ("random", 1, 8),
        ("random", 2, 4),
        ("random", 8, 1),
        ("one_expert", 4, 2),
        ("one_expert", 1, 8),
        ("half_empty", 2, 4),
        ("half_empty", 8, 1),
    ],
)
def test_experts_forward_matches_float64(kernel, kind, top_k, num_tokens, dtype):
    module = make_experts(num_experts=8, dtype=dtype)
    g = torch.Generator().manual_seed(top_k * 100 + num_tokens)
    index, weights = routing(kind, num_tokens, 8, top_k, g)
    x = torch.randn(num_tokens, 32, generator=g).to(dtype)
    with torch.no_grad():
        out = kernel.experts_forward(module, x, index, weights.to(dtype))
        eager = module.forward.__wrapped__(module, x, index, weights.to(dtype))  # upstream's own loop
    ref = experts_reference(module, x, index, weights.to(dtype))
    assert out.shape == x.shape and out.dtype == dtype
    scale = ref.abs().max().item()
    tol = 1e-5 * scale if dtype == torch.float32 else 2e-2 * scale
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    # no worse than transformers' eager loop in the same dtype (plus a little slack for rounding order)
    assert (out.double() - ref).abs().max() <= (eager.double() - ref).abs().max() * 2 + tol / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfused_path_for_other_activations_matches_the_eager_loop(kernel, dtype):
    """A non-SiLU activation takes the two-ragged-dot path with the module's own gate (upstream's eager loop
    applies the same act_fn, so it is the reference here)."""
    module = make_experts(num_experts=8, dtype=dtype)
    assert kernel._fusable(module)
    module.act_fn = torch.nn.GELU()
    assert not kernel._fusable(module)
    g = torch.Generator().manual_seed(5)
    index, weights = routing("half_empty", 4, 8, 2, g)
    x = torch.randn(4, 32, generator=g).to(dtype)
    with torch.no_grad():
        out = kernel.experts_forward(module, x, index, weights.to(dtype))
        eager = module.forward.__wrapped__(module, x, index, weights.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, eager, atol=tol, rtol=tol)


def test_expert_parallel_sentinels_contribute_nothing(kernel):
    module = make_experts(num_experts=8)
    module._is_expert_parallel = True
    g = torch.Generator().manual_seed(3)
    index, weights = routing("random", 4, 8, 2, g)
    x = torch.randn(4, 32, generator=g)
    sentinel = index.clone()
    sentinel[:, 1] = 8  # the second choice lives on another rank
    with torch.no_grad():
        out = kernel.experts_forward(module, x, sentinel, weights)
    only_first = weights.clone()
    only_first[:, 1] = 0
    torch.testing.assert_close(out.double(), experts_reference(module, x, index, only_first), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_moe_model_logits_and_greedy_tokens_match_eager(family, tmp_path):
    cls, config = tiny_moe(family)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    name = use_ragged_dot_experts()
    eager = cls.from_pretrained(tmp_path, experts_implementation="eager").eval()
    fast = cls.from_pretrained(tmp_path, experts_implementation=name).eval()
    assert fast.config._experts_implementation == name
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    with torch.no_grad():
        torch.testing.assert_close(
            fast(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5
        )
    kwargs = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    torch.testing.assert_close(fast.generate(ids, **kwargs), eager.generate(ids, **kwargs), atol=0, rtol=0)


def test_register_is_reversible_and_refuses_silent_overrides(kernel):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    hf_tpu.disable()
    before = dict(ExpertsInterface._global_mapping)
    assert register_experts("test_ragged", kernel) == "test_ragged"
    assert register_experts("test_ragged", kernel.experts_forward) == "test_ragged"  # same function: no-op
    assert ALL_EXPERTS_FUNCTIONS["test_ragged"] is kernel.experts_forward
    with pytest.raises(ValueError, match="already registered"):
        register_experts("grouped_mm", kernel)
    register_experts("grouped_mm", kernel, replace=True)
    assert ALL_EXPERTS_FUNCTIONS["grouped_mm"] is kernel.experts_forward
    unregister_experts("grouped_mm")
    assert ExpertsInterface._global_mapping["grouped_mm"] is before["grouped_mm"]
    hf_tpu.disable()  # reverts everything hf_tpu registered, this name included
    assert "test_ragged" not in ExpertsInterface._global_mapping
    assert "test_ragged" not in registered_experts()
    assert dict(ExpertsInterface._global_mapping) == before
    with pytest.raises(AttributeError, match="experts_forward"):
        register_experts("x", torch)


def test_enable_makes_the_name_available_and_disable_removes_it():
    from transformers.integrations.moe import ExpertsInterface

    hf_tpu.disable()
    with hf_tpu.enabled("kernels"):
        assert "ragged_dot_tpu" in ExpertsInterface._global_mapping
    assert "ragged_dot_tpu" not in ExpertsInterface._global_mapping


def test_experts_module_compiles_fullgraph_once_for_all_routings(kernel):
    module = make_experts(num_experts=8)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x, index, weights):
        return kernel.experts_forward(module, x, index, weights)

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    with torch.no_grad():
        for kind in ("random", "one_expert", "half_empty", "random"):
            index, weights = routing(kind, 4, 8, 2, g)
            torch.testing.assert_close(compiled(x, index, weights), f(x, index, weights))
    assert len(graphs) == 1
