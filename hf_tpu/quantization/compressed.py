"""compressed-tensors checkpoints (w8a16, w4a16: the ``pack-quantized`` format of RedHatAI/neuralmagic models) kept
packed on a TPU, unpacked and dequantized inside the compiled graph at each matmul.

transformers 5.24 loads such a checkpoint through ``CompressedTensorsHfQuantizer``: each targeted Linear holds the
checkpoint's tensors (``weight_packed``: int32, ``32 / num_bits`` codes per word; ``weight_scale``;
``weight_zero_point`` when asymmetric, packed along the rows; ``weight_shape``), and a forward pre-hook that
compressed-tensors puts on the model decompresses *every* weight to the model's dtype on the first forward, which
takes the bf16 model's device memory. On a TPU hf_tpu keeps the packed tensors and gives each such Linear a forward
that runs :func:`dequantize_packed` then ``linear``: the same numbers as compressed-tensors' own decompression
(``(code - zero_point) * scale`` in the scale's dtype), computed from the packed words with ops torch-tpu has
kernels for (``__rshift__.Scalar``, ``bitwise_and``, ``_to_copy``, ``stack``, ``sub``, ``mul``, ``linear``).
Codes are taken out of the int32 words with shifts and masks, not by viewing the words as bytes (compressed-tensors'
4-bit path), so the result does not depend on the device's byte order.

Kept packed: ``pack-quantized`` Linears with integer weights of 2, 4 or 8 bits (codes never straddle a word),
strategy ``tensor``, ``channel`` or ``group``, symmetric or not, and no activation quantization (``a16``). A model
with any other compressed module (w8a8 or w4a8 activation quantization, fp8 or fp4 formats, a quantized embedding),
or with compressed modules off the TPU, keeps upstream's path, with a warning: decompressed to the model's dtype on
the first forward.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Any

import torch

__all__ = ["COMPRESSED_TENSORS_VERSIONS", "PackedLayout", "dequantize_packed", "keep_packed_on_tpu", "unpack_codes"]

COMPRESSED_TENSORS_VERSIONS = ">=0.20,<0.21"
_BITS = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """What a packed Linear's forward needs besides its tensors: read once at load, constants in the graph."""

    num_bits: int
    strategy: str  # "tensor", "channel" or "group"
    group_size: int | None
    shape: tuple[int, int]  # the unpacked weight's (out_features, in_features)


def unpack_codes(packed: torch.Tensor, num_bits: int, columns: int, signed: bool = False) -> torch.Tensor:
    """The unsigned codes (``value + 2**(num_bits - 1)``) of ``packed`` (int32, packed along its last dimension as
    compressed-tensors' ``pack_to_int32`` does: code ``i`` at bit ``i * num_bits``), as ``uint8`` ``(rows, columns)``;
    with ``signed``, the values themselves (``code - 2**(num_bits - 1)``) as ``int8``.

    Example:
        >>> import torch
        >>> from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        >>> q = torch.tensor([[-8, 7, 0, 3, -1, 5, 6, -2]], dtype=torch.int8)
        >>> unpack_codes(pack_to_int32(q, 4), 4, 8).tolist()
        [[0, 15, 8, 11, 7, 13, 14, 6]]
        >>> torch.equal(unpack_codes(pack_to_int32(q, 4), 4, 8, signed=True), q)
        True
    """
    per_word, mask = 32 // num_bits, (1 << num_bits) - 1
    offset, dtype = (1 << (num_bits - 1), torch.int8) if signed else (0, torch.uint8)
    # one (rows, words) slice per position in the word, narrowed at once: int32 temporaries of a slice, not of all
    parts = [(((packed >> (num_bits * i)) & mask) - offset).to(dtype) for i in range(per_word)]
    codes = torch.stack(parts, dim=-1).view(*packed.shape[:-1], packed.shape[-1] * per_word)
    return codes[..., :columns]


def dequantize_packed(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``module``'s weight in ``dtype`` (default: its scale's dtype), from its packed tensors: the numbers of
    compressed-tensors' ``dequantize`` (``(value - zero_point) * scale`` computed in the scale's dtype).

    The values and zero points are integers that the scale's dtype holds exactly (at most 8 bits), so they are
    subtracted as integers (int8; int16 for 8-bit weights with zero points) and the multiplication by the scale
    promotes to its dtype: the same numbers as converting first, with the dequantized weight the only full-size
    float tensor made (1 + 2 bytes per weight live at once where a graph runs op by op, not 2 + 2).
    """
    layout: PackedLayout = module._hf_tpu_packed
    rows, columns = layout.shape
    scale = module.weight_scale
    weight = unpack_codes(module.weight_packed, layout.num_bits, columns, signed=True)
    zero_point = getattr(module, "weight_zero_point", None)
    if zero_point is not None and zero_point.dtype == torch.int32 and layout.strategy in ("group", "channel"):
        zero_point = unpack_codes(zero_point.t(), layout.num_bits, rows, signed=True).t()  # packed along the rows
    if layout.strategy == "group":  # one scale (and zero point) per group of group_size columns
        weight = weight.view(rows, columns // layout.group_size, layout.group_size)
        scale = scale.unsqueeze(-1)
        zero_point = None if zero_point is None else zero_point.unsqueeze(-1)
    if zero_point is not None and zero_point.is_floating_point():
        weight = weight.to(scale.dtype) - zero_point.to(scale.dtype)
    elif zero_point is not None:  # value - zero point spans 2**(num_bits + 1) - 1 integers
        wide = torch.int8 if layout.num_bits < 8 else torch.int16
        weight = weight.to(wide) - zero_point.to(wide)
    weight = (weight * scale).view(rows, columns)
    return weight if dtype is None else weight.to(dtype)


def _packed_linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(input, dequantize_packed(self, input.dtype), self.bias)


def _unsupported(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot stay packed on a TPU, or None."""
    scheme = module.quantization_scheme
    weights = scheme.weights
    fmt = getattr(scheme.format, "value", scheme.format)
    if not isinstance(module, torch.nn.Linear):
        return f"a quantized {type(module).__name__}"
    if scheme.input_activations is not None or scheme.output_activations is not None:
        return "activation quantization"
    if fmt != "pack-quantized" or not hasattr(module, "weight_packed"):
        return f"format {fmt!r}"
    kind, strategy = getattr(weights.type, "value", weights.type), getattr(weights.strategy, "value", weights.strategy)
    if kind != "int" or weights.num_bits not in _BITS:
        return f"{weights.num_bits}-bit {kind} weights"
    if strategy not in ("tensor", "channel", "group"):
        return f"strategy {strategy!r}"
    return None


def _layout(module: torch.nn.Module) -> PackedLayout:
    weights = module.quantization_scheme.weights
    shape = module.weight_shape.tolist() if hasattr(module, "weight_shape") else None  # one host read, at load
    if shape is None:
        shape = [module.weight_packed.shape[0], module.weight_scale.shape[-1] * weights.group_size]
    strategy = getattr(weights.strategy, "value", weights.strategy)  # a plain str in 0.20 (pydantic enum values)
    return PackedLayout(weights.num_bits, strategy, weights.group_size, (int(shape[0]), int(shape[1])))


def _check_version() -> None:
    from hf_tpu._patch import version_matches

    ok, installed = version_matches("compressed-tensors", COMPRESSED_TENSORS_VERSIONS)
    if not ok:
        warnings.warn(
            f"hf_tpu keeps compressed-tensors checkpoints packed on TPU as written for compressed-tensors"
            f"{COMPRESSED_TENSORS_VERSIONS} (its pack_to_int32 layout and module state), but {installed} is "
            f"installed. Applied anyway; if outputs differ from the CPU, pin "
            f"compressed-tensors{COMPRESSED_TENSORS_VERSIONS}.",
            stacklevel=4,
        )


def keep_packed_on_tpu(model: torch.nn.Module, compressor: Any) -> int:
    """Give every compressed Linear of ``model`` (loaded by transformers' compressed-tensors quantizer) the forward
    that dequantizes in the graph, and take off compressed-tensors' hook that would decompress the whole model on
    its first forward. Only when every compressed module is on a ``tpu`` device and can stay packed (see the module
    docstring); otherwise warns (naming why) and leaves upstream's path. Returns the number of Linears kept packed.
    """
    from compressed_tensors.quantization import QuantizationStatus

    modules = [
        (name, module) for name, module in model.named_modules()
        if getattr(module, "quantization_status", None) == QuantizationStatus.COMPRESSED
    ]
    on_tpu = [name for name, module in modules if any(p.device.type == "tpu" for p in module.parameters())]
    if not on_tpu:
        return 0
    reasons = sorted({reason for _, module in modules if (reason := _unsupported(module))})
    if len(on_tpu) < len(modules):
        reasons.append(f"{len(modules) - len(on_tpu)} of {len(modules)} compressed modules placed off the TPU")
    if reasons:
        warnings.warn(
            f"compressed-tensors checkpoint on TPU: {'; '.join(reasons)} cannot stay packed on the TPU, so "
            "compressed-tensors decompresses every weight to the model's dtype on the first forward (device memory "
            "of the unquantized model). Kept packed: pack-quantized int 2/4/8-bit weights (w8a16, w4a16) with every "
            "compressed module on the TPU (device_map='tpu').",
            stacklevel=3,
        )
        return 0
    _check_version()
    for _, module in modules:
        module._hf_tpu_packed = _layout(module)
        module.forward = types.MethodType(_packed_linear_forward, module)
    compressor.remove_decompression_hook(model)
    return len(modules)
