"""Fine-grained fp8 checkpoints (DeepSeek-V3, Qwen3-FP8: ``float8_e4m3fn`` weights, one float32 scale per 128x128
block) kept in fp8 on a TPU, dequantized block by block inside the compiled graph.

transformers 5.24 loads such a checkpoint into ``FP8Linear`` modules whose forward calls DeepGEMM or Triton
kernels (CUDA only); with no CUDA device its quantizer dequantizes every weight to bf16 at load instead (twice the
bytes of the checkpoint). On a TPU hf_tpu keeps the ``FP8Linear`` modules and their fp8 weights, and runs
:func:`fp8_block_linear`: ``weight.to(float32) * scale`` (each scale repeated over its block, computed in float32
as transformers' own dequantization does, so the result equals the CPU's bf16 weights exactly), cast to the
activations' dtype, then ``linear``. Every op has a torch-tpu kernel (``_to_copy``, ``repeat_interleave.self_int``,
``mul.out``, ``linear``).

Why not torch-tpu's blockwise scaled-matmul Pallas kernels (``torch_tpu/_internal/ops/scaled_mm/kernels``):
``scaled_mm_1x128_128x128`` multiplies fp8 *activations* quantized per row and 128-wide K block by fp8 weights
with 128x128 scales (w8a8), a JAX function that the wheel does not register as a torch op (nothing in the wheel's
Python calls it); serving it means quantizing activations to fp8, a different numeric result from the
weight-only dequantization the CPU reference runs, and a JAX bridge call per Linear. See docs/quantization.md.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_blocks", "fp8_block_linear"]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (fp8, ``(N, K)``) times its per-block ``scale_inv`` (``(N / bn, K / bk)``), in ``dtype``."""
    rows, cols = weight.shape
    scale = scale_inv.to(torch.float32)
    if scale.dim() == 2:
        block_rows, block_cols = rows // scale.shape[0], cols // scale.shape[1]
        scale = scale.repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)
    return (weight.to(torch.float32) * scale).to(dtype)


def fp8_block_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a transformers ``FP8Linear`` on a TPU: weight-only, dequantized in the graph."""
    weight = dequantize_blocks(module.weight, module.weight_scale_inv, x.dtype)
    return torch.nn.functional.linear(x, weight, module.bias)
