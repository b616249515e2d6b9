"""``torch.autocast("tpu")`` on the simulated device.

torch registers no autocast kernels for PrivateUse1, so without this every op inside ``torch.autocast("tpu")``
fails ("Could not run ... with arguments from the 'Autocasttpu' backend"). This module follows the CPU's autocast
policy: matmul-like ops run in the autocast dtype (bfloat16 by default, as on TPU), losses in float32, every
other op passes through unchanged. Kernels are registered per op (Python fallbacks cannot run while a dispatch
mode such as torch.compile's FakeTensorMode is active).
torch ships autocast kernels for CPU, CUDA, XPU, MPS, ... but none for PrivateUse1: an out-of-tree backend
registers its own (torch_tpu does, in C++). Without them the first op inside ``torch.autocast("tpu")`` fails with
"Could not run 'aten::copy_' ... from the 'Autocasttpu' backend". Here every aten op falls through the
``AutocastPrivateUse1`` key, and the ops of the policy below get a kernel that casts their floating inputs first.

The policy is CPU autocast's for the ops a model trains with (matmuls, convolutions and attention in the autocast
dtype; losses in float32; ``cat``/``stack`` to the widest input type), so that a bf16 autocast step on the
simulated device gives the same numbers as the same step under ``torch.autocast("cpu")``. The default autocast
dtype of ``tpu`` is bfloat16.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

__all__ = ["install"]

_LIB: torch.library.Library | None = None
_EXCLUDE = DispatchKeySet(DispatchKey.AutocastPrivateUse1)

# (op, overloads) run in the autocast dtype: the CPU's lower-precision list.
LOWER_PRECISION = (
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "_convolution", "prelu", "conv_tbc",
    "scaled_dot_product_attention",
)  # fmt: skip
# run in float32
FLOAT32 = (
    "nll_loss", "nll_loss2d", "cross_entropy_loss", "binary_cross_entropy_with_logits", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "cosine_embedding_loss", "margin_ranking_loss",
)  # fmt: skip


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


def install() -> None:
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    aten_lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for names, fixed in ((LOWER_PRECISION, None), (FLOAT32, torch.float32)):
            for name in names:
                packet = getattr(torch.ops.aten, name, None)
                if packet is None:
                    continue
                for overload in packet.overloads():
                    op = getattr(packet, overload)
                    with contextlib.suppress(RuntimeError):
                        aten_lib.impl(op, _kernel(op, fixed), "AutocastPrivateUse1")
    torch.set_autocast_dtype("tpu", torch.bfloat16)  # the TPU's native lower precision (torch defaults to fp16)
    _LIB = (lib, aten_lib)  # type: ignore[assignment]
import torch

__all__ = ["FP32", "LOWER_PRECISION", "PROMOTE", "install"]

# aten overloads run in the autocast dtype (bfloat16 by default).
LOWER_PRECISION = (
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "_addmm_activation", "matmul", "linear", "linalg_vecdot", "prelu",
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "_convolution",
    "_convolution.deprecated", "scaled_dot_product_attention",
)  # fmt: skip
# aten overloads run in float32.
FP32 = (
    "cross_entropy_loss", "nll_loss", "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits", "poisson_nll_loss",
    "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "multilabel_margin_loss",
)  # fmt: skip
# aten overloads run in the widest floating type among their inputs.
PROMOTE = ("cat", "stack", "index_copy")

_KEY = "AutocastPrivateUse1"
_LIBS: list[torch.library.Library] = []


def _eligible(t: object) -> bool:
    return (
        isinstance(t, torch.Tensor) and t.device.type == "tpu" and t.is_floating_point() and t.dtype != torch.float64
    )


def _cast(obj: object, dtype: torch.dtype) -> object:
    if _eligible(obj):
        return obj if obj.dtype == dtype else obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


def _widest(objs: object) -> torch.dtype | None:
    found: torch.dtype | None = None
    stack = [objs]
    while stack:
        o = stack.pop()
        if isinstance(o, (list, tuple)):
            stack.extend(o)
        elif _eligible(o):
            found = o.dtype if found is None else torch.promote_types(found, o.dtype)
    return found


def _kernel(op: torch._ops.OpOverload, policy: str):
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def run(*args, **kwargs):
        if policy == "lower":
            dtype = torch.get_autocast_dtype("tpu")
        elif policy == "fp32":
            dtype = torch.float32
        else:
            dtype = _widest((args, list(kwargs.values())))
        if dtype is not None:
            args = _cast(args, dtype)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return op(*args, **kwargs)

    return run


def _overload(name: str) -> tuple[str, torch._ops.OpOverload]:
    base, _, overload = name.partition(".")
    return name, getattr(getattr(torch.ops.aten, base), overload or "default")


def install() -> None:
    """Register the ``AutocastPrivateUse1`` fallthrough and the policy kernels (once per process)."""
    if _LIBS:
        return
    fallthrough = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a backend fallback, not an op library
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    kernels = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    for policy, names in (("lower", LOWER_PRECISION), ("fp32", FP32), ("promote", PROMOTE)):
        for name, op in map(_overload, names):
            kernels.impl(name, _kernel(op, policy), _KEY)
    _LIBS.extend([fallthrough, kernels])
    # TPUs compute in bfloat16; torch's default for PrivateUse1 is float16 (torch_tpu's device module says bf16 too).
    torch.set_autocast_dtype("tpu", torch.bfloat16)
