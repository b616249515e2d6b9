"""The ``quantization`` integration: what :func:`hf_tpu.enable` changes so that torchao's int4 loads on TPU.

Weight-only int8 (``TorchAoConfig(Int8WeightOnlyConfig())``) needs nothing: torchao's ``Int8Tensor`` dequantizes
through ``mm`` and elementwise ops that torch-tpu implements (tested in ``tests/quantization``).

Weight-only int4 (``TorchAoConfig(Int4WeightOnlyConfig(group_size=...))``) does not: every torchao int4 layout
packs and multiplies with CUDA/CPU kernels (``mslk``, ``aten._convert_weight_to_int4pack``,
``aten._weight_int4pack_mm``) that torch-tpu 0.2.0 sends to its missing-op fallback. The change, through torchao's
own extension point (its table of quantize handlers, ``register_quantize_module_handler``):

- torchao (``package="torchao"``, written for 0.18): the handler of ``Int4WeightOnlyConfig`` is wrapped; a Linear
  whose weight sits on a ``tpu`` device gets :class:`hf_tpu.quantization.int4.TpuInt4Tensor` (same group size,
  weights packed two per byte, dequantized inside the compiled graph); any other device gets torchao's handler
  unchanged. The torchao config's ``int4_packing_format`` names a CUDA/CPU kernel layout and is not used on TPU.
- transformers (``package="transformers"``, written for 5.24): ``TorchAoHfQuantizer.validate_environment`` is
  wrapped to install the handler above when a torchao model starts loading, so that ``hf_tpu.enable()`` never
  imports torchao itself (a heavy import) and works whether torchao was imported before or after it.
- transformers: ``integrations.torchao.TorchAoQuantize._quantize`` (which runs torchao's ``quantize_`` on each
  Linear as its weight arrives) quantizes a ``tpu``-placed Linear on the host and moves the quantized tensors
  back: torchao's quantizers compute in float32 (four float32 temporaries of the weight on the chip otherwise,
  enough to run a chip that holds the int8 model out of memory while loading) and may use ops a chip lacks; the
  device then holds the arriving bf16 weight and its quantized tensors only.
- transformers: fine-grained fp8 checkpoints (``quant_method: fp8``, 128x128 blocks) bound for a ``tpu`` device stay
  fp8: ``FineGrainedFP8HfQuantizer.validate_environment`` (which, with no CUDA device, turns on ``dequantize`` and
  loads bf16) keeps them quantized when the device map is all ``tpu``, and ``FP8Linear.forward`` runs
  :func:`hf_tpu.quantization.fp8.fp8_block_linear` on a ``tpu`` weight (upstream's kernels elsewhere).
- transformers: compressed-tensors checkpoints (``quant_method: compressed-tensors``, ``pack-quantized`` w8a16 and
  w4a16) loaded on a ``tpu`` device stay packed: ``CompressedTensorsHfQuantizer._process_model_after_weight_loading``
  (inherited from ``HfQuantizer``, a no-op) runs :func:`hf_tpu.quantization.compressed.keep_packed_on_tpu`, which
  gives each compressed Linear a forward that dequantizes in the graph and takes off compressed-tensors' hook that
  decompresses the whole model on its first forward. Models off the TPU are left to upstream.

:func:`hf_tpu.disable` restores all of them.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from hf_tpu._patch import on_revert, patch, version_matches

__all__ = ["FEATURE", "TORCHAO_VERSIONS", "apply", "install_torchao_handlers"]

FEATURE = "quantization"
TORCHAO_VERSIONS = ">=0.18,<0.19"
_INSTALLED: dict[str, Any] = {}
# The device a Linear being quantized on the host goes back to (set by the wrapped TorchAoQuantize._quantize).
_DESTINATION: contextvars.ContextVar[Any] = contextvars.ContextVar("hf_tpu_quantize_destination", default=None)


def _tpu_int4_handler(original: Any) -> Any:
    @functools.wraps(original)
    def handler(module: Any, config: Any, *, parameter_name: str = "weight", **kwargs: Any) -> Any:
        weight = getattr(module, parameter_name)
        destination = _DESTINATION.get()
        if weight.device.type != "tpu" and (destination is None or destination.type != "tpu"):
            return original(module, config, parameter_name=parameter_name, **kwargs)
        from hf_tpu.quantization import _torchao

        return _torchao.quantize_module_int4(module, config, parameter_name)

    handler.__hf_tpu_upstream__ = original
    return handler


def install_torchao_handlers() -> None:
    """Put the TPU int4 handler into torchao's handler table (idempotent; undone by :func:`hf_tpu.disable`)."""
    if "int4" in _INSTALLED:
        return
    import warnings

    from torchao.quantization import Int4WeightOnlyConfig
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER

    ok, installed = version_matches("torchao", TORCHAO_VERSIONS)
    if not ok:
        warnings.warn(
            f"hf_tpu's '{FEATURE}' integration was written for torchao{TORCHAO_VERSIONS}, but torchao {installed} "
            f"is installed. It is applied anyway; if int4 on TPU breaks, pin torchao{TORCHAO_VERSIONS}.",
            stacklevel=2,
        )
    original = _QUANTIZE_CONFIG_HANDLER[Int4WeightOnlyConfig]
    _QUANTIZE_CONFIG_HANDLER[Int4WeightOnlyConfig] = _tpu_int4_handler(original)
    _INSTALLED["int4"] = original

    def undo() -> None:
        _QUANTIZE_CONFIG_HANDLER[Int4WeightOnlyConfig] = _INSTALLED.pop("int4")

    on_revert(FEATURE, undo)


def _quantize_on_host(upstream: Any) -> Any:
    @functools.wraps(upstream)
    def _quantize(self, module, config, *args, **kwargs):
        device = next(module.parameters()).device
        if device.type != "tpu":
            return upstream(self, module, config, *args, **kwargs)
        token = _DESTINATION.set(device)
        try:
            module.to("cpu")
            upstream(self, module, config, *args, **kwargs)
        finally:
            _DESTINATION.reset(token)
            module.to(device)

    _quantize.__hf_tpu_upstream__ = upstream
    return _quantize


def _all_tpu(device_map: Any) -> bool:
    import torch

    if isinstance(device_map, dict):
        return bool(device_map) and all(_all_tpu(v) for v in device_map.values())
    if isinstance(device_map, torch.device):
        return device_map.type == "tpu"
    return isinstance(device_map, str) and device_map.split(":")[0] == "tpu"


def _patch_fp8() -> None:
    from transformers.integrations import finegrained_fp8
    from transformers.quantizers import quantizer_finegrained_fp8

    quantizer = quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer
    validate = quantizer.__dict__["validate_environment"]
    validate = getattr(validate, "__hf_tpu_upstream__", validate)

    @functools.wraps(validate)
    def validate_environment(self, *args, **kwargs):
        import torch

        keep = (
            self.pre_quantized and not self.quantization_config.dequantize and not torch.cuda.is_available()
            and _all_tpu(kwargs.get("device_map"))
        )
        if not keep:
            return validate(self, *args, **kwargs)
        return None  # fp8 weights stay fp8 on the TPU (FP8Linear.forward below), instead of bf16

    validate_environment.__hf_tpu_upstream__ = validate
    patch(quantizer, "validate_environment", validate_environment, feature=FEATURE, package="transformers",
          versions=">=5.0,<6")

    linear = finegrained_fp8.FP8Linear
    forward = linear.__dict__["forward"]
    forward = getattr(forward, "__hf_tpu_upstream__", forward)

    @functools.wraps(forward)
    def fp8_forward(self, input):
        if self.weight.device.type == "tpu" and self.weight.element_size() == 1:
            from hf_tpu.quantization.fp8 import fp8_block_linear

            return fp8_block_linear(self, input)
        return forward(self, input)

    fp8_forward.__hf_tpu_upstream__ = forward
    patch(linear, "forward", fp8_forward, feature=FEATURE, package="transformers", versions=">=5.0,<6")


def _patch_compressed_tensors() -> None:
    from transformers.quantizers import quantizer_compressed_tensors

    quantizer = quantizer_compressed_tensors.CompressedTensorsHfQuantizer
    upstream = quantizer._process_model_after_weight_loading
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)

    @functools.wraps(upstream)
    def _process_model_after_weight_loading(self, model, **kwargs):
        result = upstream(self, model, **kwargs)
        if not self.quantization_config.dequantize and self.quantization_config.is_quantization_compressed:
            from hf_tpu.quantization.compressed import keep_packed_on_tpu

            keep_packed_on_tpu(model, self.compressor)
        return result

    _process_model_after_weight_loading.__hf_tpu_upstream__ = upstream
    patch(quantizer, "_process_model_after_weight_loading", _process_model_after_weight_loading, feature=FEATURE,
          package="transformers", versions=">=5.0,<6")


def apply() -> None:
    """Apply the quantization integration (called by :func:`hf_tpu.enable`)."""
    _patch_fp8()
    _patch_compressed_tensors()
    from transformers.integrations import torchao as torchao_integration
    from transformers.quantizers import quantizer_torchao

    quantize = torchao_integration.TorchAoQuantize.__dict__["_quantize"]
    patch(
        torchao_integration.TorchAoQuantize, "_quantize",
        _quantize_on_host(getattr(quantize, "__hf_tpu_upstream__", quantize)),
        feature=FEATURE, package="transformers", versions=">=5.0,<6",
    )

    quantizer = quantizer_torchao.TorchAoHfQuantizer
    upstream = quantizer.__dict__["validate_environment"]
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)

    @functools.wraps(upstream)
    def validate_environment(self, *args, **kwargs):
        result = upstream(self, *args, **kwargs)  # raises first when torchao is missing
        install_torchao_handlers()
        return result

    validate_environment.__hf_tpu_upstream__ = upstream
    patch(
        quantizer, "validate_environment", validate_environment, feature=FEATURE, package="transformers",
        versions=">=5.0,<6",
    )
