"""Training on TPU: ``transformers.Trainer`` and plain PyTorch loops, fixed-shape batches, checkpoints, checks.

``hf_tpu.enable()`` (the ``training`` integration) makes the Trainer keep a TPU-placed model on the TPU and refuses
what cannot train there; the helpers here need no integration. Importing this package imports neither torch nor
transformers.

An unknown attribute raises the built-in ``AttributeError`` from the module's ``__getattr__`` (the protocol
``hasattr`` and ``getattr`` with a default rely on), not an hf_tpu error.

Example:
    >>> import hf_tpu; hf_tpu.enable()
    >>> from hf_tpu.training import BucketingCollator
    >>> collate = BucketingCollator(buckets=(64, 128), pad_token_id=tok.pad_token_id)   # doctest: +SKIP
    >>> Trainer(model=model.to("tpu"), args=args, train_dataset=ds, data_collator=collate).train()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AdamW",
    "BucketingCollator",
    "MemoryReport",
    "StepCounters",
    "TPUTrainingError",
    "check_trainable",
    "clip_grad_norm_",
    "load_checkpoint",
    "save_checkpoint",
]

_EXPORTS = {
    "AdamW": "hf_tpu.training.optim",
    "BucketingCollator": "hf_tpu.training.collator",
    "MemoryReport": "hf_tpu.training.callbacks",
    "StepCounters": "hf_tpu.training.callbacks",
    "TPUTrainingError": "hf_tpu.training.checks",
    "check_trainable": "hf_tpu.training.checks",
    "clip_grad_norm_": "hf_tpu.training.optim",
    "load_checkpoint": "hf_tpu.training.checkpoint",
    "save_checkpoint": "hf_tpu.training.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_tpu.training' has no attribute {name!r}")
