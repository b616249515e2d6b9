"""The kernel's host path (CPU and the simulated device): the DLPack import, the kept expert matrices, the fused op's
input checks. Every result is compared with a float64 reference or with the same call through the plain path."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

pytest.importorskip("jax", reason="the ragged-dot kernel runs in JAX: pip install 'hf-tpu[kernels]'")

from ragged_helpers import experts_reference, jax_kernels, kernel_ops, make_experts, ragged_dot_reference, routing


def _layer(seed: int, tokens: int, num_experts: int = 4):
    """A tiny SiLU-gated experts module, tokens and a routing (top-2)."""
    module = make_experts(num_experts=num_experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 32, generator=g)
    index, weights = routing("random", tokens, num_experts, 2, g)
    return module, x, index, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_fast_import_shares_memory_and_matches_the_public_api(kernel, dtype):
    ops = kernel_ops(kernel)
    t = (torch.arange(24) - 7).reshape(2, 3, 4).to(dtype)
    fast = ops._to_jax(t)
    public = ops._public_to_jax(t)
    assert fast.dtype == public.dtype and fast.shape == public.shape
    np.testing.assert_array_equal(np.asarray(fast.astype("float32")), np.asarray(public.astype("float32")))
    assert fast.unsafe_buffer_pointer() == t.data_ptr()  # a view, not a copy


def test_public_import_is_used_where_the_fast_one_is_unavailable(kernel, monkeypatch):
    ops = kernel_ops(kernel)
    module, x, index, weights = _layer(2, 3)
    with torch.no_grad():
        expected = kernel.experts_forward(module, x, index, weights)
        monkeypatch.setattr(ops, "_fast_cpu_importer", lambda: None)
        monkeypatch.setattr(ops, "_importer", None)
        monkeypatch.setattr(ops, "_MATRICES", {})
        out = kernel.experts_forward(module, x, index, weights)
    assert ops._importer is ops._public_to_jax
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_expert_matrices_are_kept_per_weight_and_follow_in_place_updates(kernel):
    ops = kernel_ops(kernel)
    module, x, index, weights = _layer(3, 5)
    with torch.no_grad():
        kernel.experts_forward(module, x, index, weights)
        kept = ops._MATRICES[id(module.gate_up_proj)][1]
        assert len(kept) == 4
        assert kept[1].unsafe_buffer_pointer() == module.gate_up_proj[1].data_ptr()
        kernel.experts_forward(module, x, index, weights)
        assert ops._MATRICES[id(module.gate_up_proj)][1] is kept  # not imported again

        module.gate_up_proj.mul_(-0.5)  # in place: the kept views see it
        out = kernel.experts_forward(module, x, index, weights)
        assert ops._MATRICES[id(module.gate_up_proj)][1] is kept
        torch.testing.assert_close(out.double(), experts_reference(module, x, index, weights), atol=1e-5, rtol=0)

        module.down_proj.data = module.down_proj.data * 3  # new memory: new views on the next call
        out = kernel.experts_forward(module, x, index, weights)
        assert ops._MATRICES[id(module.down_proj)][0][0] == module.down_proj.data_ptr()
        torch.testing.assert_close(out.double(), experts_reference(module, x, index, weights), atol=1e-5, rtol=0)


def test_expert_matrices_are_dropped_with_their_weight(kernel):
    ops = kernel_ops(kernel)
    module, x, index, weights = _layer(4, 2)
    with torch.no_grad():
        kernel.experts_forward(module, x, index, weights)
    keys = {id(module.gate_up_proj), id(module.down_proj)}
    assert keys <= ops._MATRICES.keys()
    del module
    gc.collect()
    assert not keys & ops._MATRICES.keys()


def test_non_contiguous_weights_take_the_whole_array(kernel):
    ops = kernel_ops(kernel)
    g = torch.Generator().manual_seed(5)
    lhs = torch.randn(40, 16, generator=g)
    rhs = torch.randn(6, 16, 24, generator=g).transpose(1, 2)  # (G, N, K) view of a (G, K, N) tensor
    assert not rhs.is_contiguous()
    sizes = torch.tensor([7, 0, 12, 1, 0, 15])
    out = kernel.ragged_dot(lhs, rhs, sizes, rhs_transposed=True)
    assert id(rhs) not in ops._MATRICES
    ref = ragged_dot_reference(lhs.numpy(), rhs.numpy(), sizes.numpy(), rhs_transposed=True)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rhs_transposed", [False, True])
def test_split_weights_match_the_weight_array(kernel, rhs_transposed):
    """The JAX loop given the G matrices (the host path's default) equals the loop given the (G, ., .) array."""
    jk = jax_kernels(kernel)
    rng = np.random.default_rng(6)
    for m, g in ((9, 5), (300, 12)):
        lhs = rng.standard_normal((m, 24)).astype(np.float32)
        rhs = rng.standard_normal((g, 40, 24) if rhs_transposed else (g, 24, 40)).astype(np.float32)
        sizes = rng.multinomial(m - 2, [1 / g] * g).astype(np.int32)
        sizes[1] = 0
        whole = jk.ragged_dot_xla_tiled(lhs, rhs, sizes, rhs_transposed=rhs_transposed)
        split = jk.ragged_dot_xla_tiled(lhs, tuple(rhs), sizes, rhs_transposed=rhs_transposed)
        ref = ragged_dot_reference(lhs, rhs, sizes, rhs_transposed)
        np.testing.assert_allclose(np.asarray(split), ref, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(whole), ref, rtol=1e-5, atol=1e-4)


def test_fused_op_rejects_bad_inputs_with_the_fix(kernel):
    module = make_experts(num_experts=4)
    x = torch.randn(3, 32)
    index, weights = routing("random", 3, 4, 2, torch.Generator().manual_seed(7))
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    with pytest.raises(ValueError, match=r"int32.*\.int\(\)"):
        kernel.experts_op(x, index.long(), weights, gate_up, down, True, "auto")
    with pytest.raises(ValueError, match="3 tokens but routing for 2"):
        kernel.experts_op(x, index[:2].int(), weights[:2], gate_up, down, True, "auto")
    with pytest.raises(ValueError, match="hidden size 16 does not fit"):
        kernel.experts_op(x[:, :16], index.int(), weights, gate_up, down, True, "auto")
    with pytest.raises(ValueError, match="cast one of them"):
        kernel.experts_op(x, index.int(), weights, gate_up, down.double(), True, "auto")
    with pytest.raises(ValueError, match="compiles a TPU"):
        kernel.experts_op(x, index.int(), weights, gate_up, down, True, "pallas")


@pytest.mark.parametrize("implementation", ["xla", "xla_tiled", "pallas_interpret"])
def test_fused_op_every_host_implementation_matches_float64(kernel, implementation):
    module = make_experts(num_experts=8)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 32, generator=g)
    index, weights = routing("half_empty", 6, 8, 3, g)
    with torch.no_grad():
        out = kernel.experts_op(x, index.int(), weights, module.gate_up_proj, module.down_proj, True, implementation)
    torch.testing.assert_close(out.double(), experts_reference(module, x, index, weights), atol=1e-5, rtol=0)


def test_a_weight_jax_would_copy_is_not_kept_and_not_retried(kernel, monkeypatch):
    """If JAX copied a matrix on import (a misaligned one, say), views would go stale: the weight takes the
    whole-array path, and the failed import is remembered instead of repeated on every call."""
    ops = kernel_ops(kernel)
    module, x, index, weights = _layer(9, 4)
    matrix_ptrs = {w[g].data_ptr() for w in (module.gate_up_proj, module.down_proj) for g in range(4)}
    imports = []
    real = ops._to_jax

    def copying(t):
        array = real(t)
        if t.data_ptr() in matrix_ptrs and t.dim() == 2:  # an expert matrix: comes back as a copy
            imports.append(t.data_ptr())
            return array.copy()
        return array

    monkeypatch.setattr(ops, "_to_jax", copying)
    monkeypatch.setattr(ops, "_MATRICES", {})
    with torch.no_grad():
        first = kernel.experts_forward(module, x, index, weights)
        tried = len(imports)
        second = kernel.experts_forward(module, x, index, weights)
    assert tried == 2 * 4  # both weights, 4 experts each, once
    assert len(imports) == tried
    assert ops._MATRICES[id(module.gate_up_proj)][1] is None
    torch.testing.assert_close(first.double(), experts_reference(module, x, index, weights), atol=1e-5, rtol=0)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
