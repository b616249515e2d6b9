"""Which TPU devices this process can place weights on, and how much HBM each has free.

Accelerate finds accelerators through ``torch.cuda``/``torch.xpu``/``torch.npu``/... and their ``mem_get_info``; it
knows nothing of ``torch.tpu``, and torch_tpu has no ``mem_get_info``. Here the total comes from the device
properties (``torch.tpu.get_device_properties().total_memory``, or the simulator's configured HBM) and the
free memory is that total minus what is live on the device now.

torch_tpu gives each process one chip, addressed as ``tpu:0``; the simulator follows the same rule.

Example:
    >>> from hf_tpu.device_map import devices
    >>> devices.tpu_device_count() >= 0
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

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
    """Memory of one TPU device, in bytes."""

    index: int
    total: int
    used: int

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)


def tpu_available() -> bool:
    """True when this process has a TPU: real chips through torch_tpu, or the simulated device."""
    from hf_tpu import runtime

    return runtime.detect().mode != "none"


def tpu_device_count() -> int:
    """Number of TPU devices this process addresses (0 without a TPU; 1 per process on torch_tpu)."""
    from hf_tpu import runtime

    info = runtime.detect()
    return info.device_count if info.mode != "none" else 0


def _live_bytes(index: int) -> int:
    """Bytes live on ``tpu:index`` now: the simulator's own count, or torch_tpu's allocator stats when it has any."""
    from hf_tpu import runtime

    if runtime.detect().mode == "simulated":
        import hf_tpu.sim

        return int(hf_tpu.sim.memory_allocated())
    import torch

    module = getattr(torch, "tpu", None)
    for name in ("memory_allocated", "memory_reserved"):
        fn = getattr(module, name, None) if module is not None else None
        if callable(fn):
            try:
                return int(fn(index))
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # experimental API missing on this build
                logger.debug("torch.tpu.%s(%d) failed: %s", name, index, exc)
    # torch_tpu 0.2.0 exposes no allocator statistics: assume the device is empty and say so once.
    logger.info("torch_tpu reports no live HBM usage; treating tpu:%d as empty when planning placement", index)
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
        raise ValueError(
            f"tpu:{index} was asked for, but this process addresses {count} TPU device(s) "
            f"({', '.join(f'tpu:{i}' for i in range(count))}); torch_tpu gives each process one chip, seen as "
            "tpu:0. Use 'tpu' (or 'tpu:0'), and `hf-tpu launch` for one process per chip."
        )
    return TPUMemory(index=index, total=_total_bytes(index), used=_live_bytes(index))


def is_tpu_device(device: Any) -> bool:
    """Whether a device-map value (``"tpu"``, ``"tpu:0"``, ``torch.device('tpu', 0)``) names a TPU."""
    if isinstance(device, str):
        return device == "tpu" or device.startswith("tpu:")
    return getattr(device, "type", None) == "tpu"
