"""The aten fallback of the simulated device: every op on ``tpu`` tensors runs on their CPU memory.

``Library("_", "IMPL").fallback(_fallback, "PrivateUse1")`` routes every aten op that has no composite
kernel to :func:`_fallback`. It swaps each device tensor for its host view (same memory, CPU), runs the CPU
kernel, and wraps the results back: a result that shares memory with an input (a view, an in-place op,
``out=``) shares that input's device storage; a fresh result becomes a fresh device allocation. Transfers,
host syncs and new shape signatures are counted on the way.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from hf_tpu.sim import _tensors
from hf_tpu.sim._counters import STATE, SimStrictError
from hf_tpu.sim._tensors import host_view, new_device_storage, rebind, wrap

__all__ = ["GENERATOR", "install"]

Tensor = torch.Tensor
aten = torch.ops.aten
_empty = torch.empty
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg
_CPU_DEVICE = torch.device("cpu")

# The device's random generator (torch_tpu keeps its own; torch.manual_seed seeds it through torch.tpu).
GENERATOR = torch.Generator()

_LIB: torch.library.Library | None = None
_ATEN_LIB: torch.library.Library | None = None
# Ops whose composite kernel only raises for a new backend: registered for PrivateUse1 directly.
_DIRECT = ("convolution_overrideable", "convolution_backward_overrideable", "copy_")
_TLS = threading.local()

# Ops whose output shape depends on the data: a real TPU must bring a value back to the host to run them.
_DATA_DEPENDENT = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::repeat_interleave",
    "aten::bincount",
    "aten::_ctc_loss",
}
# Ops returning a Python value that is metadata, not device data.
_METADATA_RESULT = {"aten::is_set_to", "aten::is_same_size", "aten::_nnz", "aten::is_pinned", "aten::_version"}
# Ops whose native CPU kernel crashes or misbehaves when called on host views.
_REFUSED: dict[str, str] = {}


def _same_device_error(op: Any, found: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, tpu:0 and {found}! "
        f"(when running {op} on the simulated tpu device; move the tensor with .to('tpu') or .cpu())"
    )


def _layout_error(op: Any, t: Tensor) -> NotImplementedError:
    return NotImplementedError(
        f"{op}: {t.layout} tensors are not supported on the simulated tpu device (torch_tpu supports strided "
        "tensors only); use dense tensors, or run this op on the CPU."
    )


def _check_device(dev: torch.device, op: Any) -> None:
    if dev.index not in (None, 0):
        raise RuntimeError(
            f"{op}: device {dev} does not exist. The simulated TPU, like torch_tpu, gives each process one "
            "device, tpu:0; use one process per chip (hf-tpu launch) for more."
        )


class _OpInfo:
    __slots__ = ("allow_cpu", "gen_index", "gen_kw", "handler", "has_device", "impl", "mutable", "name", "sync")

    def __init__(self, op: Any) -> None:
        schema = op._schema
        self.name = schema.name
        self.mutable = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        self.gen_index = -1
        self.gen_kw = False
        self.has_device = False
        self.allow_cpu = False
        for i, a in enumerate(schema.arguments):
            t = str(a.type)
            if a.name == "generator" and "Generator" in t:
                self.gen_index, self.gen_kw = i, a.kwarg_only
            if "Device" in t:
                self.has_device = True
            if t == "List[Optional[Tensor]]":  # index tensors may live on the host, as with cuda
                self.allow_cpu = True
        self.handler = _HANDLERS.get(str(op)) or _HANDLERS.get(self.name)
        self.impl = _IMPLS.get(str(op)) or _IMPLS.get(self.name)
        self.sync = self.name in _DATA_DEPENDENT


_INFO: dict[Any, _OpInfo] = {}


def host_sync(what: str) -> None:
    """Count a host sync; inside strict(host_syncs=True) raise instead."""
    if STATE.strict_syncs:
        raise SimStrictError(
            f"host sync inside hf_tpu.sim.strict(): {what}. The host waits for the device here; keep the value "
            "on the device (avoid .item(), .tolist(), .cpu(), printing and data-dependent shapes in the loop)."
        )
    STATE.host_syncs += 1


class _Call:
    """Per-call state: host views made for device inputs and the device storages they came from."""

    __slots__ = ("cpu_device_out", "info", "op", "pairs", "sig", "smap")

    def __init__(self, op: Any, info: _OpInfo) -> None:
        self.op = op
        self.info = info
        self.smap: dict[int, torch.UntypedStorage] = {}
        self.pairs: list[tuple[Tensor, Tensor]] = []
        self.sig: list = [op]
        self.cpu_device_out = False

    def tensor(self, a: Tensor, allow_cpu: bool) -> Tensor:
        if a.is_cpu:
            if a.dim() != 0 and not allow_cpu:
                raise _same_device_error(self.op, "cpu")
            if a.dim() != 0:
                STATE.h2d_copies += 1
                STATE.h2d_bytes += a.numel() * a.element_size()
            self.sig.append((a.shape, a.dtype, "cpu"))
            return a
        try:
            buf = (ws := a.untyped_storage())._hf_buf
        except AttributeError:
            raise _same_device_error(self.op, str(a.device)) from None
        except NotImplementedError:
            raise _layout_error(self.op, a) from None
        hv = _empty((0,), dtype=a.dtype).set_(buf, a.storage_offset(), a.size(), a.stride())
        if a.is_conj():
            _set_conj(hv, True)
        if a.is_neg():
            _set_neg(hv, True)
        self.smap[buf._cdata] = ws
        self.pairs.append((hv, a))
        self.sig.append((a.shape, a.dtype))
        return hv

    def arg(self, a: Any, allow_cpu: bool = False) -> Any:
        if isinstance(a, Tensor):
            return self.tensor(a, allow_cpu)
        if isinstance(a, (list, tuple)):
            if a and any(isinstance(x, Tensor) for x in a):
                return type(a)(self.tensor(x, allow_cpu) if isinstance(x, Tensor) else x for x in a)
            return a
        if isinstance(a, torch.device):
            if a.type == "cpu":
                self.cpu_device_out = True
                return a
            _check_device(a, self.op)
            return _CPU_DEVICE
        if isinstance(a, torch.UntypedStorage) and a.device.type != "cpu":
            buf = a._hf_buf
            self.smap[buf._cdata] = a
            return buf
        return a

    def result(self, r: Any) -> Any:
        if isinstance(r, Tensor):
            for hv, w in self.pairs:
                if r is hv:
                    return w
            if self.cpu_device_out or not r.is_cpu:
                return r
            if r.layout != torch.strided:
                raise _layout_error(self.op, r)
            cs = r.untyped_storage()
            ws = self.smap.get(cs._cdata)
            if ws is None or ws.data_ptr() != cs.data_ptr() or ws.nbytes() != cs.nbytes():
                ws = new_device_storage(cs, str(self.op))
                self.smap[cs._cdata] = ws
            return wrap(ws, r)
        if isinstance(r, (tuple, list)):
            return type(r)(self.result(x) for x in r)
        return r

    def write_back(self) -> None:
        """After an op that mutates inputs: rebind device tensors whose host view changed shape or memory."""
        for hv, w in self.pairs:
            cs = hv.untyped_storage()
            ws = w.untyped_storage()
            if cs.data_ptr() != ws.data_ptr() or cs.nbytes() != ws.nbytes():
                new = self.smap.get(cs._cdata)
                if new is None or new.data_ptr() != cs.data_ptr() or new.nbytes() != cs.nbytes():
                    new = new_device_storage(cs, str(self.op))
                    self.smap[cs._cdata] = new
                rebind(w, new, hv)
            elif hv.storage_offset() != w.storage_offset() or hv.size() != w.size() or hv.stride() != w.stride():
                rebind(w, ws, hv)


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    info = _INFO.get(op)
    if info is None:
        info = _INFO[op] = _OpInfo(op)
    if info.handler is not None:
        return info.handler(op, info, args, kwargs)
    return _generic(op, info, args, kwargs)


def _generic(op: Any, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    call = _Call(op, info)
    allow = info.allow_cpu
    cargs = [call.arg(a, allow) for a in args]
    ckwargs = {k: call.arg(v, allow) for k, v in kwargs.items()} if kwargs else {}
    if info.gen_index >= 0:
        if info.gen_kw or len(cargs) <= info.gen_index:
            if ckwargs.get("generator") is None:
                ckwargs["generator"] = GENERATOR
        elif cargs[info.gen_index] is None:
            cargs[info.gen_index] = GENERATOR
    STATE.ops += 1
    if not STATE.in_graph:
        key = tuple(call.sig)
        seen = STATE.seen
        if key not in seen:
            seen.add(key)
            STATE.shape_signatures += 1
    if info.sync:
        host_sync(f"{info.name} has a data-dependent output shape")
    impl = info.impl or op
    try:
        out = impl(*cargs, **ckwargs)
    except NotImplementedError as e:
        raise NotImplementedError(f"{op} is not supported on the simulated tpu device: {e}") from None
    except RuntimeError as e:
        # A 0-dim "wrapped number" tensor argument reaches Python as a plain number; the overload packet then
        # picks the Scalar overload, which has the same type promotion as the wrapped number.
        if impl is not op or "Expected a value of type" not in str(e):
            raise
        out = op._overloadpacket(*cargs, **ckwargs)
    if info.mutable:
        call.write_back()
    res = call.result(out)
    if out is not None and not isinstance(out, (Tensor, tuple, list)) and info.name not in _METADATA_RESULT:
        host_sync(f"{info.name} returns a Python value computed on the device")
    return res


# ---- special cases -------------------------------------------------------------------------------------


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_(op: Any, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if dst.is_cpu:
        if src.is_cpu:
            return dst.copy_(src, non_blocking)
        shv = _host_view_or_error(src, op)
        host_sync(f"copy of a {tuple(src.shape)} {src.dtype} tensor to the host (.cpu(), .to('cpu'), print)")
        STATE.d2h_copies += 1
        STATE.d2h_bytes += _nbytes(src)
        dst.copy_(shv, non_blocking)
        return dst
    dhv = _host_view_or_error(dst, op)
    if src.is_cpu:
        STATE.h2d_copies += 1
        STATE.h2d_bytes += _nbytes(src)
        dhv.copy_(src, non_blocking)
        return dst
    shv = _host_view_or_error(src, op)
    STATE.ops += 1
    key = (op, dst.shape, dst.dtype, src.shape, src.dtype)
    if key not in STATE.seen:
        STATE.seen.add(key)
        STATE.shape_signatures += 1
    dhv.copy_(shv, non_blocking)
    return dst


def _host_view_or_error(t: Tensor, op: Any) -> Tensor:
    try:
        return host_view(t)
    except TypeError:
        raise _same_device_error(op, str(t.device)) from None


def _copy_from(op: Any, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    src, dst = args[0], args[1]
    if info.name == "aten::_copy_from_and_resize" and dst.shape != src.shape:
        dst.resize_(src.shape)
    return _copy_(op, info, (dst, src, args[2] if len(args) > 2 else False), {})


def _local_scalar_dense(op: Any, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    host_sync(f".item() on a {tuple(t.shape)} {t.dtype} tensor")
    STATE.d2h_copies += 1
    STATE.d2h_bytes += t.element_size()
    return host_view(t).item()


def _conv_impl(*a: Any) -> Any:
    return aten.convolution.default(*a)


def _conv_backward_impl(
    grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    bias_sizes = [weight.size(1) * groups] if transposed else [weight.size(0)]
    return aten.convolution_backward.default(
        grad_output,
        input,
        weight,
        bias_sizes if output_mask[2] else None,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        output_mask,
    )


def _native_dropout_impl(input: Tensor, p: float, train: bool | None) -> tuple[Tensor, Tensor]:
    if train is False or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    if p >= 1:
        return torch.zeros_like(input), torch.zeros_like(input, dtype=torch.bool)
    keep = 1.0 - p
    mask = _empty(input.shape, dtype=torch.bool).bernoulli_(keep, generator=GENERATOR)
    return input * mask * (1.0 / keep), mask


def _refuse(op: Any, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    raise NotImplementedError(
        f"{op} is not supported on the simulated tpu device ({_REFUSED.get(info.name, 'not implemented')}); "
        "move the tensor to the CPU for this op."
    )


_HANDLERS = {
    "aten::copy_": _copy_,
    "aten::_copy_from": _copy_from,
    "aten::_copy_from_and_resize": _copy_from,
    "aten::_local_scalar_dense": _local_scalar_dense,
}
_IMPLS = {
    "aten::convolution_overrideable": _conv_impl,
    "aten::convolution_backward_overrideable": _conv_backward_impl,
    "aten::native_dropout": _native_dropout_impl,
}


def _direct(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _fallback(op, *args, **kwargs)

    return kernel


def install() -> None:
    """Register the fallback for PrivateUse1 (once per process)."""
    global _LIB, _ATEN_LIB
    if _LIB is not None:
        return
    for name in _REFUSED:
        _HANDLERS[name] = _refuse
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback, "PrivateUse1")
    _LIB = lib
    aten_lib = torch.library.Library("aten", "IMPL")
    for name in _DIRECT:
        op = getattr(aten, name).default
        aten_lib.impl(name, _direct(op), "PrivateUse1")
    _ATEN_LIB = aten_lib
    _tensors._DEVICE = torch.device("tpu", 0)
