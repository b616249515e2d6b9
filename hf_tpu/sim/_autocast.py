"""``torch.autocast("tpu")`` on the simulated device, with torch_tpu's own autocast policy.

torch registers no autocast kernels for PrivateUse1; torch_tpu registers its own (``csrc/eager/amp_policies.cc``):
a fallthrough for every op, and a cast policy for a list of ops, read from torch-tpu 0.2.0's glue library into
``_torch_tpu_ops.AUTOCAST`` by ``scripts/torch_tpu_op_table.py``: matmul-like ops, convolutions, RNN cells and
sdpa run in the autocast dtype (``lower_precision_fp``; bfloat16 by default, as on TPU), losses, FFTs, linear
algebra and a few pooling ops in float32 (``fp32``), ``prod`` with ``dtype=float32`` (``fp32_set_opt_dtype``); every
other op passes through unchanged. Kernels are registered per op overload (Python fallbacks cannot run while a
dispatch mode such as torch.compile's FakeTensorMode is active).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from hf_tpu.sim._torch_tpu_ops import AUTOCAST

__all__ = ["install"]

_LIB: torch.library.Library | None = None
_EXCLUDE = DispatchKeySet(DispatchKey.AutocastPrivateUse1)

# op overloads ("name" or "name.overload") run in the autocast dtype / in float32 / with dtype=float32
LOWER_PRECISION = AUTOCAST["lower_precision_fp"]
FLOAT32 = AUTOCAST["fp32"]
FLOAT32_SET_OPT_DTYPE = AUTOCAST.get("fp32_set_opt_dtype", ())


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype != torch.float64 and x.dtype != dtype and x.device.type == "tpu":
            return x.to(dtype)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _kernel(op: Any, fixed: torch.dtype | None) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = fixed or torch.get_autocast_dtype("tpu")
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            args = _cast(args, dtype)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


def _set_opt_dtype_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            eligible = (
                isinstance(first, torch.Tensor) and first.is_floating_point() and first.dtype != torch.float64
            )
            if eligible and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _overload(name: str) -> Any:
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


def install() -> None:
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    aten_lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for names, make in (
            (LOWER_PRECISION, lambda op: _kernel(op, None)),
            (FLOAT32, lambda op: _kernel(op, torch.float32)),
            (FLOAT32_SET_OPT_DTYPE, _set_opt_dtype_kernel),
        ):
            for name in names:
                op = _overload(name)
                if op is None:
                    continue
                with contextlib.suppress(RuntimeError):
                    aten_lib.impl(op, make(op), "AutocastPrivateUse1")
    torch.set_autocast_dtype("tpu", torch.bfloat16)  # the TPU's native lower precision (torch defaults to fp16)
    _LIB = (lib, aten_lib)  # type: ignore[assignment]
