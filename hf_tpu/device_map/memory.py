"""``max_memory`` with the TPU in it: what Accelerate's ``get_max_memory`` returns once it knows about TPU chips.

Upstream keys accelerators by integer id (``{0: bytes, "cpu": bytes}``) and its planner
(``infer_auto_device_map``, ``get_balanced_memory``) gives ints priority, keeps a 10% buffer on them and balances
across them. hf_tpu keeps that convention inside the planner, so all of upstream's planning logic applies to TPU
chips unchanged, and accepts what users write on TPU:

- ``{"tpu": "2GiB"}``: the budget of every TPU device this process sees (one under torch_tpu)
- ``{"tpu:0": "2GiB"}``, ``{torch.device("tpu", 0): ...}``, ``{0: ...}``: the budget of ``tpu:0``
- ``"cpu"``, ``"disk"``, ``"mps"`` as upstream

The integer ids in the planner's output become ``"tpu:N"`` again (:mod:`hf_tpu.device_map.maps`).

Example:
    >>> import hf_tpu.sim; hf_tpu.sim.enable()                               # doctest: +SKIP
    >>> get_max_memory({"tpu": "1GiB", "cpu": "2GiB"})                        # doctest: +SKIP
    {0: 1073741824, 'cpu': 2147483648}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_tpu.device_map.devices import is_tpu_device, tpu_device_count, tpu_memory
from hf_tpu.device_map.maps import check_index, int_means_tpu, names_tpu, tpu_index
from hf_tpu.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["get_max_memory", "normalize_max_memory"]

_ORDER = ("mps", "cpu", "disk")


def _size(value: Any) -> int:
    if isinstance(value, str):
        from accelerate.utils import convert_file_size_to_int

        return convert_file_size_to_int(value)
    return int(value)


def _keys_for(key: Any) -> list[Any]:
    if isinstance(key, bool):
        raise InvalidTypeError(f"max_memory key {key!r} is not a device")
    if key == "tpu" or (hasattr(key, "type") and key.type == "tpu" and key.index is None):
        from hf_tpu import runtime

        runtime.require_tpu("max_memory={'tpu': ...}")
        return list(range(tpu_device_count()))
    if is_tpu_device(key) or (isinstance(key, int) and int_means_tpu()):
        index = tpu_index(key)
        check_index(index, key if isinstance(key, int) else str(key))
        return [index]
    if hasattr(key, "type"):  # another torch.device: upstream knows it by its string
        return [str(key)]
    return [key]


def normalize_max_memory(max_memory: dict[Any, Any]) -> dict[Any, int]:
    """A new dict with TPU keys as integer ids, sizes in bytes, accelerators first, then mps, cpu, disk.

    Args:
        max_memory: device -> size, as users pass it to ``from_pretrained``: keys ``"tpu"`` (every TPU device),
            ``"tpu:N"``, a ``torch.device``, N (a TPU id when this process has a TPU), ``"mps"``, ``"cpu"`` or
            ``"disk"``; sizes in bytes or strings such as ``"14GiB"``.

    Returns:
        A new dict in accelerate's form: integer TPU ids first, then ``"mps"``, ``"cpu"``, ``"disk"``, sizes in
        bytes.

    Raises:
        TypeError: a key is a bool.
        ValueError (InvalidArgumentError): a key is no device hf_tpu or accelerate knows, or names a TPU index this
            process lacks.
        TPUNotAvailableError: a key names a TPU and this process has none.

    Example:
        >>> normalize_max_memory({"cpu": "1KiB", "disk": 10})
        {'cpu': 1024, 'disk': 10}
    """
    flat: dict[Any, int] = {}
    for key, value in max_memory.items():
        for k in _keys_for(key):
            flat[k] = _size(value)
    ints = sorted(k for k in flat if isinstance(k, int))
    unknown = [k for k in flat if not isinstance(k, int) and k not in _ORDER]
    if unknown:
        raise InvalidArgumentError(
            f"max_memory has entries for {unknown}, which are not devices hf_tpu or accelerate know. Use 'tpu' (every "
            "TPU device), 'tpu:N' or N for one TPU device, 'cpu' and 'disk'; for example "
            "max_memory={'tpu': '14GiB', 'cpu': '64GiB'}."
        )
    return {k: flat[k] for k in [*ints, *(k for k in _ORDER if k in flat)]}


def get_max_memory(max_memory: dict[Any, Any] | None = None, *, upstream: Callable[..., dict] | None = None) -> dict:
    """Accelerate's ``get_max_memory`` with the TPU devices of this process in it.

    With ``max_memory=None``: the free HBM of every TPU device (total HBM minus live bytes) under integer ids, and the
    available host RAM under ``"cpu"``. With a dict: its sizes in bytes, TPU keys normalised (see the module
    docstring). Without a TPU this is upstream's function (``upstream``), except that a ``"tpu"`` key raises
    :class:`hf_tpu.runtime.TPUNotAvailableError`.

    Like upstream, string sizes in a passed dict are converted in place (transformers relies on it).

    Args:
        max_memory: device -> size as users pass it (see :func:`normalize_max_memory`); None (the default): what
            the devices have free now.
        upstream: accelerate's original ``get_max_memory``, called when no TPU is involved; None (the default)
            looks it up in :mod:`hf_tpu._patch`'s records.

    Returns:
        Device -> bytes in accelerate's form (integer TPU ids first, then ``"cpu"``, ...).

    Raises:
        TPUNotAvailableError: ``max_memory`` names a TPU and this process has none.
        TypeError: a bool key (see :func:`normalize_max_memory`).
        ValueError: an unknown device key, or a TPU index this process lacks (see :func:`normalize_max_memory`).

    Example:
        >>> import hf_tpu.sim; hf_tpu.sim.enable(hbm="1GiB")                    # doctest: +SKIP
        >>> get_max_memory()[0] <= 1024**3                                      # doctest: +SKIP
        True
    """
    if upstream is None:
        import accelerate.utils.modeling as acc_modeling

        from hf_tpu import _patch

        upstream = _patch.original(acc_modeling, "get_max_memory")
    if max_memory is not None:
        for key, value in list(max_memory.items()):
            if isinstance(value, str):
                max_memory[key] = _size(value)
        if not int_means_tpu() and not names_tpu(max_memory):
            return upstream(max_memory)
        return normalize_max_memory(max_memory)
    if not int_means_tpu():
        return upstream(None)
    import psutil

    result: dict[Any, int] = {i: tpu_memory(i).free for i in range(tpu_device_count())}
    result["cpu"] = psutil.virtual_memory().available
    return result
