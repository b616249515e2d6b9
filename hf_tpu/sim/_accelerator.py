"""``torch.accelerator`` on the simulated device: the calls torch_tpu tells users to make instead of ``torch.tpu.*``.

torch 2.13 serves ``torch.accelerator.synchronize`` through the device guard and the memory functions through a C++
caching allocator; a backend written in Python can register neither (``torch._C._acc.DeviceGuard`` exposes only
``type_``), so without this module they fail with "Backend doesn't support synchronizing all streams on device"
or an INTERNAL ASSERT about the device allocator. torch_tpu has both, and its ``torch.tpu.synchronize`` refuses user
calls in favour of ``torch.accelerator.synchronize``. While the current accelerator is the simulated ``tpu``, these
functions answer from the simulator: synchronize is a no-op (it computes eagerly), memory statistics are its live and
peak device bytes (:func:`hf_tpu.sim.memory_allocated`), ``get_memory_info`` is (free, total) of the simulated HBM.
Other devices get torch's own functions.

These answers belong to the device, not to an integration: they are installed when the simulated device is
registered and stay for as long as it does, which is the life of the process (torch cannot unregister a PrivateUse1
backend, and ``hf_tpu.disable()`` leaves ``tpu`` tensors working). A chip's torch_tpu answers them natively, and
upstream libraries call them whenever the current accelerator is ``tpu``: accelerate 1.16's
``clear_device_cache`` calls ``torch.accelerator.empty_cache()`` from ``dispatch_model`` and the Trainer, with or
without hf_tpu's integrations. Reverting them with the integrations would leave a registered ``tpu`` accelerator
whose ``empty_cache`` fails torch's internal assert.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.accelerator
import torch.accelerator.memory

from hf_tpu import _patch

from hf_tpu.sim._counters import STATE

__all__ = ["install"]


def _on_sim(device: Any) -> bool:
    acc = torch.accelerator.current_accelerator()
    if acc is None or acc.type != "tpu":
        return False
    from hf_tpu.sim._device_index import index_of_device

    if isinstance(device, (str, torch.device)) and torch.device(device).type != "tpu":
        return False  # let torch raise its own "must match the current accelerator" error
    index_of_device(device)
    return True


def _synchronize(original: Callable[..., Any]) -> Callable[..., Any]:
    def synchronize(device: Any = None, /) -> None:
        if _on_sim(device):
            return None
        return original(device)

    return synchronize


def _memory_stats(original: Callable[..., Any]) -> Callable[..., Any]:
    def memory_stats(device_index: Any = None, /) -> collections.OrderedDict[str, Any]:
        if not _on_sim(device_index):
            return original(device_index)
        live, peak = STATE.live_bytes, STATE.peak_bytes
        return collections.OrderedDict(
            [
                ("allocated_bytes.all.current", live),
                ("allocated_bytes.all.peak", peak),
                ("reserved_bytes.all.current", live),
                ("reserved_bytes.all.peak", peak),
            ]
        )

    return memory_stats


def _get_memory_info(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_memory_info(device_index: Any = None, /) -> tuple[int, int]:
        if not _on_sim(device_index):
            return original(device_index)
        total = STATE.hbm_bytes
        return max(total - STATE.live_bytes, 0), total

    return get_memory_info


def _reset_peak(original: Callable[..., Any]) -> Callable[..., Any]:
    def reset_peak_memory_stats(device_index: Any = None, /) -> None:
        if not _on_sim(device_index):
            return original(device_index)
        STATE.peak_bytes = STATE.live_bytes
        return None

    return reset_peak_memory_stats


def _no_op(original: Callable[..., Any]) -> Callable[..., Any]:
    def no_op(*args: Any) -> None:
        if not _on_sim(args[0] if args else None):
            return original(*args)
        return None  # nothing cached: simulated device memory is released as tensors die

    no_op.__name__ = original.__name__
    return no_op


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "synchronize": _synchronize,
    "memory_stats": _memory_stats,
    "get_memory_info": _get_memory_info,
    "reset_peak_memory_stats": _reset_peak,
    "reset_accumulated_memory_stats": _no_op,
    "empty_cache": _no_op,
}


def forget_cached_checks() -> None:
    """Drop transformers' cached answers that depend on the host's accelerator, computed before the device existed.

    transformers caches ``is_torch_flex_attn_available()`` (False where the current accelerator is ``tpu``: torch's
    flex_attention refuses TPU tensors). On a TPU host torch_tpu loads at ``import torch``, before any check; the
    simulator may be enabled after transformers answered, so the cached answer is dropped here and recomputed.
    """
    import sys

    import_utils = sys.modules.get("transformers.utils.import_utils")
    check = getattr(import_utils, "is_torch_flex_attn_available", None)
    if check is not None and hasattr(check, "cache_clear"):
        check.cache_clear()


def install() -> None:
    """Answer the ``torch.accelerator`` functions above for the simulated device (idempotent; for the process's
    life, with the device: see the module's docstring). The originals stay reachable as ``fn._hf_tpu_original``."""
    for name, make in _WRAPPERS.items():
        for owner in (torch.accelerator, torch.accelerator.memory):
            if name not in vars(owner):
                continue
            current = getattr(owner, name)
            if getattr(current, "_hf_tpu_sim", False):
                continue
            replacement = make(current)
            replacement._hf_tpu_sim = True  # type: ignore[attr-defined]
            replacement._hf_tpu_original = current  # type: ignore[attr-defined]
            _patch.assign(owner, name, replacement, feature="sim", reason="the simulated device's, for the process's life")
