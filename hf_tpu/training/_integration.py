"""The ``training`` integration: what :func:`hf_tpu.enable` changes so that ``transformers.Trainer`` trains on TPU.

Upstream state (transformers 5.24, accelerate 1.15 and 1.16), checked on the simulated device:

- ``TrainingArguments.device`` is already ``tpu:0`` (transformers asks ``torch.accelerator``), and the Trainer
  moves inputs there. accelerate before 1.16: ``PartialState.default_device`` knows no TPU and answers ``cpu``, so
  ``Accelerator.prepare`` moves the model **back to the CPU**: the first step fails with "Expected all tensors to be
  on the same device" (or, with CPU inputs, trains on the host without a word). hf_tpu wraps
  ``PartialState.default_device``: where the current accelerator is a TPU and upstream's answer is not, it answers
  ``tpu:0``. accelerate 1.16 asks ``torch.accelerator`` itself and answers ``tpu``: its answer is kept as it is
  (decided by upstream's answer on each call, not by accelerate's version).
- accelerate has no distributed type for torch_tpu processes: under a launcher with several ranks it treats each
  rank as a separate single-process run (every rank trains alone, on its own data). hf_tpu makes such ranks one
  data-parallel run: accelerate's ``MULTI_CPU`` type, whose model wrapping is a plain ``DistributedDataParallel``,
  over ``tpu_dist`` (gloo for CPU tensors), each process on its chip ``tpu:0``; the Trainer then shards the batches
  and DDP averages the gradients. (On the simulated device ``ddp_find_unused_parameters`` defaults to False: see
  ``_ddp_defaults``.)
- accelerate's FSDP mode is set only for the GPU-like types, so ``Trainer(fsdp=..., fsdp_config=...)`` and
  ``Accelerator(fsdp_plugin=...)`` on those ranks silently became data parallel. hf_tpu turns the ranks' state into
  ``DistributedType.FSDP`` with the plugin (after :func:`hf_tpu.training.fsdp.check_fsdp_plugin`), so accelerate
  wraps with FSDP2's ``fully_shard`` over a ``tpu`` mesh; and under ``fully_shard`` it moves host tensors to the
  chip by swapping them (:func:`hf_tpu.training.fsdp.move_to_tpu`), since torch refuses ``.data`` across CPU and
  PrivateUse1.
- The optimizer's update and the gradient clipping ran as eager torch_tpu ops (issue #68): AdamW's list ops per
  parameter group, the clipping's norm and scaling, each a dispatch on the chip, while the model's forward and
  backward are compiled. On a TPU the Trainer's ``optim="adamw_torch"`` (its default) builds
  :class:`hf_tpu.training.AdamW` (``torch.optim.AdamW`` whose step is one compiled graph per bucket of parameters
  of one shape and dtype, the learning rate a device tensor) instead of upstream's class
  (``Trainer.get_optimizer_cls_and_kwargs``), and ``Accelerator.clip_grad_norm_`` clips plain ``tpu`` gradients with
  :func:`hf_tpu.training.clip_grad_norm_` (compiled graphs). ``HF_TPU_OPTIMIZER=eager`` keeps upstream's classes
  and eager ops (``adamw_torch_fused``: torch_tpu's ``_fused_adamw_`` kernel and a ``_foreach_add_`` of the step
  counters).
- ``Trainer.__init__`` runs :func:`hf_tpu.training.check_trainable` first when its device is a TPU (quantized
  models, CUDA-only optimizers, fp16). Upstream refuses fp16 too (accelerate: "fp16 mixed precision requires a
  device in (...)"), without saying to use bf16; the others fail later, inside bitsandbytes or a CUDA kernel.
"""

from __future__ import annotations

import functools
import os

from hf_tpu import _patch

FEATURE = "training"
ACCELERATE = {"package": "accelerate", "versions": ">=1.10,<1.17"}
TRANSFORMERS = {"package": "transformers", "versions": ">=5.0,<5.26"}
# torch's private fully_shard module, whose state move hf_tpu wraps (read on torch 2.13).
TORCH_FSDP2 = {"package": "torch", "versions": ">=2.11,<2.14"}

__all__ = ["apply"]


def _tpu_is_current() -> bool:
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == "tpu"


def _launched_ranks() -> int:
    """The number of ranks this process was launched among (``WORLD_SIZE``; 1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


# torch_tpu's ``tpu_dist`` for tpu tensors, gloo for the CPU tensors accelerate gathers (objects, metrics).
DISTRIBUTED_BACKEND = "cpu:gloo,tpu:tpu_dist"


def upstream_knows_the_tpu() -> bool | None:
    """Whether the installed accelerate's own ``PartialState.default_device`` answers ``tpu`` while a TPU is the
    current accelerator (accelerate 1.16 asks ``torch.accelerator``; 1.15 knows no TPU and answers ``cpu``), asked of
    upstream's property itself; None where no TPU is current (there is nothing to ask)."""
    from accelerate.state import PartialState

    if not _tpu_is_current():
        return None
    upstream = _patch.original(PartialState, "default_device")
    return upstream.fget(object.__new__(PartialState)).type == "tpu"  # (it reads no state of the instance)


def _patch_default_device() -> None:
    """``PartialState.default_device``: upstream's answer, unless a TPU is current and upstream does not name it
    (accelerate before 1.16): then ``tpu:0``. Decided on every call, by upstream's answer, not by its version."""
    import torch
    from accelerate.state import PartialState

    upstream = _patch.original(PartialState, "default_device")

    @functools.wraps(upstream.fget)
    def default_device(self) -> torch.device:
        device = upstream.fget(self)
        if device.type == "tpu" or not _tpu_is_current():
            return device  # upstream knows the TPU (accelerate 1.16), or none is current
        return torch.device("tpu", 0)

    _patch.patch(PartialState, "default_device", property(default_device), feature=FEATURE, **ACCELERATE)


def _patch_distributed_state() -> None:
    """Several launched TPU processes become one accelerate data-parallel run: accelerate's ``MULTI_CPU`` type
    (the one whose model wrapping is a plain ``DistributedDataParallel(model)``, without CUDA device ids) over
    :data:`DISTRIBUTED_BACKEND`, each process on its own chip, ``tpu:0``."""
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    upstream_backend = _patch.original(PartialState, "_prepare_backend")
    upstream_set_device = _patch.original(PartialState, "set_device")

    @functools.wraps(upstream_backend)
    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend: str | None = None):
        if cpu or sagemaker_dp or _launched_ranks() < 2 or not _tpu_is_current():
            return upstream_backend(self, cpu, sagemaker_dp, backend)
        return backend or DISTRIBUTED_BACKEND, DistributedType.MULTI_CPU

    @functools.wraps(upstream_set_device)
    def set_device(self):
        # Upstream's MULTI_CPU needs cpu=True; without it, the state is the TPU ranks' run set up above.
        tpu_ranks = self.distributed_type == DistributedType.MULTI_CPU and not self._cpu and _tpu_is_current()
        if self.device is None and tpu_ranks:
            self.device = torch.device("tpu", 0)  # one chip per process: each sees its own as tpu:0
            torch.accelerator.set_device_index(self.device)
            return
        return upstream_set_device(self)

    _patch.patch(PartialState, "_prepare_backend", _prepare_backend, feature=FEATURE, **ACCELERATE)
    _patch.patch(PartialState, "set_device", set_device, feature=FEATURE, **ACCELERATE)


def _patch_fsdp_state() -> None:
    """Launched TPU ranks given accelerate's ``FullyShardedDataParallelPlugin`` (``Trainer(fsdp=..., fsdp_config=...)``,
    ``Accelerator(fsdp_plugin=...)``, ``ACCELERATE_USE_FSDP``) train with FSDP2 instead of silently falling back to
    data parallel: upstream sets its FSDP mode only for the GPU-like types (``MULTI_GPU``, ``MULTI_XPU``, ...), and
    the TPU ranks' run is ``MULTI_CPU`` (above). After upstream's ``AcceleratorState.__init__`` the state becomes
    ``DistributedType.FSDP`` with the plugin, as upstream does for those types, once
    :func:`hf_tpu.training.fsdp.check_fsdp_plugin` has accepted it; accelerate then wraps with ``fully_shard``."""
    import inspect

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    upstream = _patch.original(AcceleratorState, "__init__")
    signature = inspect.signature(upstream)

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        upstream(self, *args, **kwargs)
        plugin = signature.bind_partial(self, *args, **kwargs).arguments.get("fsdp_plugin")
        tpu_ranks = (
            self.distributed_type == DistributedType.MULTI_CPU
            and getattr(self.device, "type", None) == "tpu"
            and getattr(self, "fsdp_plugin", None) is None
        )
        if plugin is None or not tpu_ranks:
            return
        from hf_tpu.training.fsdp import check_fsdp_plugin

        check_fsdp_plugin(plugin)
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type

    _patch.patch(AcceleratorState, "__init__", __init__, feature=FEATURE, **ACCELERATE)


def _patch_fully_shard_move() -> None:
    """``fully_shard`` of a model on the host onto ``tpu`` devices: see :func:`hf_tpu.training.fsdp.move_to_tpu`
    (torch's ``_move_states_to_device`` sets ``.data`` across CPU and PrivateUse1, which torch refuses)."""
    import itertools

    from torch.distributed.fsdp._fully_shard import _fsdp_init

    upstream = _patch.original(_fsdp_init, "_move_states_to_device")

    @functools.wraps(upstream)
    def _move_states_to_device(params, buffers, device):
        if device.type == "tpu":
            from hf_tpu.training.fsdp import move_to_tpu

            move_to_tpu(itertools.chain(params, buffers), device)
        return upstream(params, buffers, device)

    _patch.patch(_fsdp_init, "_move_states_to_device", _move_states_to_device, feature=FEATURE, **TORCH_FSDP2)


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
            if _launched_ranks() > 1:
                _ddp_defaults(training_args)
        upstream(self, *args, **kwargs)

    _patch.patch(Trainer, "__init__", __init__, feature=FEATURE, **TRANSFORMERS)


def _ddp_defaults(training_args) -> None:
    """DistributedDataParallel options for TPU ranks. ``find_unused_parameters`` (the Trainer's default for models
    without gradient checkpointing) makes DDP's C++ reducer allocate pinned host memory directly (not through
    ``pin_memory()``, which the simulator provides): torch offers a Python backend no pinned allocator, so on hf_tpu's
    simulated device without its native core it defaults to False, and an explicit True is refused with the fix
    (with the native core, which provides the allocator, nothing changes, as on a chip). Pinned DataLoaders
    (``dataloader_pin_memory``, True by default) work on the simulator."""
    from hf_tpu import runtime

    if runtime.detect().mode != "simulated":
        return
    from hf_tpu.sim._counters import STATE

    if STATE.native is not None:  # the native core gives torch a pinned allocator: upstream's default, as on a chip
        return
    if training_args.ddp_find_unused_parameters:
        from hf_tpu.training.checks import TPUTrainingError

        raise TPUTrainingError(
            "TrainingArguments(ddp_find_unused_parameters=True) makes DDP's C++ reducer allocate pinned host memory, "
            "which the simulated tpu device cannot provide to it. Set ddp_find_unused_parameters=False (every "
            "parameter must then take part in each forward), or test this run on a TPU."
        )
    training_args.ddp_find_unused_parameters = False


def _patch_optimizer_choice() -> None:
    """``optim="adamw_torch"`` and ``"adamw_torch_fused"`` (the Trainer's default) on a TPU:
    :class:`hf_tpu.training.AdamW` (same arguments, state and ``state_dict`` as upstream's ``torch.optim.AdamW``; its
    step is one compiled graph per bucket of parameters, the fused update), unless ``HF_TPU_OPTIMIZER=eager``."""
    import torch
    from transformers import Trainer

    upstream = _patch.original(Trainer, "get_optimizer_cls_and_kwargs")
    upstream_fn = upstream.__func__ if isinstance(upstream, staticmethod) else upstream

    @functools.wraps(upstream_fn)
    def get_optimizer_cls_and_kwargs(args, model=None):
        cls, kwargs = upstream_fn(args, model)
        if cls is not torch.optim.AdamW or getattr(args.device, "type", None) != "tpu":
            return cls, kwargs
        from hf_tpu.training import optim

        if not optim.compiled_on():
            return cls, kwargs
        # adamw_torch_fused (the Trainer's default) too: the compiled graph is the fused update
        return optim.AdamW, {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}

    _patch.check_parameters(Trainer, "get_optimizer_cls_and_kwargs", get_optimizer_cls_and_kwargs, feature=FEATURE,
                            **TRANSFORMERS)  # fmt: skip
    _patch.patch(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(get_optimizer_cls_and_kwargs), feature=FEATURE,
                 **TRANSFORMERS)  # fmt: skip


def _patch_clip_grad_norm() -> None:
    """``Accelerator.clip_grad_norm_`` of plain ``tpu`` gradients (one chip, or data-parallel ranks, no gradient
    scaler): :func:`hf_tpu.training.clip_grad_norm_`, compiled graphs; upstream's otherwise (FSDP, DTensors, a
    scaler, ``HF_TPU_OPTIMIZER=eager``)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    upstream = _patch.original(Accelerator, "clip_grad_norm_")

    @functools.wraps(upstream)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        from hf_tpu.training import optim

        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        plain = self.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU) and self.scaler is None
        if not (plain and optim.compiled_on() and optim._plain_tpu(grads)):
            return upstream(self, parameters, max_norm, norm_type)
        return optim.clip_grad_norm_(parameters, max_norm, norm_type)

    _patch.check_parameters(Accelerator, "clip_grad_norm_", clip_grad_norm_, feature=FEATURE, **ACCELERATE)
    _patch.patch(Accelerator, "clip_grad_norm_", clip_grad_norm_, feature=FEATURE, **ACCELERATE)


def apply() -> None:
    """Apply the training integration (called by :func:`hf_tpu.enable`)."""
    _patch_default_device()
    _patch_distributed_state()
    _patch_fsdp_state()
    _patch_fully_shard_move()
    _patch_trainer_init()
    _patch_optimizer_choice()
    _patch_clip_grad_norm()
