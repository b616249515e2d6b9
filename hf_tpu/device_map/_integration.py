"""The ``device_map`` integration: what :func:`hf_tpu.enable` changes in accelerate and transformers, and why.

Upstream (accelerate 1.15, transformers 5.24) has no TPU in its device enumeration, so ``device_map="auto"``
plans for CPU only and a TPU VM silently runs the model on the host (accelerate 1.16 asks ``torch.accelerator`` and
finds the chip; the patches below still map its integer ids to ``"tpu:N"``, read weights on the host and check the
fit before loading). Each patch below wraps one upstream
function; the wrapper calls the original and only adds the TPU handling, and when the integration is off (or no
TPU is present, where noted) it is exactly the upstream call.

accelerate (``package="accelerate"``, written for 1.15, checked on 1.16):
- ``utils.modeling.get_max_memory`` (and its aliases): enumerates the TPU devices with their free HBM, accepts
  ``"tpu"``/``"tpu:N"`` keys (:mod:`hf_tpu.device_map.memory`).
- ``infer_auto_device_map``: its integer ids become ``"tpu:N"``.
- ``dispatch_model``, ``load_checkpoint_in_model``: integer ids in a passed map become ``"tpu:N"`` (torch_tpu
  ignores the index of ``.to(int)``); tied weights are tied again after a single-device ``model.to``.
- ``utils.modeling.load_state_dict``: weights bound for the TPU are read on the host (safetensors cannot open a
  file on ``tpu:0``) and moved by ``load_checkpoint_in_model`` as usual.
- ``utils.offload.OffloadedWeightsLoader.__getitem__``: disk-offloaded weights are read on the host and copied to
  the TPU (safetensors refuses to open a file on ``tpu:0``).

transformers (``package="transformers"``, written for 5.24, checked on 5.25: the same signatures):
- ``integrations.accelerate.check_and_set_device_map``: ``device_map="tpu"``/``"tpu:N"``/``0`` become
  ``{"": "tpu:N"}``; asking for a TPU with none present raises :class:`hf_tpu.runtime.TPUNotAvailableError`.
- ``integrations.accelerate._get_device_map``: the inferred map is normalised and weighed against HBM (and disk
  permission) before any weight is read (:mod:`hf_tpu.device_map.preflight`).
- ``PreTrainedModel.from_pretrained``: records ``offload_folder`` for that check (a context variable); a
  safetensors error from a truncated or corrupt file becomes :class:`hf_tpu.errors.CheckpointFileError` naming the
  file and the fix (:mod:`hf_tpu.device_map.files`; safetensors' own message has no path).
- ``PreTrainedModel.to``: tied weights stay tied when moving to the TPU (:mod:`hf_tpu.device_map.ties`).
- ``pipelines.base.Pipeline.__init__``: ``device="tpu"``/``0`` mean the TPU rather than CUDA-or-CPU.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from hf_tpu import _patch

FEATURE = "device_map"
ACCELERATE = {"package": "accelerate", "versions": ">=1.10,<1.17"}
TRANSFORMERS = {"package": "transformers", "versions": ">=5.0,<5.26"}

logger = logging.getLogger("hf_tpu.device_map")

# Options of the from_pretrained call in progress that the device-map check needs (offload_folder).
_LOAD: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("hf_tpu_load_options", default=None)

# Packages whose modules may hold their own reference to a patched function (``from accelerate import ...``).
_ALIAS_PACKAGES = ("accelerate", "transformers", "diffusers", "peft")


def active() -> bool:
    """Whether the integration is on (a stale alias of a wrapper behaves as upstream once it is off)."""
    return _patch.is_enabled(FEATURE)


def _aliases(upstream: Any, names: tuple[str, ...]) -> list[tuple[Any, str]]:
    """Every loaded module of the HF packages that binds ``upstream`` under one of ``names``."""
    found = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".")[0] not in _ALIAS_PACKAGES:
            continue
        namespace = getattr(module, "__dict__", {})
        for name in names:
            if namespace.get(name) is upstream:
                found.append((module, name))
    return found


def _patch_function(
    home: str, name: str, make: Callable[[Callable], Callable], versions: dict, *, aliases: tuple[str, ...] = ()
) -> None:
    """Wrap ``home.name`` and every alias of it in the loaded HF modules."""
    module = importlib.import_module(home)
    upstream = _patch.original(module, name)
    replacement = make(upstream)
    functools.update_wrapper(replacement, upstream)
    replacement.__wrapped_by_hf_tpu__ = True
    for owner, attr in [(module, name), *_aliases(upstream, (name, *aliases))]:
        _patch.patch(owner, attr, replacement, feature=FEATURE, **versions)

    def restore_late_aliases() -> None:
        # A module imported while the integration was on (``from accelerate import dispatch_model`` in diffusers,
        # say) bound the wrapper; give it upstream's object back too.
        for owner, attr in _aliases(replacement, (name, *aliases)):
            _patch.assign(owner, attr, upstream, feature=FEATURE, reason="an alias bound after the patch, put back")

    _patch.on_revert(FEATURE, restore_late_aliases)


def _bind(fn: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    return bound


# --------------------------------------------------------------------------------------------------- accelerate
def _make_get_max_memory(upstream: Callable) -> Callable:
    from hf_tpu.device_map.memory import get_max_memory

    def replacement(max_memory=None):
        if not active():
            return upstream(max_memory)
        return get_max_memory(max_memory, upstream=upstream)

    return replacement


def _make_infer_auto_device_map(upstream: Callable) -> Callable:
    from hf_tpu.device_map.maps import normalize_device_map

    def replacement(*args, **kwargs):
        result = upstream(*args, **kwargs)
        return normalize_device_map(result) if active() else result

    return replacement


def _make_dispatch_model(upstream: Callable) -> Callable:
    from hf_tpu.device_map.maps import normalize_device, normalize_device_map
    from hf_tpu.device_map.ties import retie, tied_groups

    def replacement(*args, **kwargs):
        if not active():
            return upstream(*args, **kwargs)
        bound = _bind(upstream, args, kwargs)
        bound.arguments["device_map"] = normalize_device_map(bound.arguments["device_map"])
        if bound.arguments.get("main_device") is not None:
            bound.arguments["main_device"] = normalize_device(bound.arguments["main_device"])
        model = bound.arguments["model"]
        groups = tied_groups(model)
        result = upstream(*bound.args, **bound.kwargs)
        if groups:
            retie(model, groups)
        return result

    return replacement


def _make_load_checkpoint_in_model(upstream: Callable) -> Callable:
    from hf_tpu.device_map.maps import normalize_device_map

    def replacement(*args, **kwargs):
        if not active():
            return upstream(*args, **kwargs)
        bound = _bind(upstream, args, kwargs)
        bound.arguments["device_map"] = normalize_device_map(bound.arguments.get("device_map"))
        return upstream(*bound.args, **bound.kwargs)

    return replacement


def _make_load_state_dict(upstream: Callable) -> Callable:
    from hf_tpu.device_map.devices import is_tpu_device

    def replacement(checkpoint_file, device_map=None, *args, **kwargs):
        if active() and isinstance(device_map, dict) and any(is_tpu_device(d) for d in device_map.values()):
            # safetensors cannot open a file on tpu:N; read on the host, set_module_tensor_to_device moves each
            # weight to its device right after.
            device_map = {name: "cpu" if is_tpu_device(d) else d for name, d in device_map.items()}
        return upstream(checkpoint_file, device_map, *args, **kwargs)

    return replacement


# ------------------------------------------------------------------------------------------------- transformers
def _make_check_and_set_device_map(upstream: Callable) -> Callable:
    from hf_tpu.device_map.devices import is_tpu_device
    from hf_tpu.device_map.maps import int_means_tpu, names_tpu, normalize_device, normalize_device_map

    def replacement(device_map):
        if not active():
            return upstream(device_map)
        if names_tpu(device_map):
            from hf_tpu import runtime

            runtime.require_tpu(f"device_map={device_map!r}")
        as_int = isinstance(device_map, int) and not isinstance(device_map, bool) and device_map >= 0
        if (as_int and int_means_tpu()) or is_tpu_device(device_map):
            device_map = {"": normalize_device(device_map)}
        return normalize_device_map(upstream(device_map))

    return replacement


def _make_get_device_map(upstream: Callable) -> Callable:
    from hf_tpu.device_map.devices import is_tpu_device, tpu_available, tpu_memory
    from hf_tpu.device_map.maps import names_tpu, normalize_device_map
    from hf_tpu.device_map.preflight import check_placement, format_bytes

    def replacement(model, device_map, max_memory, hf_quantizer, *args, **kwargs):
        if not active():
            return upstream(model, device_map, max_memory, hf_quantizer, *args, **kwargs)
        inferred = isinstance(device_map, str)
        if max_memory and names_tpu(max_memory):
            from hf_tpu import runtime

            runtime.require_tpu("max_memory with a 'tpu' entry")
        if not tpu_available():
            if inferred:
                logger.warning(
                    "device_map=%r: this process has no TPU, so the model is placed on CPU (and disk). Set "
                    "HF_TPU_SIMULATE=1 or install torch-tpu on a TPU VM to place it on a TPU.",
                    device_map,
                )
            return upstream(model, device_map, max_memory, hf_quantizer, *args, **kwargs)
        limits = None
        if inferred:
            import transformers.integrations.accelerate as tf_acc

            limits = tf_acc.get_max_memory(dict(max_memory) if max_memory else None)
        user_max_memory = dict(max_memory) if max_memory else None
        result = normalize_device_map(upstream(model, device_map, max_memory, hf_quantizer, *args, **kwargs))
        options = _LOAD.get() or {}
        if options.get("distributed"):
            return result  # sharded loading: each process holds a slice; the tensor-parallel code checks its own
        asked = options["device_map"] if options.get("device_map") is not None else device_map
        disk_allowed = options.get("offload_folder") is not None or bool(user_max_memory and "disk" in user_max_memory)
        placed = check_placement(
            model,
            result,
            asked=asked,
            inferred=inferred,
            disk_allowed=disk_allowed,
            limits=limits,
            hf_quantizer=hf_quantizer,
        )
        if inferred and placed and not any(is_tpu_device(d) for d in placed):
            warnings.warn(
                f"device_map={asked!r} placed nothing on the TPU: tpu:0 has {format_bytes(tpu_memory(0).free)} "
                f"free (planning limit {format_bytes((limits or {}).get(0, 0))}), too little for the first block, "
                f"so the whole model ({format_bytes(sum(placed.values()))}) runs from "
                f"{' and '.join(map(str, placed))}. Free TPU memory or raise max_memory for the TPU.",
                UserWarning,
                stacklevel=2,
            )
        return result

    return replacement


def _patch_offloaded_weights_loader() -> None:
    """Disk-offloaded weights read from the checkpoint's safetensors files: safetensors cannot open a file "on"
    ``tpu:0`` (``SafetensorError: device tpu:0 is invalid``), so read on the host and copy to the TPU."""
    from accelerate.utils.offload import OffloadedWeightsLoader

    from hf_tpu.device_map.devices import is_tpu_device

    upstream = _patch.original(OffloadedWeightsLoader, "__getitem__")

    @functools.wraps(upstream)
    def __getitem__(self, key):
        device = self.device
        if not (active() and is_tpu_device(device)):
            return upstream(self, key)
        self.device = None
        try:
            tensor = upstream(self, key)
        finally:
            self.device = device
        return tensor.to(device)

    _patch.patch(OffloadedWeightsLoader, "__getitem__", __getitem__, feature=FEATURE, **ACCELERATE)


def _patch_from_pretrained() -> None:
    from transformers import PreTrainedModel

    upstream = _patch.original(PreTrainedModel, "from_pretrained")
    func = upstream.__func__ if isinstance(upstream, classmethod) else upstream

    @functools.wraps(func)
    def from_pretrained(cls, *args, **kwargs):
        mesh = None
        if kwargs.get("device_mesh") is not None and _patch.is_enabled("tensor_parallel"):
            # transformers 5.24 drops device_mesh; the tensor-parallel integration shards over it (tp_plan.py).
            from hf_tpu.distributed.tp_plan import load_kwargs_for_mesh, sharding_over

            kwargs, mesh = load_kwargs_for_mesh(kwargs)
        token = _LOAD.set(
            {
                "offload_folder": kwargs.get("offload_folder"),
                "device_map": kwargs.get("device_map"),
                "distributed": kwargs.get("distributed_config") is not None or kwargs.get("tp_plan") is not None,
            }
        )
        try:
            if mesh is None:
                return func(cls, *args, **kwargs)
            with sharding_over(mesh):
                return func(cls, *args, **kwargs)
        except Exception as err:
            from hf_tpu.device_map.files import checkpoint_error

            path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            better = checkpoint_error(path, err) if isinstance(path, (str, os.PathLike)) else None
            if better is None:
                raise
            raise better from err
        finally:
            _LOAD.reset(token)

    _patch.patch(PreTrainedModel, "from_pretrained", classmethod(from_pretrained), feature=FEATURE, **TRANSFORMERS)


def _patch_module_to() -> None:
    import torch
    from transformers import PreTrainedModel

    from hf_tpu.device_map.ties import retie, tied_groups

    upstream = _patch.original(PreTrainedModel, "to")

    @functools.wraps(upstream)
    def to(self, *args, **kwargs):
        if not active():
            return upstream(self, *args, **kwargs)
        try:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
        except (TypeError, RuntimeError, ValueError):  # upstream raises its own error for bad arguments
            device = None
        if device is None or device.type != "tpu":
            return upstream(self, *args, **kwargs)
        groups = tied_groups(self)
        result = upstream(self, *args, **kwargs)
        if groups:
            retie(self, groups)
        return result

    _patch.patch(PreTrainedModel, "to", to, feature=FEATURE, **TRANSFORMERS)


def _patch_pipeline_init() -> None:
    import torch
    from transformers.pipelines.base import Pipeline

    from hf_tpu.device_map.devices import is_tpu_device
    from hf_tpu.device_map.maps import int_means_tpu, normalize_device

    upstream = _patch.original(Pipeline, "__init__")

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        if active():
            bound = _bind(upstream, (self, *args), kwargs)
            device = bound.arguments.get("device")
            if is_tpu_device(device):
                from hf_tpu import runtime

                runtime.require_tpu(f"pipeline(device={device!r})")
                bound.arguments["device"] = torch.device(normalize_device(device))
            elif isinstance(device, int) and not isinstance(device, bool) and device >= 0 and int_means_tpu():
                bound.arguments["device"] = torch.device(normalize_device(device))
            elif device is None:
                # A model placed on one TPU by device_map has no hf_device_map; Pipeline.__init__ then takes device 0
                # as CUDA-or-CPU and moved it to the CPU (transformers 5.23's pipeline() passes no device; 5.24's
                # passes the model's). Keep it where it is, as 5.24 does.
                model = bound.arguments.get("model")
                on = getattr(model, "device", None)
                if getattr(model, "hf_device_map", None) is None and isinstance(on, torch.device) and is_tpu_device(on):
                    bound.arguments["device"] = on
            return upstream(*bound.args, **bound.kwargs)
        return upstream(self, *args, **kwargs)

    _patch.patch(Pipeline, "__init__", __init__, feature=FEATURE, **TRANSFORMERS)


def apply() -> None:
    """Apply the device_map integration (called by :func:`hf_tpu.enable`)."""
    # Import the modules that alias the patched functions first, so that they hold upstream's objects (which we
    # patch and later restore) and not ours.
    for name in (
        "accelerate",
        "accelerate.utils",
        "accelerate.utils.modeling",
        "accelerate.big_modeling",
        "accelerate.utils.bnb",
        "transformers.integrations.accelerate",
        "transformers.modeling_utils",
        "transformers.pipelines.base",
    ):
        importlib.import_module(name)
    _patch_function(
        "accelerate.utils.modeling",
        "get_max_memory",
        _make_get_max_memory,
        ACCELERATE,
        aliases=("accelerate_max_memory",),
    )
    _patch_function("accelerate.utils.modeling", "infer_auto_device_map", _make_infer_auto_device_map, ACCELERATE)
    _patch_function(
        "accelerate.utils.modeling", "load_checkpoint_in_model", _make_load_checkpoint_in_model, ACCELERATE
    )
    _patch_function("accelerate.utils.modeling", "load_state_dict", _make_load_state_dict, ACCELERATE)
    _patch_function("accelerate.big_modeling", "dispatch_model", _make_dispatch_model, ACCELERATE)
    _patch_function(
        "transformers.integrations.accelerate",
        "check_and_set_device_map",
        _make_check_and_set_device_map,
        TRANSFORMERS,
    )
    _patch_function("transformers.integrations.accelerate", "_get_device_map", _make_get_device_map, TRANSFORMERS)
    _patch_offloaded_weights_loader()
    _patch_from_pretrained()
    _patch_module_to()
    _patch_pipeline_init()
