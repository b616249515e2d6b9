"""Pinned host memory on the simulated device: ``pin_memory()``, ``DataLoader(pin_memory=True)``, non-blocking copies.

On an accelerator, ``tensor.pin_memory()`` copies a CPU tensor into page-locked memory from the accelerator's pinned
allocator, ``is_pinned()`` says so, and ``t.to("cpu", non_blocking=True)`` lands in pinned memory. torch 2.13 asks
the PrivateUse1 hooks for that allocator (``PrivateUse1HooksInterface::getPinnedMemoryAllocator``), and a backend
written in Python cannot provide one (``torch._C._acc.PrivateUse1Hooks`` exposes only ``is_available``,
``has_primary_context`` and ``is_built``): each of those calls fails with torch's internal "register
PrivateUse1HooksInterface" message. Pinned memory only makes DMA faster; on the simulator it is ordinary CPU memory
marked pinned. This module registers, for the CPU, ``aten::_pin_memory`` (a copy into a new buffer marked pinned)
and ``aten::is_pinned`` (true for such buffers), and, for the device, ``aten::_to_copy`` (a device-to-host copy with
``non_blocking=True`` runs synchronously, as the simulator always does, into a buffer marked pinned).

Factory functions with ``pin_memory=True`` (``torch.empty(n, pin_memory=True)``, DDP's reducer) allocate in C++
through the hooks' allocator: the simulator's native core (``_native.cpp``) registers C++ hooks that provide one
(CPU memory remembered as pinned); without the native core they fail with torch's message.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DispatchKey

from hf_tpu.sim._counters import STATE

__all__ = ["install", "is_marked_pinned"]

_LIB: torch.library.Library | None = None
_COMPOSITE = DispatchKey.CompositeExplicitAutograd
_to_copy_composite = torch.ops.aten._to_copy.default
_is_pinned_composite = torch.ops.aten.is_pinned.default


def _mark(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage()._hf_pinned = True
    return t


def is_marked_pinned(t: torch.Tensor) -> bool:
    """True for a CPU tensor whose memory the simulator pinned (``pin_memory()``, a non-blocking ``.cpu()``, or,
    with the native core, a factory with ``pin_memory=True``)."""
    storage = t.untyped_storage()
    if getattr(storage, "_hf_pinned", False):
        return True
    native = STATE.native
    return native is not None and native.is_pinned_ptr(storage.data_ptr())


def _check_pin_device(device: Any) -> None:
    if device is None:
        return
    dev = torch.device(device)
    if dev.type != "tpu":
        raise RuntimeError(
            f"pin_memory(device={str(dev)!r}): this process's accelerator is the simulated tpu device, so host "
            "memory can only be pinned for 'tpu' (pass device='tpu' or no device)."
        )


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    _check_pin_device(device)
    out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype)
    out.copy_(self)
    return _mark(out)


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    _check_pin_device(device)
    return is_marked_pinned(self)


def _to_copy(self: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    if not kwargs.get("non_blocking"):
        return _to_copy_composite._op_dk(_COMPOSITE, self, **kwargs)
    kwargs["non_blocking"] = False  # the simulator copies synchronously; torch would allocate pinned memory here
    out = _to_copy_composite._op_dk(_COMPOSITE, self, **kwargs)
    if out.is_cpu and out.layout == torch.strided:
        _mark(out)  # as on an accelerator: a non-blocking copy to the host lands in pinned memory
    return out


def install() -> None:
    """Register the kernels above (once per process; torch offers no way to unregister them)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    lib.impl("is_pinned", _is_pinned, "CPU")
    lib.impl("_to_copy", _to_copy, "PrivateUse1")
    _LIB = lib
