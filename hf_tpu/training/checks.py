"""What training on TPU does not support (yet), refused up front with the reason and the fix.

Nothing here falls back to CPU: a request that cannot run on the TPU raises :class:`TPUTrainingError` before the
first step, rather than failing deep inside a CUDA-only kernel or quietly training on the host.
"""

from __future__ import annotations

from typing import Any

from hf_tpu.errors import UserError

__all__ = ["TPUTrainingError", "check_trainable"]

# TrainingArguments.optim values that need bitsandbytes / CUDA kernels, or torchao's CUDA optimizers.
_CUDA_ONLY_OPTIM = ("bnb", "8bit", "paged", "lomo", "torchao", "ademamix_8bit", "apollo")


class TPUTrainingError(UserError, RuntimeError):
    """A training set-up that hf_tpu cannot run on a TPU; the message says what to use instead."""


def _quantization_method(model: Any) -> str | None:
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None) or getattr(
        getattr(model, "config", None), "quantization_config", None
    )
    if config is None and not getattr(model, "is_quantized", False):
        return None
    method = getattr(config, "quant_method", None)
    if isinstance(config, dict):
        method = config.get("quant_method")
    return str(getattr(method, "value", method) or "unknown")


def check_trainable(model: Any, args: Any | None = None) -> None:
    """Raise :class:`TPUTrainingError` if ``model`` (and ``TrainingArguments`` ``args``) cannot train on TPU.

    Refused: quantized models (bitsandbytes, GPTQ, AWQ, ... need CUDA kernels), bitsandbytes/paged/8-bit optimizers,
    and ``fp16=True`` (TPUs compute in bfloat16: use ``bf16=True``). ``hf_tpu.enable()`` runs this check in
    ``Trainer.__init__`` when the Trainer's device is a TPU; call it yourself before a plain training loop.

    Args:
        model: the model to train.
        args: the ``TrainingArguments``; None (the default) checks the model only.

    Raises:
        TPUTrainingError: a quantized model, a CUDA-only optimizer (``optim``), or ``fp16`` / ``fp16_full_eval``;
            the message says what to use instead.

    Example:
        >>> from hf_tpu.training import check_trainable
        >>> check_trainable(model)   # doctest: +SKIP
    """
    method = _quantization_method(model)
    if method is not None:
        raise TPUTrainingError(
            f"this model is quantized ({method}); training a quantized model on TPU is not supported: its kernels "
            "run on CUDA only and hf_tpu will not fall back to CPU. Load the base model unquantized in bfloat16 "
            "(from_pretrained(path, dtype=torch.bfloat16, device_map='tpu')) and fine-tune it, or a LoRA adapter on it "
            "(see docs/training.md)."
        )
    if args is None:
        return
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "")) or "")
    if any(word in optim for word in _CUDA_ONLY_OPTIM):
        raise TPUTrainingError(
            f"TrainingArguments(optim={optim!r}) needs CUDA kernels (bitsandbytes / torchao / paged memory) and "
            "does not run on TPU. Use optim='adamw_torch' (the default) or 'adafactor'."
        )
    if getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False):
        raise TPUTrainingError(
            "TrainingArguments(fp16=True) asks for float16 with a gradient scaler; TPUs compute in bfloat16 and "
            "need no scaler. Use bf16=True instead."
        )
