"""scaled_dot_product_attention on the simulated device: the backend a chip picks, computed by the CPU's kernel.

On a chip, torch's composite sdpa asks torch_tpu's ``_fused_sdp_choice`` stub (``AtenFusedSdpChoice``, registered
with REGISTER_PRIVATEUSE1_DISPATCH) for a backend; its rules, read from torch-tpu 0.2.0's glue library strings:

- FLASH enabled (torch's default) and the inputs fit its kernel (static shapes, dropout_p in [0, 1), float32 or
  bfloat16, query rank at least 4, batch at least 1, head dim below 128 or a multiple of 128, attn_mask not
  requiring grad): torch_tpu's flash-attention kernel, registered as ``aten::_scaled_dot_product_cudnn_attention``;
- else MATH or OVERRIDEABLE enabled, dropout_p 0, real floating inputs of one rank (at least 4: "SHLO optimized
  MATH"): ``aten::_scaled_dot_product_fused_attention_overrideable``;
- else MATH: torch's math decomposition (~10 ops); with every backend disabled, torch_tpu's error.

``_scaled_dot_product_flash_attention_for_cpu``, the CPU's choice, reaches torch_tpu's missing-op fallback, so the
simulator never takes it on a device tensor. A Python backend cannot register that C++ stub, so this module
registers sdpa for AutogradPrivateUse1 and takes the same decision: the two fused kernels run as one device op
(counted and keyed as the chip's op) whose forward and backward are torch's CPU sdpa and its autograd on the host
views, so the numbers equal the CPU's; the math path decomposes on the device. Known difference: with dropout and
FLASH enabled a chip runs its flash kernel with dropout, the simulator the math path (which draws from the device
generator).

A chip's attention kernels run their two float32 contractions (``q @ k.T`` and ``softmax @ v``) at the float32 matmul
precision in force, like every matmul (:mod:`hf_tpu.sim._precision`). While the simulator emulates a precision below
``'highest'`` (its default: ``'medium'``), the fused kernels' float32 forward is computed on the host views by the
math formulation with those two products at that precision (:func:`hf_tpu.sim._precision.matmul`; the softmax in
float32, a fully masked row 0 as the CPU's kernel gives), and its backward by autograd through it; at ``'highest'``,
or with emulation off, by the CPU's kernel as above. The math path's matmuls are device ops, emulated anyway.
"""

from __future__ import annotations

from typing import Any

import math

import torch

from hf_tpu.sim import _precision
from hf_tpu.sim._counters import STATE
from hf_tpu.sim._tensors import host_view, is_sim_tensor, to_device

__all__ = ["install"]

_LIB: torch.library.Library | None = None
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


FLASH = "aten::_scaled_dot_product_cudnn_attention"  # torch_tpu's flash-attention kernel is registered here
OVERRIDEABLE = "aten::_scaled_dot_product_fused_attention_overrideable"
MATH = "math"
_FLASH_DTYPES = (torch.float32, torch.bfloat16)


def _count(op: str, *tensors: torch.Tensor | None, params: tuple = ()) -> None:
    STATE.ops += 1
    if STATE.in_graph:
        return
    # is_causal and scale are in torch_tpu's cache key for its attention kernels (see docs/simulator.md)
    key = (op, *((t.shape, t.dtype) for t in tensors if t is not None), *params)
    if key not in STATE.seen:
        STATE.seen.add(key)
        STATE.shape_signatures += 1


def _reduced_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """sdpa of host tensors with its two contractions at the emulated float32 matmul precision (torch's math
    formulation; a row with every key masked gives 0, as the CPU's fused kernel does)."""
    length, keys = q.size(-2), k.size(-2)
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = _precision.matmul(q, k.transpose(-2, -1)) * scale  # scaled after the product, as Pallas' flash kernel
    if is_causal:
        causal = torch.ones(length, keys, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = _precision.matmul(torch.ops.aten._safe_softmax(scores, -1), v)
    # in the CPU's fused kernel's layout (batch, query, head, dim) as at 'highest', so that a model's transpose after
    # attention costs the same device ops at every precision
    return out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 else out


class _CpuSdpa(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        op: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        _count(op, q, k, v, mask, params=(is_causal, scale, enable_gqa))
        ctx.op = op
        inputs = [host_view(t).detach() for t in (q, k, v)]
        hmask = host_view(mask).detach() if mask is not None else None
        needs = ctx.needs_input_grad
        for t, need in zip(inputs, needs[1:4], strict=True):
            t.requires_grad_(need)
        if hmask is not None and hmask.is_floating_point():
            hmask.requires_grad_(needs[4])
        with torch.enable_grad():
            if inputs[0].dtype == torch.float32 and _precision.reduced():
                out = _reduced_sdpa(*inputs, hmask, is_causal, scale, enable_gqa)
            else:
                out = _SDPA(*inputs, hmask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        ctx.cpu_graph = (out, inputs, hmask)
        return to_device(out.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        out, inputs, hmask = ctx.cpu_graph
        del ctx.cpu_graph
        wanted = [t for t in (*inputs, hmask) if t is not None and t.requires_grad]
        _count(f"{ctx.op}_backward", grad_out)
        grads = torch.autograd.grad(out, wanted, host_view(grad_out.contiguous()), allow_unused=True)
        it = iter(grads)
        result = []
        for t in (*inputs, hmask):
            g = next(it) if t is not None and t.requires_grad else None
            result.append(to_device(g) if g is not None else None)
        return (None, *result, None, None, None)


def _is_sim(t: torch.Tensor | None) -> bool:
    return t is None or is_sim_tensor(t)


def choose(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
) -> str:
    """The op torch-tpu 0.2.0's ``_fused_sdp_choice`` leads sdpa to: :data:`FLASH`, :data:`OVERRIDEABLE` or
    :data:`MATH` (the decomposition); a RuntimeError, as on a chip, when every backend is disabled."""
    flash_on = torch.backends.cuda.flash_sdp_enabled()
    math_on = torch.backends.cuda.math_sdp_enabled()
    overrideable_on = torch._C._get_overrideable_sdp_enabled()
    same_rank = query.dim() == key.dim() == value.dim()
    if flash_on:
        head = query.size(-1)
        static = not any(isinstance(d, torch.SymInt) for t in (query, key, value) for d in t.shape)
        if (
            static
            and 0.0 <= dropout_p < 1.0
            and query.dtype in _FLASH_DTYPES
            and same_rank
            and query.dim() >= 4
            and query.size(0) >= 1
            and (head < 128 or head % 128 == 0)
            and (attn_mask is None or not attn_mask.requires_grad)
        ):
            return FLASH
    if (math_on or overrideable_on) and dropout_p == 0.0 and same_rank and query.dim() >= 4:
        if query.is_floating_point():
            return OVERRIDEABLE
    if not math_on:
        raise RuntimeError(
            "no viable SDPBackend found: all supported backends are disabled, including the fallback MATH backend; "
            "enable at least one of FLASH, OVERRIDEABLE, or MATH for TorchTPU"
        )
    return MATH


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
    if not all(_is_sim(t) for t in (query, key, value, attn_mask)):
        return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    op = choose(query, key, value, attn_mask, dropout_p)
    if op == MATH or dropout_p > 0.0:
        # torch's composite: it converts a boolean mask, then (no stub is registered from Python) takes the math path
        return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return _CpuSdpa.apply(op, query, key, value, attn_mask, is_causal, scale, enable_gqa)


def install() -> None:
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa_autograd, "AutogradPrivateUse1")
    _LIB = lib
