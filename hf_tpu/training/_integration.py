"""The ``training`` integration: what :func:`hf_tpu.enable` changes so that ``transformers.Trainer`` trains on TPU.

Upstream state (transformers 5.24, accelerate 1.15), checked on the simulated device:

- ``TrainingArguments.device`` is already ``tpu:0`` (transformers asks ``torch.accelerator``), and the Trainer
  moves inputs there; but accelerate's ``PartialState.default_device`` knows no TPU and answers ``cpu``, so
  ``Accelerator.prepare`` moves the model **back to the CPU**: the first step fails with "Expected all tensors to be
  on the same device" (or, with CPU inputs, trains on the host without a word). hf_tpu patches
  ``PartialState.default_device`` to answer ``tpu:0`` when the current accelerator is a TPU and the state is not
  forced to the CPU.
- accelerate has no distributed type for torch_tpu processes: under a launcher with several ranks it would treat
  each rank as a separate single-process run (every rank trains alone). ``default_device`` refuses that case with
  :class:`~hf_tpu.training.TPUTrainingError` pointing at the data-parallel recipe in docs/training.md.
- ``Trainer.__init__`` runs :func:`hf_tpu.training.check_trainable` first when its device is a TPU (quantized
  models, CUDA-only optimizers, fp16). Upstream refuses fp16 too (accelerate: "fp16 mixed precision requires a
  device in (...)"), without saying to use bf16; the others fail later, inside bitsandbytes or a CUDA kernel.
"""

from __future__ import annotations

import functools
import os

from hf_tpu import _patch

FEATURE = "training"
ACCELERATE = {"package": "accelerate", "versions": ">=1.10,<1.16"}
TRANSFORMERS = {"package": "transformers", "versions": ">=5.0,<5.25"}

__all__ = ["apply"]


def _tpu_is_current() -> bool:
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == "tpu"


def _patch_default_device() -> None:
    import torch
    from accelerate.state import PartialState

    upstream = _patch.original(PartialState, "default_device")

    def default_device(self) -> torch.device:
        if not _tpu_is_current():
            return upstream.fget(self)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            from hf_tpu.training.checks import TPUTrainingError

            raise TPUTrainingError(
                f"accelerate {_version('accelerate')} has no distributed mode for torch_tpu processes: this is one of "
                f"{world} ranks, and the Trainer would train each rank alone. Use the data-parallel loop of "
                "docs/training.md (hf_tpu.training.data_parallel, or DistributedDataParallel over the tpu_dist "
                "process group), or run one process."
            )
        return torch.device("tpu", 0)

    _patch.patch(PartialState, "default_device", property(default_device), feature=FEATURE, **ACCELERATE)


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def _patch_trainer_init() -> None:
    from transformers import Trainer

    upstream = _patch.original(Trainer, "__init__")

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        # Before upstream: accelerate's own fp16 refusal does not say what to use on TPU.
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and getattr(training_args.device, "type", None) == "tpu":
            from hf_tpu.training.checks import check_trainable

            check_trainable(model, training_args)
        upstream(self, *args, **kwargs)

    _patch.patch(Trainer, "__init__", __init__, feature=FEATURE, **TRANSFORMERS)


def apply() -> None:
    """Apply the training integration (called by :func:`hf_tpu.enable`)."""
    _patch_default_device()
    _patch_trainer_init()
