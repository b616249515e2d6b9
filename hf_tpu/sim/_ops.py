"""The aten fallback of the simulated device: every op on ``tpu`` tensors runs on their CPU memory.

``Library("_", "IMPL").fallback(_fallback, "PrivateUse1")`` routes every aten op that has no composite
kernel to :func:`_fallback`. It swaps each device tensor for its host view (same memory, CPU), runs the CPU
kernel, and wraps the results back: a result that shares memory with an input (a view, an in-place op,
``out=``) shares that input's device storage; a fresh result becomes a fresh device allocation. Transfers,
host syncs and new shape signatures are counted on the way.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from hf_tpu.sim import _meta_kernels, _precision, _refused, _tensors
from hf_tpu.sim._counters import STATE, SimStrictError
from hf_tpu.sim._rng import GENERATOR, in_force
from hf_tpu.sim._signature import BAKE, CONV, SKIP, count, keyed, kind
from hf_tpu.sim._tensors import HV_CACHE, host_view, new_device_storage, rebind, wrap

__all__ = ["GENERATOR", "install"]

Tensor = torch.Tensor
aten = torch.ops.aten
_empty = torch.empty
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg
_CPU_DEVICE = torch.device("cpu")
_STRIDED = torch.strided

_LIB: torch.library.Library | None = None
_ATEN_LIB: torch.library.Library | None = None
# View ops whose CPU kernel only makes an alias of the input's storage with new metadata, whatever the device:
# registered for PrivateUse1 as a redispatch to that kernel, with no host views (views cost no device work on
# torch_tpu either, so they add no op and no shape signature).
_METADATA_VIEWS = ("view", "as_strided", "_reshape_alias", "unfold", "view_as_real", "view_as_complex")
# In-place metadata ops with no CPU kernel (a composite one that only restrides the tensor): redispatched the same
# way, in both paths. torch's stft reference (its fake-tensor kernel) calls ``transpose_``, which reaches the device
# as ``as_strided_`` on a fake tensor while a tpu graph is traced; the generic path would look for its host data.
_INPLACE_METADATA = ("as_strided_",)
# Ops whose composite kernel only raises for a new backend, or that torch_tpu runs as one kernel where torch has a
# composite (``_grouped_mm``: torch's checks CUDA's rules, then loops over the groups reading the offsets on the
# host): registered for PrivateUse1 directly.
# (mv: its CompositeExplicitAutograd kernel would reach addmv.out, past the precision emulation of _precision.IMPLS)
_DIRECT = ("convolution_overrideable", "convolution_backward_overrideable", "copy_", "_grouped_mm", "mv")
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
    __slots__ = (
        "allow_cpu",
        "call",
        "gen_index",
        "gen_kw",
        "handler",
        "has_device",
        "impl",
        "kinds",
        "kw_kinds",
        "mutable",
        "name",
        "sync",
    )

    def __init__(self, op: Any) -> None:
        schema = op._schema
        self.name = schema.name
        self.mutable = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        self.gen_index = -1
        self.gen_kw = False
        self.has_device = False
        self.allow_cpu = False
        kinds, kw_kinds = [], {}
        for i, a in enumerate(schema.arguments):
            t = str(a.type)
            if a.kwarg_only:
                kw_kinds[a.name] = kind(self.name, a.name, t)
            else:
                kinds.append(kind(self.name, a.name, t))
            if a.name == "generator" and "Generator" in t:
                self.gen_index, self.gen_kw = i, a.kwarg_only
            if "Device" in t:
                self.has_device = True
            if t == "List[Optional[Tensor]]":  # index tensors may live on the host, as with cuda
                self.allow_cpu = True
        self.handler = _HANDLERS.get(str(op)) or _HANDLERS.get(self.name)
        self.impl = _IMPLS.get(str(op)) or _IMPLS.get(self.name)
        self.sync = self.name in _DATA_DEPENDENT
        self.kinds = tuple(kinds)
        self.kw_kinds = kw_kinds
        self.call = self.impl or op._op  # skip OpOverload.__call__'s Python frame


_INFO: dict[int, _OpInfo] = {}


def host_sync(what: str) -> None:
    """Count a host sync; inside strict(host_syncs=True) raise instead."""
    if STATE.strict_syncs:
        raise SimStrictError(
            f"host sync inside hf_tpu.sim.strict(): {what}. The host waits for the device here; keep the value "
            "on the device (avoid .item(), .tolist(), .cpu(), printing and data-dependent shapes in the loop)."
        )
    STATE.host_syncs += 1


def _host(a: Tensor, op: Any, smap: dict, pairs: list, sig: list, reuse: bool) -> Tensor:
    """The host view of device tensor ``a`` (recorded in ``smap``/``pairs``/``sig`` for this call).

    Host views are cached per device storage, keyed by (offset, sizes, strides, dtype), so that a weight or an
    activation read by several ops (or by each forward) is viewed once. Ops that write their inputs get fresh
    views, since they may change a view's metadata.
    """
    try:
        ws = a.untyped_storage()
    except NotImplementedError:
        raise _layout_error(op, a) from None
    d = ws.__dict__
    native = STATE.native
    buf = d.get("_hf_buf") if native is None else native.host_storage(ws)
    if buf is None:
        raise _same_device_error(op, str(a.device))
    size = a.size()
    dtype = a.dtype
    sig.append(size)
    sig.append(dtype)
    smap[buf._cdata] = ws
    if a.is_conj() or a.is_neg():
        hv = _empty((0,), dtype=dtype).set_(buf, a.storage_offset(), size, a.stride())
        _set_conj(hv, a.is_conj())
        _set_neg(hv, a.is_neg())
    elif reuse:
        key = (a.storage_offset(), size, a.stride(), dtype)
        hvs = d.get("_hf_hvs")
        if hvs is None:
            hvs = d["_hf_hvs"] = {}
        hv = hvs.get(key)
        if hv is None:
            hv = _empty((0,), dtype=dtype).set_(buf, key[0], size, key[2])
            if len(hvs) >= HV_CACHE:
                hvs.clear()
            hvs[key] = hv
    else:
        hv = _empty((0,), dtype=dtype).set_(buf, a.storage_offset(), size, a.stride())
    pairs.append((hv, a))
    return hv


def _cpu_tensor(a: Tensor, op: Any, allow_cpu: bool, sig: list) -> Tensor:
    if a.dim() != 0:
        if not allow_cpu:
            raise _same_device_error(op, "cpu")
        STATE.h2d_copies += 1
        STATE.h2d_bytes += a.numel() * a.element_size()
    sig.append(a.shape)
    sig.append(a.dtype)
    sig.append("cpu")
    return a


def _convert(a: Any, op: Any, info: _OpInfo, smap: dict, pairs: list, sig: list, flags: list) -> Any:
    """One tensor-like argument of an op: device tensors become host views, the tpu device becomes the CPU."""
    if isinstance(a, Tensor):
        if a.is_cpu:
            return _cpu_tensor(a, op, info.allow_cpu, sig)
        return _host(a, op, smap, pairs, sig, not info.mutable)
    if isinstance(a, (list, tuple)):
        if a and any(isinstance(x, Tensor) for x in a):
            reuse = not info.mutable
            return type(a)(
                (_cpu_tensor(x, op, info.allow_cpu, sig) if x.is_cpu else _host(x, op, smap, pairs, sig, reuse))
                if isinstance(x, Tensor)
                else x
                for x in a
            )
        sig.append(len(a))
        return a
    if isinstance(a, torch.device):
        if a.type == "cpu":
            flags[0] = True  # explicit CPU output: leave results on the host
            return a
        _check_device(a, op)
        return _CPU_DEVICE
    if isinstance(a, torch.UntypedStorage) and a.device.type != "cpu":
        buf = _tensors.host_storage(a)
        if buf is None:
            raise _same_device_error(op, str(a.device))
        smap[buf._cdata] = a
        return buf
    if isinstance(a, (int, float, complex)):  # a 0-dim "wrapped number" tensor reaches Python as a number
        flags[1] = True
        sig.append(a.__class__)  # a runtime value, like any scalar tensor
    else:
        sig.append(a)  # None
    return a


def _wrap_one(r: Tensor, op: Any, smap: dict, pairs: list) -> Tensor:
    for hv, w in pairs:
        if r is hv:
            return w
    if r.layout != _STRIDED:
        raise _layout_error(op, r)
    cs = r.untyped_storage()
    ws = smap.get(cs._cdata)
    if ws is None or ws.data_ptr() != cs.data_ptr() or ws.nbytes() != cs.nbytes():
        ws = new_device_storage(cs, op)
        smap[cs._cdata] = ws
    return wrap(ws, r)


def _wrap_result(r: Any, op: Any, smap: dict, pairs: list, cpu_out: bool) -> Any:
    if isinstance(r, Tensor):
        if cpu_out or not r.is_cpu:
            for hv, w in pairs:
                if r is hv:
                    return w
            return r
        return _wrap_one(r, op, smap, pairs)
    if isinstance(r, (tuple, list)):
        return type(r)(_wrap_result(x, op, smap, pairs, cpu_out) for x in r)
    return r


def _write_back(op: Any, smap: dict, pairs: list) -> None:
    """After an op that mutates inputs: rebind device tensors whose host view changed shape or memory."""
    for hv, w in pairs:
        cs = hv.untyped_storage()
        ws = w.untyped_storage()
        if cs.data_ptr() != ws.data_ptr() or cs.nbytes() != ws.nbytes():
            new = smap.get(cs._cdata)
            if new is None or new.data_ptr() != cs.data_ptr() or new.nbytes() != cs.nbytes():
                new = new_device_storage(cs, op)
                smap[cs._cdata] = new
            rebind(w, new, hv)
        elif hv.storage_offset() != w.storage_offset() or hv.size() != w.size() or hv.stride() != w.stride():
            rebind(w, ws, hv)


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    info = _INFO.get(id(op))  # OpOverloads live for the whole process; hashing them is slow
    if info is None:
        info = _INFO[id(op)] = _OpInfo(op)
    if info.handler is not None:
        return info.handler(op, info, args, kwargs)
    return _generic(op, info, args, kwargs)


def _generic(op: Any, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    smap: dict = {}
    pairs: list = []
    sig: list = [info]
    flags = [False, False]  # [explicit CPU output, a Python number stands for a tensor argument]
    cargs = list(args)
    kinds = info.kinds
    reuse = not info.mutable
    for i, a in enumerate(args):
        how = kinds[i]
        if how == CONV:
            if isinstance(a, Tensor) and not a.is_cpu:  # the common case, inlined
                cargs[i] = _host(a, op, smap, pairs, sig, reuse)
            else:
                cargs[i] = _convert(a, op, info, smap, pairs, sig, flags)
        elif how == BAKE:
            sig.append(tuple(a) if a.__class__ is list else a)
        elif how != SKIP:
            keyed(a, how, sig)
    if kwargs:
        kw_kinds = info.kw_kinds
        ckwargs = {}
        for k, v in kwargs.items():
            how = kw_kinds.get(k, BAKE)
            if how == CONV:
                v = _convert(v, op, info, smap, pairs, sig, flags)
            elif how != SKIP:
                sig.append(k)
                keyed(v, how, sig)
            ckwargs[k] = v
    else:
        ckwargs = {}
    if info.gen_index >= 0:  # the device generator's state in force (see _rng: graph-safe RNG can swap it)
        if info.gen_kw or len(cargs) <= info.gen_index:
            ckwargs["generator"] = in_force(ckwargs.get("generator") or GENERATOR)
        else:
            cargs[info.gen_index] = in_force(cargs[info.gen_index] or GENERATOR)
    if info.sync:
        host_sync(f"{info.name} has a data-dependent output shape")
    try:
        if flags[1] and info.impl is None:
            # A wrapped number passed as a plain number: the overload packet picks the Scalar overload, which
            # has the same type promotion as the wrapped number.
            out = op._overloadpacket(*cargs, **ckwargs)
        else:
            out = info.call(*cargs, **ckwargs)
    except NotImplementedError as e:
        raise NotImplementedError(f"{op} is not supported on the simulated tpu device: {e}") from None
    except RuntimeError as e:
        if info.impl is not None or "Expected a value of type" not in str(e):
            raise
        out = op._overloadpacket(*cargs, **ckwargs)
    if info.mutable:
        _write_back(op, smap, pairs)
    count(sig, out)
    if out.__class__ is Tensor and not flags[0]:  # the common case: one fresh or aliased tensor
        if out.is_cpu:
            return _wrap_one(out, op, smap, pairs)
        return out
    res = _wrap_result(out, op, smap, pairs, flags[0])
    if out is not None and not isinstance(out, (tuple, list, Tensor)) and info.name not in _METADATA_RESULT:
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
    count([info, src.shape, src.dtype], dst)  # non_blocking is no part of the program (nor of torch_tpu's key)
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


def _convolution_impl(*args: Any) -> Tensor:
    """The CPU picks a channels-last output for a channels-last input; a compiled graph's fake tensors predict a
    contiguous one for a ``tpu`` convolution (and on a chip the layout is the compiler's), so a ``view`` traced after
    it would fail on the simulator alone. Contiguous, as predicted (this also keeps the op off the native core)."""
    return _precision.IMPLS["aten::convolution_overrideable"](*args).contiguous()


def _native_dropout_impl(input: Tensor, p: float, train: bool | None) -> tuple[Tensor, Tensor]:
    if train is False or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    if p >= 1:
        return torch.zeros_like(input), torch.zeros_like(input, dtype=torch.bool)
    keep = 1.0 - p
    mask = _empty(input.shape, dtype=torch.bool).bernoulli_(keep, generator=in_force(GENERATOR))
    return input * mask * (1.0 / keep), mask


def _histc_impl(input: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:
    # Accelerators count integer inputs too (transformers' grouped_mm experts path calls histc on expert ids for
    # any non-CPU device); the CPU kernel takes floating inputs only, so count in float64 and return the int dtype.
    if input.is_floating_point():
        return aten.histc.default(input, bins, min, max)
    return aten.histc.default(input.double(), bins, min, max).to(input.dtype)


def _group_norm_impl(input: Tensor, *args: Any) -> Any:
    # torch_tpu 0.2.0 has no forward kernel: a tpu tensor gets torch's math_group_norm, whose first step is
    # ``input.view(1, N * groups, -1)``, and torch_tpu's lowering of a compiled graph runs it on tensors with torch's
    # strides. Inside a graph, an input that view refuses (channels-last, as diffusers' attention residual leaves it)
    # is refused with torch_tpu's words (hf_tpu._group_norm makes such inputs contiguous in compiled graphs). Eager,
    # the CPU kernel gets a contiguous copy of a strided input (an SD3 VAE decoded eagerly on a v5e).
    if not input.is_contiguous():
        if STATE._in_graph:
            _math_group_norm_view(input, args[2], args[5])
        input = input.contiguous()
    return aten.native_group_norm.default(input, *args)


def _math_group_norm_view(input: Tensor, n: int, groups: int) -> None:
    """Raise torch_tpu's RuntimeError where math_group_norm's ``view(1, N * groups, -1)`` of ``input`` fails."""
    shape = [1, n * groups, input.numel() // (n * groups) if n else 1]
    try:
        torch.empty_strided(input.shape, input.stride(), dtype=input.dtype, device="meta").view(shape)
    except RuntimeError:
        raise RuntimeError(
            f"view(): cannot create a view of shape {shape} from the input tensor of shape {list(input.shape)} and "
            f"strides {list(input.stride())}; consider creating a new tensor using reshape() instead of taking a view"
        ) from None


def _group_norm_backward_impl(grad_out: Tensor, input: Tensor, *args: Any) -> Any:
    if not input.is_contiguous() or not grad_out.is_contiguous():
        grad_out, input = grad_out.contiguous(), input.contiguous()
    return aten.native_group_norm_backward.default(grad_out, input, *args)


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
    **_precision.IMPLS,  # float32 contractions (convolution_overrideable included), TPU precision when emulated
    "aten::convolution_overrideable": _convolution_impl,
    "aten::convolution_backward_overrideable": _conv_backward_impl,
    "aten::native_dropout": _native_dropout_impl,
    "aten::histc": _histc_impl,
    "aten::_grouped_mm": _meta_kernels.grouped_mm_eager,  # torch_tpu's rules (no 16-byte strides, int64 offsets)
    "aten.native_group_norm.default": _group_norm_impl,
    "aten.native_group_norm_backward.default": _group_norm_backward_impl,
}


def _direct_ops() -> list[str]:
    """Aten ops to register for PrivateUse1 one by one (the catch-all fallback still serves other namespaces).

    - Ops that would otherwise reach the catch-all fallback: a Python *fallback* cannot run while a
      TorchDispatchMode is active (FakeTensorMode during torch.compile tracing trips an internal assert in
      torch 2.13's python_op_registration_trampoline_impl), a per-op registration can.
    - Structured ops, which reach a new backend as ``empty`` + ``op.out`` (CompositeExplicitAutogradNonFunctional):
      two trips through Python instead of one; and composites that round differently from the CPU kernel
      (native_layer_norm): registered so that the CPU kernel runs them directly.
    """
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = [f"aten::{n}" for n in _DIRECT]
    for n in torch._C._dispatch_get_all_op_names():
        if not n.startswith("aten::") or has(n, "PrivateUse1") or has(n, "CompositeImplicitAutograd"):
            continue
        if n.partition("::")[2].partition(".")[0] in (*_METADATA_VIEWS, *_INPLACE_METADATA):
            continue
        explicit = has(n, "CompositeExplicitAutograd")
        if has(n, "CompositeExplicitAutogradNonFunctional") or not explicit or has(n, "CPU"):
            names.append(n)
    return names


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _cpu_view(op: Any) -> Any:
    redispatch = op._handle.redispatch_boxed

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return redispatch(_CPU_KEYS, *args, **kwargs)

    return kernel


def _direct(op: Any) -> Any:
    info: _OpInfo | None = None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        nonlocal info
        if info is None:  # built on first use: most ops are never called
            info = _INFO.get(id(op)) or _INFO.setdefault(id(op), _OpInfo(op))
        if info.handler is not None:
            return info.handler(op, info, args, kwargs)
        return _generic(op, info, args, kwargs)

    return kernel


def _native_kinds(op: Any, info: _OpInfo) -> list[int] | None:
    """Each schema argument's signature kind, for an op the native core can run whole (None: it cannot).

    It runs ops that read or write device tensors (or make new ones on ``tpu:0``) and return tensors or nothing;
    ops that take a generator or host index tensors, sync with the host, or have a special case here stay in
    Python, as does any call with a CPU tensor or another device (the native core hands it over).
    """
    if info.handler is not None or info.sync or info.gen_index >= 0:
        return None
    if info.allow_cpu or (info.impl is not None and info.impl is not _precision.IMPLS.get(str(op))):
        return None
    schema = op._schema
    if any(str(r.type) != "Tensor" for r in schema.returns) or not (schema.returns or info.mutable):
        return None
    return [kind(info.name, a.name, str(a.type)) for a in schema.arguments]


def _register_native(native: Any, aten_lib: torch.library.Library, ops: list[Any]) -> None:
    for op in ops:
        info = _INFO.get(id(op)) or _INFO.setdefault(id(op), _OpInfo(op))
        kinds = _native_kinds(op, info)
        if kinds is None:
            aten_lib.impl(op, _direct(op), "PrivateUse1")
        else:
            name = op._schema.name.partition("::")[2]
            overload = op._schema.overload_name
            qualified = f"{name}.{overload}" if overload else name
            native.register_op(qualified, str(op), kinds, info.impl is not None, info.mutable, _direct(op))


def install() -> None:
    """Register the fallback for PrivateUse1 (once per process), with the native core where it builds."""
    global _LIB, _ATEN_LIB
    if _LIB is not None:
        return
    from hf_tpu.sim import _native

    native = _native.load()
    for name in _REFUSED:
        _HANDLERS[name] = _refuse
    # Ops torch_tpu sends to its missing-op fallback: a Python kernel that raises its error (or, with the CPU
    # fallback on, runs them on the host); having a handler keeps them off the native core's fast path.
    for overload, refused_as in _refused.qualified_names().items():
        _HANDLERS[overload] = _refused.handler(refused_as, _generic)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback, "PrivateUse1")
    _LIB = lib
    aten_lib = torch.library.Library("aten", "IMPL")
    ops = []
    for qualified in _direct_ops():
        name, _, overload = qualified.partition("::")[2].partition(".")
        ops.append(getattr(getattr(aten, name), overload or "default"))
    _tensors._DEVICE = torch.device("tpu", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" for the composite ones
        if native is None:
            for op in ops:
                aten_lib.impl(op, _direct(op), "PrivateUse1")
        else:
            native.set_check_oom(_tensors.check_oom)
            native.set_hbm(STATE._hbm)
            native.set_in_graph(STATE._in_graph)
            native.set_emulate(_precision.native_mode())
            STATE.native = native
            _register_native(native, aten_lib, ops)
        for name in _METADATA_VIEWS:
            for overload in getattr(aten, name).overloads():
                op = getattr(getattr(aten, name), overload)
                if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"):
                    continue
                if native is None:
                    aten_lib.impl(op, _cpu_view(op), "PrivateUse1")
                else:
                    native.register_view(name if overload == "default" else f"{name}.{overload}")
        for name in _INPLACE_METADATA:
            for overload in getattr(aten, name).overloads():
                op = getattr(getattr(aten, name), overload)
                aten_lib.impl(op, _cpu_view(op), "PrivateUse1")
    _ATEN_LIB = aten_lib
