"""``torch.tpu`` of the simulated device: the same functions torch_tpu 0.2.0's device module offers.

Mirrors ``torch_tpu._internal.device._device_module`` (device_count, is_available, current_device,
set_device, synchronize, seeding and RNG state, get_device_properties, get_device_name,
get_amp_supported_dtype, streams as no-ops). Like torch_tpu it has no ``mem_get_info``/``memory_allocated``;
the simulator's memory counters are :func:`hf_tpu.sim.memory_allocated` and friends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hf_tpu.sim._ops import GENERATOR

_AMP_DTYPES = [torch.bfloat16, torch.float16]
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


def _index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"expected a tpu device, got {device}")
        idx = 0 if device.index is None else device.index
    else:
        idx = int(device)
    if idx != 0:
        raise RuntimeError(
            f"tpu:{idx} does not exist: the simulated TPU, like torch_tpu, gives each process one device (tpu:0)."
        )
    return idx


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    _index(device)


def _exchange_device(device: int) -> int:
    _index(device)
    return 0


def _maybe_exchange_device(device: int) -> int:
    return 0


def synchronize(device: Any = None) -> None:
    """Wait for the device (the simulator computes eagerly, so there is nothing to wait for)."""
    _index(device)


def manual_seed(seed: int) -> None:
    GENERATOR.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    GENERATOR.manual_seed(int(seed))


def seed() -> None:
    GENERATOR.seed()


def seed_all() -> None:
    GENERATOR.seed()


def initial_seed() -> int:
    return GENERATOR.initial_seed()


def get_rng_state(device: Any = "tpu") -> torch.Tensor:
    _index(device)
    return GENERATOR.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "tpu") -> None:
    _index(device)
    GENERATOR.set_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [GENERATOR.get_state()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    set_rng_state(new_states[0])


default_generators = (GENERATOR,)


def get_device_name(device: Any = None) -> str:
    _index(device)
    return _GENERATION["name"]


def get_device_properties(device: Any = None) -> _TpuDeviceProperties:
    _index(device)
    return _TpuDeviceProperties(name=str(_GENERATION["name"]), total_memory=int(_GENERATION["hbm"]))


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


def _get_compute_capability(device: Any = None) -> str:
    return ""


def get_amp_supported_dtype() -> list[torch.dtype]:
    return list(_AMP_DTYPES)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


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


def current_stream(device: Any = None) -> Stream:
    return Stream()


def default_stream(device: Any = None) -> Stream:
    return Stream()


def set_stream(stream: Stream) -> None:
    pass


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    yield


class device:
    """Context manager selecting a device; only tpu:0 exists."""

    def __init__(self, device: Any) -> None:
        _index(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class device_of(device):
    def __init__(self, obj: Any) -> None:
        pass


def empty_cache() -> None:
    """Nothing to free: simulated device memory is released as tensors die."""
