"""``torch.autocast("tpu")`` on the simulated device.

torch registers no autocast kernels for PrivateUse1, so without this every op inside ``torch.autocast("tpu")``
fails ("Could not run ... with arguments from the 'Autocasttpu' backend"). This module follows the CPU's autocast
policy: matmul-like ops run in the autocast dtype (bfloat16 by default, as on TPU), losses in float32, every
other op passes through unchanged. Kernels are registered per op (Python fallbacks cannot run while a dispatch
mode such as torch.compile's FakeTensorMode is active).
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
