"""``torch.tpu`` of the simulated device: the same names torch_tpu 0.2.0's device module offers, no others.

Mirrors ``torch_tpu._internal.device._device_module`` as ``torch_tpu._internal.public_api`` exports it
(device_count, is_available, current_device, set_device, synchronize, seeding and RNG state,
get_device_properties, get_device_name, get_amp_supported_dtype, precision/Precision, streams as no-ops).
Like torch_tpu it has no ``mem_get_info``/``memory_allocated``/``empty_cache``/``seed``/``get_rng_state_all``;
the simulator's memory counters are :func:`hf_tpu.sim.memory_allocated` and friends.

With torch >= 2.11 (>= 2.13 for ``initial_seed``/``get_rng_state``) torch_tpu marks the CUDA-style helpers that
have a ``torch.accelerator`` equivalent internal (``annotations.internal_or_experimental``): a call whose
immediate caller is not a ``torch``/``torch_tpu`` module raises RuntimeError naming the ``torch.accelerator``
function, unless ``TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=1`` (then it warns once); calls traced by torch.compile
are not checked. :func:`_internal` does the same here, with ``hf_tpu.sim`` standing in for ``torch_tpu``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hf_tpu.sim._device_index import index_of_device as _index
from hf_tpu.sim._rng import GENERATOR as _GENERATOR
from hf_tpu.sim._precision import Precision, precision

_F = TypeVar("_F", bound=Callable[..., Any])
# torch_tpu reads TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS once (env.get_bool_env_once, which takes 1/true/t/yes/y in any
# case, nothing else: checked against the 0.2.0 wheel); so does the simulator.
_LEGACY = os.environ.get("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "")
_STRICT_INTERNAL = _LEGACY.lower() not in ("1", "true", "t", "yes", "y")
_FRAMEWORK = ("torch", "torch_tpu", "hf_tpu.sim")


def _is_framework_frame(frame: Any) -> bool:
    """Whether ``frame`` runs in torch, torch_tpu or the simulator itself (torch_tpu's stand-in)."""
    mod = frame.f_globals.get("__name__") if frame is not None else None
    if not isinstance(mod, str):
        return False
    return mod in _FRAMEWORK or mod.startswith(("torch.", "torch_tpu.", "hf_tpu.sim."))


def _internal(prefer: str, name: str | None = None) -> Callable[[_F], _F]:
    """Mark a ``torch.tpu`` function internal as torch_tpu 0.2.0 does: user code calling it gets torch_tpu's
    RuntimeError (``torch_tpu._internal.utils.annotations._create_warning_wrapper``), torch calls it freely."""

    def decorate(fn: _F) -> _F:
        warned = False

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal warned
            if (_STRICT_INTERNAL or not warned) and not torch.compiler.is_compiling():
                if not _is_framework_frame(sys._getframe(1)):
                    shown = name or fn.__name__
                    if _STRICT_INTERNAL:
                        raise RuntimeError(
                            f"{shown} is internal to TorchTPU and can only be called by the PyTorch framework (torch "
                            f"and torch_tpu). Use {prefer} instead."
                        )
                    warned = True
                    warnings.warn(
                        f"{shown} is internal to TorchTPU and may change or be removed without notice. "
                        f"Use {prefer} instead.",
                        stacklevel=2,
                    )
            return fn(*args, **kwargs)

        wrapper.__tt_api_prefer__ = prefer  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


# torch_tpu's _AMP_SUPPORTED_DTYPES, as listed in _device_module.py
_AMP_DTYPES = [
    torch.bfloat16,
    torch.bool,
    torch.complex128,
    torch.complex64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.uint8,
]
_GENERATION = {"name": "TPU v6e", "hbm": 0}
_autocast_enabled = False
_autocast_dtype: torch.dtype | None = torch.bfloat16


@dataclass(frozen=True)
class _TpuDeviceProperties:
    """Static properties of the (simulated) device, as torch_tpu reports them."""

    name: str
    total_memory: int
    multi_processor_count: int = 1


def _configure(name: str, hbm: int) -> None:
    _GENERATION["name"] = name
    _GENERATION["hbm"] = hbm


@_internal("torch.accelerator.is_available")
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


@_internal("torch.accelerator.device_count")
def device_count() -> int:
    return 1


@_internal("torch.accelerator.current_device_index")
def current_device() -> int:
    return 0


@_internal("torch.accelerator.set_device_index")
def set_device(device: Any) -> None:
    _index(device)


def _exchange_device(device: int) -> int:
    _index(device)
    return 0


def _maybe_exchange_device(device: int) -> int:
    return 0


@_internal("torch.accelerator.synchronize")
def synchronize(device: Any = None) -> None:
    """Wait for the device (the simulator computes eagerly, so there is nothing to wait for)."""
    _index(device)


def manual_seed(seed: int) -> None:
    _GENERATOR.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    _GENERATOR.manual_seed(int(seed))






@_internal("torch.accelerator.random.initial_seed")
def initial_seed() -> int:
    return _GENERATOR.initial_seed()


@_internal("torch.accelerator.random.get_rng_state")
def get_rng_state(device: Any = "tpu") -> torch.Tensor:
    _index(device)
    return _GENERATOR.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "tpu") -> None:
    _index(device)
    _GENERATOR.set_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)






default_generators = (_GENERATOR,)


def _get_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (torch_tpu's ``_get_generator``: what AOTAutograd's graph-safe RNG asks
    ``torch.<device>`` for; see hf_tpu/sim/_rng.py)."""
    return default_generators[_index(device)]


def get_device_name(device: Any = None) -> str:
    _index(device)
    return _GENERATION["name"]


def get_device_properties(device: Any = None) -> _TpuDeviceProperties:
    _index(device)
    return _TpuDeviceProperties(name=str(_GENERATION["name"]), total_memory=int(_GENERATION["hbm"]))




def _get_compute_capability(device: Any = None) -> str:
    return ""


def get_amp_supported_dtype() -> list[torch.dtype]:
    return list(_AMP_DTYPES)


@dataclass(frozen=True)
class _PerfStats:
    """What torch_tpu's ``_get_cache_stats()`` returns (its pybind ``PerfStats``: the same attribute names)."""

    num_cache_reqs: int
    num_cache_hits: int
    num_compilations: int
    peak_compilation_host_memory_bytes: int
    per_entry_stats: list


def _get_cache_stats() -> _PerfStats:
    """torch_tpu's compilation-cache counters, from the simulator's: every eager op (outside compiled graphs) and
    every graph compile is a request; a new eager shape signature or a graph compile is a miss (what torch_tpu
    compiles), the rest hits. ``per_entry_stats`` stays empty (the simulator keeps no per-executable timings)."""
    from hf_tpu.sim._counters import STATE

    misses = STATE.shape_signatures + STATE.compiles
    requests = STATE.ops - STATE.graph_ops + STATE.compiles
    return _PerfStats(requests, requests - misses, misses, 0, [])




def _is_autocast_enabled() -> bool:
    return _autocast_enabled


def _get_autocast_dtype() -> torch.dtype | None:
    return _autocast_dtype


class Stream:
    """A no-op stream (the simulator runs every op eagerly, in order)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device_index = 0
        self.priority = priority

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        return event

    def query(self) -> bool:
        return True


class Event:
    """A no-op event."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs: Any
    ) -> None:
        pass

    def record(self, stream: Stream | None = None) -> None:
        pass

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@_internal("torch.accelerator.current_stream")
def current_stream(device: Any = None) -> Stream:
    return Stream()


def default_stream(device: Any = None) -> Stream:
    return Stream()


@_internal("torch.accelerator.set_stream")
def set_stream(stream: Stream) -> None:
    pass


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    yield


class device:
    """Context manager selecting a device; only tpu:0 exists (internal in torch_tpu, like ``set_device``)."""

    @_internal("torch.accelerator.device_index", name="_DeviceContext")  # torch_tpu's class name, in its message
    def __init__(self, device: Any) -> None:
        if device is not None and not (isinstance(device, int) and device < 0):
            _index(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class device_of(device):
    """Context manager selecting the device of a tensor or storage (a no-op for CPU objects)."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj.get_device() if getattr(getattr(obj, "device", None), "type", None) == "tpu" else -1)


# torch.tpu is this module: keep only torch_tpu's names public (its torch.tpu resolves nothing else).
del annotations, Any, Callable, Iterator, TypeVar, dataclass
