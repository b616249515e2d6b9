"""``torch.autocast("tpu")`` on the simulated device.

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
