"""Which TPU devices this process can place weights on, and how much HBM each has free.

Accelerate finds accelerators through ``torch.cuda``/``torch.xpu``/``torch.npu``/... and their ``mem_get_info``; it
knows nothing of ``torch.tpu``. torch-tpu 0.2.0 has no ``torch.tpu.memory_allocated``/``mem_get_info``; its C++
allocator (``torch_tpu::TpuAllocator``, a ``c10::DeviceAllocator`` with ``getMemoryInfo`` and ``getDeviceStats``)
answers torch's own entry points instead: ``torch.accelerator.get_memory_info(i)`` -> ``(free, total)`` and
``torch.accelerator.memory_allocated(i)``. Here, on a real TPU, the total comes from the device properties
(``torch.tpu.get_device_properties().total_memory``, public in 0.2.0) and what is in use from
``get_memory_info`` (what the device has free, whoever holds the rest), else ``memory_allocated``; on the
simulator, from its configured HBM and its live bytes.

torch_tpu gives each process one chip, addressed as ``tpu:0``; the simulator follows the same rule.

Example:
    >>> from hf_tpu.device_map import devices
    >>> devices.tpu_device_count() >= 0
    True
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = [
    "TPUMemory",
    "is_tpu_device",
    "tpu_available",
    "tpu_device_count",
    "tpu_memory",
]

logger = logging.getLogger("hf_tpu.device_map")


@dataclass(frozen=True)
class TPUMemory:
    """Memory of one TPU device, in bytes.

    Attributes:
        index: the device's index (``tpu:index``).
        total: its HBM.
        used: bytes in use now (live tensors).
        free: ``total - used``, never below 0.
    """

    index: int
    total: int
    used: int

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)


def tpu_available() -> bool:
    """Whether this process has a TPU: real chips through torch_tpu, or the simulated device.

    Returns:
        True when :func:`hf_tpu.runtime.detect` finds a real or simulated TPU.
    """
    from hf_tpu import runtime

    return runtime.detect().mode != "none"


def tpu_device_count() -> int:
    """Number of TPU devices this process addresses.

    Returns:
        0 without a TPU; 1 per process on torch_tpu and on the simulator.
    """
    from hf_tpu import runtime

    info = runtime.detect()
    return info.device_count if info.mode != "none" else 0


def _live_bytes(index: int, total: int) -> int:
    """Bytes in use on ``tpu:index`` now: the simulator's own count, or what torch_tpu's allocator reports through
    ``torch.accelerator`` (``total - free`` from ``get_memory_info``, else ``memory_allocated``)."""
    from hf_tpu import runtime

    if runtime.detect().mode == "simulated":
        from hf_tpu.sim import memory_allocated

        return int(memory_allocated())
    import torch

    failures = []
    try:
        free, _ = torch.accelerator.get_memory_info(index)
        return max(int(total) - int(free), 0)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        failures.append(f"torch.accelerator.get_memory_info({index}): {exc}")
    try:
        return int(torch.accelerator.memory_allocated(index))
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        failures.append(f"torch.accelerator.memory_allocated({index}): {exc}")
    warnings.warn(
        f"cannot read how much HBM is in use on tpu:{index} ({'; '.join(failures)}); planning placement as if it "
        "were empty. Pass max_memory={'tpu': ...} to set the budget yourself.",
        RuntimeWarning,
        stacklevel=3,
    )
    return 0


def _total_bytes(index: int) -> int:
    from hf_tpu import runtime

    info = runtime.detect()
    if info.mode == "real":
        import torch

        try:
            return int(torch.tpu.get_device_properties(index).total_memory)
        except (RuntimeError, AttributeError) as exc:  # unrecognised generation: use what runtime detected
            logger.debug("torch.tpu.get_device_properties(%d) failed: %s", index, exc)
    return int(info.hbm_bytes)


def tpu_memory(index: int = 0) -> TPUMemory:
    """Total, used and free HBM of ``tpu:index``.

    Args:
        index: the device index; 0 (the default) is the one device torch_tpu gives each process.

    Returns:
        A :class:`TPUMemory` read now (the used bytes from the simulator or torch_tpu's allocator; when neither
        answers, a RuntimeWarning says so and 0 bytes are counted as used).

    Raises:
        TPUNotAvailableError: this process has no TPU.
        ValueError (InvalidArgumentError): ``index`` is not a device this process addresses.

    Example:
        >>> import hf_tpu.sim; hf_tpu.sim.enable()          # doctest: +SKIP
        >>> tpu_memory(0).free <= tpu_memory(0).total          # doctest: +SKIP
        True
    """
    count = tpu_device_count()
    if count == 0:
        from hf_tpu import runtime

        runtime.require_tpu(f"tpu:{index}")
    if not 0 <= index < count:
        raise InvalidArgumentError(
            f"tpu:{index} was asked for, but this process addresses {count} TPU device(s) "
            f"({', '.join(f'tpu:{i}' for i in range(count))}); torch_tpu gives each process one chip, seen as "
            "tpu:0. Use 'tpu' (or 'tpu:0'), and `hf-tpu launch` for one process per chip."
        )
    total = _total_bytes(index)
    return TPUMemory(index=index, total=total, used=_live_bytes(index, total))


def is_tpu_device(device: Any) -> bool:
    """Whether a device-map value (``"tpu"``, ``"tpu:0"``, ``torch.device('tpu', 0)``) names a TPU.

    Args:
        device: a device-map value: a string, a ``torch.device``, an integer, ...; integers answer False here
            (whether they mean a TPU depends on the process, see :mod:`hf_tpu.device_map.maps`).

    Returns:
        True for ``"tpu"``, ``"tpu:N"`` and a ``torch.device`` of type ``tpu``.
    """
    if isinstance(device, str):
        return device == "tpu" or device.startswith("tpu:")
    return getattr(device, "type", None) == "tpu"
