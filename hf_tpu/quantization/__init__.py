"""Quantized models on TPU: weight-only int8 and int4 through transformers' ``quantization_config``.

Users write transformers' and torchao's own calls; :func:`hf_tpu.enable` makes them run on a ``tpu`` device::

    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, device_map="tpu", dtype=torch.bfloat16,
        quantization_config=TorchAoConfig(Int4WeightOnlyConfig(group_size=128)),
    )

int8 runs on torchao's own ``Int8Tensor``; int4 on :class:`~hf_tpu.quantization.int4.TpuInt4Tensor`, a layout
that unpacks and dequantizes inside the compiled graph with ops torch-tpu implements. Fine-grained fp8 checkpoints
keep their fp8 weights on the device (:mod:`hf_tpu.quantization.fp8`), compressed-tensors w8a16/w4a16 checkpoints
their packed int32 weights (:mod:`hf_tpu.quantization.compressed`). See docs/quantization.md.
:func:`weight_bytes` counts what a model's weights hold in device memory, quantized layouts included.

torchao is imported only when a quantized model is loaded (or :mod:`hf_tpu.quantization.int4` is imported).
"""

from __future__ import annotations

from hf_tpu.quantization.sizes import weight_bytes

__all__ = ["weight_bytes"]
