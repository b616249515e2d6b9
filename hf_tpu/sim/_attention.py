"""scaled_dot_product_attention on the simulated device through the CPU's fused kernel.

sdpa picks its fused kernel with a C++ DispatchStub that a Python backend cannot register, so on PrivateUse1 it
always decomposes into the math path: ~10 ops, the bmm-softmax-bmm intermediates, and different rounding from
the CPU reference. torch_tpu runs one fused attention instead. This module registers sdpa for
AutogradPrivateUse1: forward and backward run torch's own CPU sdpa (and its autograd) on the host views, so
the simulated device computes what the CPU computes, as one device op. Dropout keeps the math path, which draws
from the device generator.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_tpu.sim._counters import STATE
from hf_tpu.sim._tensors import host_view, is_sim_tensor, to_device

__all__ = ["install"]

_LIB: torch.library.Library | None = None
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _count(*tensors: torch.Tensor | None, params: tuple = ()) -> None:
    STATE.ops += 1
    if STATE.in_graph:
        return
    # is_causal and scale are in torch_tpu's cache key for its flash attention (see docs/simulator.md)
    key = ("sdpa", *((t.shape, t.dtype) for t in tensors if t is not None), *params)
    if key not in STATE.seen:
        STATE.seen.add(key)
        STATE.shape_signatures += 1


class _CpuSdpa(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        _count(q, k, v, mask, params=(is_causal, scale, enable_gqa))
        inputs = [host_view(t).detach() for t in (q, k, v)]
        hmask = host_view(mask).detach() if mask is not None else None
        needs = ctx.needs_input_grad
        for t, need in zip(inputs, needs[:3], strict=True):
            t.requires_grad_(need)
        if hmask is not None and hmask.is_floating_point():
            hmask.requires_grad_(needs[3])
        with torch.enable_grad():
            out = _SDPA(*inputs, hmask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        ctx.cpu_graph = (out, inputs, hmask)
        return to_device(out.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        out, inputs, hmask = ctx.cpu_graph
        del ctx.cpu_graph
        wanted = [t for t in (*inputs, hmask) if t is not None and t.requires_grad]
        _count(grad_out)
        grads = torch.autograd.grad(out, wanted, host_view(grad_out.contiguous()), allow_unused=True)
        it = iter(grads)
        result = []
        for t in (*inputs, hmask):
            g = next(it) if t is not None and t.requires_grad else None
            result.append(to_device(g) if g is not None else None)
        return (*result, None, None, None)


def _is_sim(t: torch.Tensor | None) -> bool:
    return t is None or is_sim_tensor(t)


def _sdpa_autograd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if dropout_p > 0.0 or not all(_is_sim(t) for t in (query, key, value, attn_mask)):
        return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return _CpuSdpa.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def install() -> None:
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa_autograd, "AutogradPrivateUse1")
    _LIB = lib
