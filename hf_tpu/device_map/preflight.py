"""Check a placement against the memory it needs, before any weight is read.

Without this check, ``from_pretrained(device_map="tpu")`` of a model larger than HBM reads weights one by one
until the device runs out of memory halfway through, and ``device_map="auto"`` quietly sends what does not fit
in memory to disk. Here the plan is weighed on the empty (meta) model: the bytes each device would receive are
summed and compared with the free HBM of each TPU device, and a plan that needs disk while disk offload was not
asked for is refused. The error names the sizes and what to change.

Example:
    >>> from hf_tpu.device_map.preflight import format_bytes
    >>> format_bytes(3 * 1024**3)
    '3.00 GiB'
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hf_tpu.device_map.devices import is_tpu_device, tpu_memory
from hf_tpu.errors import UserError

__all__ = ["DeviceMapFitError", "check_placement", "format_bytes", "placement_bytes"]


class DeviceMapFitError(UserError, ValueError):
    """The requested placement does not fit the memory of the devices it names (raised before loading)."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``.

    Args:
        n: a number of bytes.

    Returns:
        ``n`` in the largest binary unit (B, KiB, MiB, GiB, TiB) that keeps it under 1024, two decimals past bytes.
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _device_for(name: str, device_map: dict[str, Any]) -> Any:
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def placement_bytes(model: Any, device_map: dict[str, Any], hf_quantizer: Any = None) -> dict[Any, int]:
    """Bytes of parameters and buffers each device of ``device_map`` receives (tied weights counted once).

    Works on a model whose tensors are on the meta device; a transformers quantizer gives the stored element size.

    Args:
        model: the model (its parameters and buffers may be on the meta device).
        device_map: module or tensor name -> device; a tensor goes where its longest named prefix goes, and
            tensors no entry covers are not counted.
        hf_quantizer: a transformers quantizer, whose ``param_element_size`` gives each tensor's stored size;
            None (the default): each tensor's own element size.

    Returns:
        Each device of ``device_map`` that receives tensors, mapped to their bytes.
    """
    skip = set(getattr(model, "all_tied_weights_keys", {}) or {})
    seen: set[int] = set()
    totals: dict[Any, int] = defaultdict(int)
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if name in skip or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        device = _device_for(name, device_map)
        if device is None:
            continue
        if hf_quantizer is not None:
            element = hf_quantizer.param_element_size(model, name, tensor)
        else:
            element = tensor.element_size()
        totals[device] += int(tensor.numel() * element)
    return dict(totals)


def _describe(asked: Any) -> str:
    return f"device_map={asked!r}" if not isinstance(asked, dict) else "the device_map passed"


def check_placement(
    model: Any,
    device_map: dict[str, Any],
    *,
    asked: Any,
    inferred: bool,
    disk_allowed: bool = True,
    limits: dict[Any, int] | None = None,
    hf_quantizer: Any = None,
) -> dict[Any, int]:
    """Raise :class:`DeviceMapFitError` if ``device_map`` cannot be honoured; return the bytes per device.

    - every TPU device must have room for what is placed on it (free HBM = total - live bytes);
    - an ``inferred`` plan (``"auto"``/``"balanced"``/...) that sends weights to disk needs ``disk_allowed``
      (an ``offload_folder`` or a ``"disk"`` entry in ``max_memory``), and fits within a ``"disk"`` limit if any.

    ``limits`` is the ``max_memory`` the plan was made with (named in the message).

    Args:
        model: the model about to be loaded (tensors may be on the meta device).
        device_map: the placement, module or tensor name -> device.
        asked: the ``device_map`` argument the user passed, quoted in the message.
        inferred: True when the plan was inferred (``"auto"``, ``"balanced"``, ...) rather than given as a dict.
        disk_allowed: whether weights may be offloaded to disk (an ``offload_folder`` or a ``"disk"`` entry in
            ``max_memory``); True by default.
        limits: the ``max_memory`` the plan was made with; None: none given.
        hf_quantizer: a transformers quantizer giving the stored element sizes (see :func:`placement_bytes`).

    Returns:
        The bytes each device receives, as :func:`placement_bytes` counts them.

    Raises:
        DeviceMapFitError: a TPU device gets more than its free HBM, or an inferred plan needs disk offload that is
            not allowed or exceeds the ``"disk"`` limit. Nothing has been loaded then.
        TPUNotAvailableError: the map names a TPU device and this process has none (from :func:`tpu_memory`).
    """
    placed = placement_bytes(model, device_map, hf_quantizer)
    total = sum(placed.values())
    where = ", ".join(f"{d}: {format_bytes(b)}" for d, b in placed.items())
    for device, nbytes in placed.items():
        if not is_tpu_device(device):
            continue
        mem = tpu_memory(int(str(device).partition(":")[2] or 0))
        if nbytes > mem.free:
            hint = (
                "Lower max_memory for the TPU, or free TPU memory (delete other models, gc.collect())."
                if inferred
                else "Use device_map='auto' to offload what does not fit to the CPU (and disk), load a smaller dtype "
                "(e.g. dtype=torch.bfloat16), or free TPU memory."
            )
            raise DeviceMapFitError(
                f"{_describe(asked)} puts {format_bytes(nbytes)} of weights on {device}, but {device} has "
                f"{format_bytes(mem.free)} free (HBM {format_bytes(mem.total)}, {format_bytes(mem.used)} in use). "
                f"The model needs {format_bytes(total)} in all ({where}). {hint} Nothing was loaded."
            )
    disk = placed.get("disk", 0)
    if inferred and disk:
        budget = ", ".join(
            f"{'tpu:' + str(k) if isinstance(k, int) else k}: {format_bytes(v)}" for k, v in (limits or {}).items()
        )
        in_memory = total - disk
        if not disk_allowed:
            raise DeviceMapFitError(
                f"{_describe(asked)}: the model ({format_bytes(total)} of weights) does not fit in the memory allowed "
                f"({budget or 'none'}): {format_bytes(in_memory)} fits, {format_bytes(disk)} would have to go to disk. "
                "Pass offload_folder=... to allow disk offload, raise max_memory (e.g. max_memory={'tpu': ..., "
                "'cpu': ...}), or load a smaller dtype. Nothing was loaded."
            )
        disk_limit = (limits or {}).get("disk")
        if disk_limit is not None and disk > disk_limit:
            raise DeviceMapFitError(
                f"{_describe(asked)}: the model ({format_bytes(total)}) fits nowhere: {format_bytes(in_memory)} fits "
                f"in memory ({budget}) and the remaining {format_bytes(disk)} exceeds the disk limit "
                f"{format_bytes(disk_limit)}. Raise max_memory. Nothing was loaded."
            )
    return placed
