"""Weight-only int4 in a layout a TPU can run: two 4-bit codes per byte, unpacked and dequantized in the graph.

torchao's int4 layouts (``Int4Tensor``, ``Int4TilePackedTo4dTensor``, ``Int4OpaqueTensor``, ...) are built for CUDA
or CPU kernels (``mslk``, ``aten._convert_weight_to_int4pack``, ``aten._weight_int4pack_mm``): torch-tpu 0.2.0 sends
those ops to its missing-op fallback, which raises on a chip. :class:`TpuInt4Tensor` keeps the same numbers in a
plain layout instead, and its ``linear`` uses only ops torch-tpu has kernels for (``__rshift__``, ``bitwise_and``,
``cat``, ``_to_copy``, ``sub``, ``mul``, ``mm``/``linear``), so inside a compiled graph XLA can fuse the unpacking
and dequantization into the matmul's operand while the weights stay 4-bit in device memory.

Layout of an ``(N, K)`` weight quantized in groups of ``group_size`` along ``K``:

- ``qdata``: ``uint8`` ``(N, K // 2)``; byte ``j`` holds column ``j`` in its low nibble and column ``j + K // 2``
  in its high nibble (halves, not neighbours: unpacking is one ``cat``, no interleaving reshape);
- ``scale``, ``zero_point``: ``(N, K // group_size)`` in the model's dtype; ``w = (code - zero_point) * scale``,
  codes 0..15, asymmetric min/max per group (the same rounding as torchao's default int4 ``TINYGEMM`` choice of
  parameters, in its integer-zero-point form).

At group size 128 this is 0.53 bytes per weight against bf16's 2 (26.6%).

Example:
    >>> import torch
    >>> w = torch.randn(8, 64)
    >>> q = quantize_int4(w, group_size=32)
    >>> q.qdata.shape, q.qdata.dtype, q.scale.shape
    (torch.Size([8, 32]), torch.uint8, torch.Size([8, 2]))
    >>> bool((q.dequantize() - w).abs().max() < w.abs().max() / 7)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torchao.utils import TorchAOBaseTensor

from hf_tpu.errors import InvalidArgumentError

__all__ = ["TpuInt4Tensor", "quantize_int4"]

aten = torch.ops.aten
_CODE_MAX = 15


class TpuInt4Tensor(TorchAOBaseTensor):
    """An int4 weight (see the module docstring for the layout); ``F.linear`` dequantizes it inside the graph."""

    tensor_data_names = ["qdata", "scale", "zero_point"]
    tensor_attribute_names = ["group_size", "shape"]

    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int, shape):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, device=qdata.device, dtype=scale.dtype, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int, shape):
        super().__init__()
        self.qdata = qdata
        self.scale = scale
        self.zero_point = zero_point
        self.group_size = group_size

    def _quantization_type(self) -> str:
        return f"shape={tuple(self.shape)}, group_size={self.group_size}, device={self.device}"

    def codes(self) -> torch.Tensor:
        """The 4-bit codes as ``uint8`` ``(N, K)`` (low nibbles are the first half of the columns)."""
        return torch.cat([self.qdata & 0x0F, self.qdata >> 4], dim=-1)

    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in ``output_dtype`` (default: the model's dtype), computed from the codes."""
        dtype = output_dtype or self.dtype
        n, k = self.shape
        # code - zero point in int8 (both 0..15: exact, as in the float dtype), then one multiplication that promotes
        # to the float dtype: the dequantized weight is the only full-size float tensor made (1 + 2 bytes per
        # weight live at once where a graph runs op by op, not 2 + 2 from subtracting in the float dtype)
        groups = self.codes().to(torch.int8).view(n, k // self.group_size, self.group_size)
        shifted = groups - self.zero_point.to(torch.int8).unsqueeze(-1)
        return (shifted * self.scale.to(dtype).unsqueeze(-1)).view(n, k)


def quantize_int4(weight: torch.Tensor, group_size: int = 128) -> TpuInt4Tensor:
    """Quantize a 2-D float ``weight`` ``(N, K)`` into :class:`TpuInt4Tensor`, on the weight's own device.

    ``K`` must be a multiple of ``group_size`` (and ``group_size`` even); torchao skips such weights itself, and
    the caller (:func:`hf_tpu.quantization._torchao.quantize_module_int4`) does the same.
    """
    if weight.dim() != 2:
        raise InvalidArgumentError(
            f"int4 on TPU quantizes 2-D Linear weights; got a weight of shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if group_size % 2 or k % group_size:
        raise InvalidArgumentError(
            f"int4 on TPU needs in_features ({k}) to be a multiple of an even group_size ({group_size}); "
            "pick a group_size that divides it (torchao's choices: 32, 64, 128, 256)"
        )
    dtype = weight.dtype
    groups = weight.detach().float().view(n, k // group_size, group_size)
    low = groups.amin(dim=-1).clamp(max=0)
    high = groups.amax(dim=-1).clamp(min=0)
    scale = ((high - low) / _CODE_MAX).clamp(min=torch.finfo(torch.float32).eps)
    zero = (-low / scale).round().clamp(0, _CODE_MAX)
    codes = (groups / scale.unsqueeze(-1)).round() + zero.unsqueeze(-1)
    codes = codes.clamp(0, _CODE_MAX).to(torch.uint8).view(n, k)
    qdata = codes[:, : k // 2] | (codes[:, k // 2 :] << 4)
    # Stored in the model's dtype; the codes' zero points are integers 0..15, exact in bf16.
    return TpuInt4Tensor(qdata.contiguous(), scale.to(dtype), zero.to(dtype), group_size, weight.shape)


implements = TpuInt4Tensor.implements
implements_torch_function = TpuInt4Tensor.implements_torch_function


@implements(aten.linear.default)
@implements_torch_function(torch.nn.functional.linear)
def _linear(func: Any, types: Any, args: tuple, kwargs: dict | None) -> torch.Tensor:
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)

