"""Device-map values written the way the user wrote them, turned into one canonical form.

Upstream device maps hold ints for "the accelerator" (``{"": 0}``), ``torch.device`` objects and strings side by
side. On TPU an int means nothing to torch_tpu (it ignores the index in ``tensor.to(int)``), and a pipeline reads
an int as CUDA and falls back to CPU when there is none. So every TPU value becomes the string ``"tpu:N"``:

- ``0`` -> ``"tpu:0"`` (when this process has a TPU)
- ``"tpu"``, ``torch.device("tpu")`` -> ``"tpu:0"``; ``"tpu:N"`` is checked against the devices this process sees
- ``torch.device("cpu")`` -> ``"cpu"``; ``"disk"``, ``"cpu"``, ``"meta"`` and other strings are kept

Example:
    >>> normalize_device_map({"model": "cpu", "lm_head": "disk"})
    {'model': 'cpu', 'lm_head': 'disk'}
"""

from __future__ import annotations

from typing import Any

from hf_tpu.device_map.devices import is_tpu_device, tpu_available, tpu_device_count
from hf_tpu.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["int_means_tpu", "names_tpu", "normalize_device", "normalize_device_map"]


def int_means_tpu() -> bool:
    """Whether an integer device id refers to a TPU here: whenever this process has one (real or simulated).

    With hf_tpu enabled and a TPU present, the TPU is the accelerator, also on a host that has CUDA devices too.
    """
    return tpu_available()


def tpu_index(value: Any) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        _, _, index = value.partition(":")
        if not index:
            return 0
        try:
            return int(index)
        except ValueError:
            raise InvalidArgumentError(
                f"{value!r} is not a device: write 'tpu' or 'tpu:N' with N an integer"
            ) from None
    return 0 if value.index is None else int(value.index)


def check_index(index: int, asked: Any) -> None:
    from hf_tpu import runtime

    runtime.require_tpu(f"device {asked!r}")
    count = tpu_device_count()
    if not 0 <= index < count:
        visible = ", ".join(f"tpu:{i}" for i in range(count)) or "none"
        raise InvalidArgumentError(
            f"device {asked!r} was asked for, but this process sees {count} TPU device(s) ({visible}). torch_tpu "
            "gives each process one chip, seen as tpu:0: use 'tpu' (or 'tpu:0'), and `hf-tpu launch` to run one "
            "process per chip."
        )


def normalize_device(value: Any) -> Any:
    """Canonical form of one device-map value (see the module docstring).

    Args:
        value: a device-map value: ``"tpu"``, ``"tpu:N"``, a ``torch.device``, an integer id, ``"cpu"``,
            ``"disk"``, ...

    Returns:
        ``"tpu:N"`` for a TPU (an integer id means a TPU when this process has one), ``"cpu"`` for -1, the string
        of any other ``torch.device``, and other values unchanged.

    Raises:
        TypeError (InvalidTypeError): ``value`` is a bool.
        ValueError: a TPU index this process does not address, or a malformed ``"tpu:..."`` string.
        TPUNotAvailableError: ``value`` names a TPU and this process has none.

    Example:
        >>> normalize_device("disk")
        'disk'
    """
    if isinstance(value, bool):  # bool is an int; never a device
        raise InvalidTypeError(f"{value!r} is not a device")
    if isinstance(value, int):
        if value < 0:
            return "cpu" if value == -1 else value
        if int_means_tpu():
            check_index(value, value)
            return f"tpu:{value}"
        return value
    if is_tpu_device(value):
        index = tpu_index(value)
        check_index(index, str(value))
        return f"tpu:{index}"
    import torch

    if isinstance(value, torch.device):
        return str(value)
    return value


def normalize_device_map(device_map: Any) -> Any:
    """Apply :func:`normalize_device` to every value of a dict device map; other values pass through.

    Args:
        device_map: a ``device_map`` argument: a dict (module name -> device), or a string such as ``"auto"``.

    Returns:
        A new dict of the same type with each value normalised, or ``device_map`` itself when it is not a dict.

    Raises:
        TypeError: see :func:`normalize_device`.
        ValueError: see :func:`normalize_device`.
        TPUNotAvailableError: see :func:`normalize_device`.

    Example:
        >>> normalize_device_map("auto")
        'auto'
    """
    if not isinstance(device_map, dict):
        return device_map
    return type(device_map)((name, normalize_device(device)) for name, device in device_map.items())


def names_tpu(value: Any) -> bool:
    """Whether a ``device_map`` / ``device`` / ``max_memory`` argument mentions a TPU anywhere."""
    if isinstance(value, dict):
        return any(is_tpu_device(k) or is_tpu_device(v) for k, v in value.items())
    return is_tpu_device(value)
