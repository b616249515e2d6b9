"""Make a compressed-tensors checkpoint (``pack-quantized``, weight-only int) from a bf16 one, with the
compressed-tensors library's own calls: for tests, benchmarks and the self-test, where nothing is downloaded.

The scales are min/max ones (``calculate_qparams``, what llm-compressor's min-max observer computes); real
checkpoints come out of calibration (GPTQ, AWQ), which changes the numbers, not the format.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["PRESETS", "quantize_in_memory", "save_compressed", "scheme"]

# name -> (num_bits, strategy, group_size, symmetric): w8a16 per output channel (RedHatAI's w8a16 models), w4a16 the
# compressed-tensors preset (groups of 128, symmetric)
PRESETS = {
    "w8a16": (8, "channel", None, True),
    "w8a16-asym": (8, "channel", None, False),
    "w4a16": (4, "group", 128, True),
    "w4a16-asym": (4, "group", 128, False),
    "w2a16-tensor": (2, "tensor", None, True),
}


def scheme(name: str, activations: bool = False) -> Any:
    """The ``QuantizationScheme`` of preset ``name`` on every Linear (``activations``: plus dynamic int8 per-token
    activation quantization, the w8a8 kind hf_tpu does not keep packed)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    bits, strategy, group_size, symmetric = PRESETS[name]
    weights = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group_size,
                               symmetric=symmetric)
    inputs = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True) if activations else None
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def quantize_in_memory(model: torch.nn.Module, quantization_scheme: Any) -> None:
    """Apply ``quantization_scheme`` to ``model``'s Linears (``lm_head`` left out) with min/max scales, ready for
    compressed-tensors' compressors."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized

    config = QuantizationConfig(config_groups={"group_0": quantization_scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if not is_module_quantized(module):
            continue
        args, weight = module.quantization_scheme.weights, module.weight.detach()
        if args.strategy == "tensor":
            low, high = weight.amin(), weight.amax()
        elif args.strategy == "channel":
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        else:
            groups = weight.unflatten(-1, (-1, args.group_size))
            low, high = groups.amin(-1), groups.amax(-1)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        module.quantization_status = QuantizationStatus.FROZEN


def save_compressed(source: str | os.PathLike, path: str | os.PathLike, name: str, activations: bool = False) -> None:
    """Load the causal LM at ``source`` (bf16), quantize it with preset ``name`` and save it compressed at ``path``
    (``save_pretrained`` plus compressed-tensors' ``update_config``: what llm-compressor writes).

    Example:
        >>> save_compressed("tiny-llama", "tiny-llama-w4a16", "w4a16")   # doctest: +SKIP
    """
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    quantize_in_memory(model, scheme(name, activations))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
