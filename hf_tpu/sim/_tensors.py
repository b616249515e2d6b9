"""How a simulated ``tpu`` tensor is laid out: a PrivateUse1 tensor whose storage points at CPU memory.

Every ``tpu`` tensor's storage is a PrivateUse1 storage over the memory of a CPU storage, shared by every tensor
that shares the storage (views, ``detach``, ``nn.Parameter``). With the native core (``_native.py``) the device
storage's data pointer owns that CPU storage and counts its bytes; on the Python path it is a non-owning storage and
the CPU storage is kept alive as an attribute of its Python object (``_hf_buf``, with an ``_Allocation``).
:func:`host_storage` finds the CPU storage either way. A tensor's sizes, strides and offset are its own, so the CPU
tensor with the same metadata over the CPU storage (:func:`host_view`) is exactly the simulated tensor's contents.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey, DispatchKeySet

from hf_tpu.sim._counters import STATE

__all__ = ["host_storage", "host_view", "is_sim_tensor"]

# set_ on a device tensor, run by the CPU kernel (the boxed redispatch is the cheapest way in from Python)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed
_CPU = DispatchKeySet(DispatchKey.CPU)
_create = torch._C._acc.create_empty_tensor
_from_ptr = torch._C._construct_storage_from_data_pointer
_empty = torch.empty
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg
_DEVICE: torch.device | None = None  # torch.device("tpu", 0), set once the backend is renamed
HV_CACHE = 16  # host views cached per device storage, keyed by (offset, sizes, strides, dtype)


def _fmt(n: int) -> str:
    return f"{n / 1024**2:.2f} MiB" if n >= 1024**2 else f"{n} bytes"


class _Allocation:
    """Accounts one CPU storage as device memory for as long as a device storage refers to it."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        st = STATE
        live = st._live + nbytes
        st._live = live
        st._peak = max(st._peak, live)
        st._window = max(st._window, live)

    def __del__(self) -> None:
        STATE._live -= self.nbytes


def check_oom(nbytes: int, what: object) -> None:
    """Raise torch.OutOfMemoryError when ``nbytes`` more would not fit in the simulated HBM."""
    hbm = STATE.hbm_bytes
    if hbm and STATE.live_bytes + nbytes > hbm:
        live = STATE.live_bytes
        raise torch.OutOfMemoryError(
            f"TPU out of memory (simulated): {what} tried to allocate {_fmt(nbytes)}; tpu:0 has {_fmt(hbm)} of "
            f"HBM, {_fmt(live)} already allocated, {_fmt(max(hbm - live, 0))} free. Free tensors you no longer "
            "need, use a smaller batch or a lower-precision dtype (torch.bfloat16), shard the model across chips "
            "(tensor parallel), or enable the simulator with a larger hbm= (hf_tpu.sim.enable(hbm=...))."
        )


def new_device_storage(cpu_storage: torch.UntypedStorage, what: object = "an op") -> torch.UntypedStorage:
    """A device storage over ``cpu_storage``'s memory, counted as device memory (may raise OOM)."""
    nbytes = cpu_storage.nbytes()
    if STATE._hbm and STATE.live_bytes + nbytes > STATE._hbm:
        check_oom(nbytes, what)
    native = STATE.native
    if native is not None:
        return native.make_storage(cpu_storage)
    ws = _from_ptr(cpu_storage.data_ptr(), _DEVICE, nbytes)
    d = ws.__dict__
    d["_hf_buf"] = cpu_storage
    d["_hf_alloc"] = _Allocation(nbytes)
    return ws


def wrap(ws: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A new device tensor over device storage ``ws`` with ``like``'s dtype, sizes, strides and offset.

    ``like`` (a CPU tensor over ``ws``'s memory) is kept as a cached host view of ``ws`` (see ``_ops._host``).
    """
    dtype = like.dtype
    offset, size, stride = like.storage_offset(), like.size(), like.stride()
    w = _create((0,), dtype)
    _set_storage(_CPU, w, ws, offset, size, stride)
    if like.is_conj() or like.is_neg():
        _set_conj(w, like.is_conj())
        _set_neg(w, like.is_neg())
    else:
        hvs = ws.__dict__.get("_hf_hvs")
        if hvs is None:
            ws._hf_hvs = {(offset, size, stride, dtype): like}
        elif len(hvs) < HV_CACHE:
            hvs[(offset, size, stride, dtype)] = like
    return w


def rebind(w: torch.Tensor, ws: torch.UntypedStorage, like: torch.Tensor) -> None:
    """Point existing device tensor ``w`` at ``ws`` with ``like``'s metadata (in-place ops, ``out=``, resize)."""
    _set_storage(_CPU, w, ws, like.storage_offset(), like.size(), like.stride())


def to_device(cpu: torch.Tensor) -> torch.Tensor:
    """Move a CPU tensor's storage under a device tensor without copying (used for fresh op results)."""
    return wrap(new_device_storage(cpu.untyped_storage()), cpu)


def host_storage(ws: torch.UntypedStorage) -> torch.UntypedStorage | None:
    """The CPU storage under device storage ``ws`` (None for a storage the simulator did not make)."""
    native = STATE.native
    if native is not None:
        return native.host_storage(ws)
    return ws.__dict__.get("_hf_buf")


def is_sim_tensor(t: object) -> bool:
    """Whether ``t`` lives on the simulated ``tpu`` device.

    Args:
        t: any object; a non-tensor or a CPU tensor answers False.

    Returns:
        True for a tensor whose memory is the simulated device's.
    """
    if not isinstance(t, torch.Tensor) or t.is_cpu:
        return False
    try:
        return host_storage(t.untyped_storage()) is not None
    except NotImplementedError:  # sparse and other layouts have no storage
        return False


def host_view(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor sharing the simulated tensor's memory (no copy, not counted as a transfer).

    Writes to it are writes to the device tensor. It is for code that stands in for device-side work
    (the ``tpu_dist`` collectives stand-in, kernels run on the simulator); user code should use ``.cpu()``.

    Args:
        t: a tensor on the simulated ``tpu`` device.

    Returns:
        A CPU tensor with ``t``'s shape, strides, dtype and conjugate/negative bits, over the same memory.

    Raises:
        TypeError: ``t`` is a CPU tensor or lives on another device than the simulated one.

    Example:
        >>> import torch, hf_tpu.sim
        >>> x = torch.zeros(3, device="tpu")
        >>> hf_tpu.sim.host_view(x).fill_(1.0).device.type, x.cpu().tolist()
        ('cpu', [1.0, 1.0, 1.0])
    """
    if t.is_cpu:
        raise TypeError("host_view() expects a tensor on the simulated tpu device, got a CPU tensor")
    buf = host_storage(t.untyped_storage())
    if buf is None:
        raise TypeError(f"host_view() expects a tensor on the simulated tpu device, got one on {t.device}")
    hv = _empty((0,), dtype=t.dtype).set_(buf, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        _set_conj(hv, True)
    if t.is_neg():
        _set_neg(hv, True)
    return hv
