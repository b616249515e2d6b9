"""The meta kernels torch-tpu 0.2.0 re-registers for compile, mirrored for the simulated device.

torch_tpu's ``_internal/compile/grouped_mm_meta.py`` (registered when ``torch_tpu._internal.compile`` is imported,
which its autoload does) replaces ``aten::_grouped_mm``'s meta kernel for ``tpu`` tensors: upstream's demands
bfloat16 inputs, int32 offsets and 16-byte aligned strides (the CUDA kernel's rules), torch_tpu's accepts float32,
float16 and bfloat16, int32 or int64 offsets and any strides, as its eager kernel does. Tensors of other devices
keep upstream's meta. Without this mirror, transformers' default experts implementation (``grouped_mm``, which
transformers 5.24 picks for every dtype on a ``tpu`` weight) fails to trace in a compiled graph on the simulator
with "Expected inputs of BF16 type", while it traces on a TPU VM.

The simulator's eager ``_grouped_mm`` follows the same rules (:func:`grouped_mm_eager`): the CPU kernel behind it
has the CUDA kernel's alignment and int32 rules, torch_tpu's eager kernel does not.

The wheel's other compile-time registrations are not meta kernels of aten ops: graph-safe RNG for the tpu device
(mirrored by :mod:`hf_tpu.sim._rng`), ``flex_attention``'s device check and dense backward, and the
``scan``/``associative_scan`` higher-order ops.
``MIRRORED`` lists each mirrored kernel next to the wheel's function it follows; tests/contract/test_meta_kernels.py
holds each to the wheel's and checks which aten meta kernels the wheel changes: besides ``_grouped_mm``, only the
fused optimizers' C++ ones (``_fused_adamw_.tensor_lr``, ``_fused_sgd_``, ...), which accept anything and compute
nothing, and are not mirrored.

:func:`install` registers the mirrors when the simulator is enabled; ``hf_tpu.disable()`` removes them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MIRRORED", "grouped_mm_eager", "grouped_mm_meta", "install", "installed", "uninstall"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_META = torch._C.DispatchKey.Meta
_LIB: torch.library.Library | None = None  # registered once per process (see install)
_UPSTREAM: dict[Any, tuple[Any, Any]] = {}  # op -> (upstream's meta, the meta registered for it)
_ACTIVE = False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _require(cond: Any, msg: str) -> None:
    torch._check(cond, lambda: f"grouped_mm(): {msg}")


def _grouped_mm_out_size(
    self: torch.Tensor,
    mat2: torch.Tensor,
    offs: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[list[Any], torch.dtype]:
    """torch_tpu's checks of a ``_grouped_mm`` call, in its order and words; returns (output size, output dtype)."""
    torch._check_not_implemented(
        bias is None, lambda: "grouped_mm(): expected bias to be undefined, got defined tensor"
    )
    dtype = self.dtype
    _require(
        dtype == mat2.dtype,
        f"expected self and mat2 to have the same dtype, got {_name(dtype)} and {_name(mat2.dtype)}",
    )
    _require(dtype in _FLOATS, f"expected self to be float32, float16, or bfloat16, got {_name(dtype)}")
    out_dtype = out_dtype or dtype
    _require(out_dtype == dtype, f"expected out_dtype to match self dtype {_name(dtype)}, got {_name(out_dtype)}")
    if offs is not None:
        _require(offs.dim() == 1, f"expected offs to be 1D, got {offs.dim()}D")
        _require(
            offs.dtype in (torch.int32, torch.int64), f"expected offs to be int32 or int64, got {_name(offs.dtype)}"
        )
        _require(offs.stride(0) == 1, f"expected offs to have stride 1 along dim 0, got {offs.stride(0)}")
    _require(self.dim() in (2, 3), f"expected self to be 2D or 3D, got {self.dim()}D")
    _require(mat2.dim() in (2, 3), f"expected mat2 to be 2D or 3D, got {mat2.dim()}D")
    a_2d, b_2d = self.dim() == 2, mat2.dim() == 2
    if a_2d or b_2d:
        _require(offs is not None, "offsets must be provided when at least one of self or mat2 is a 2D tensor")
    else:
        _require(offs is None, "offsets must not be provided when both self and mat2 are 3D tensors")
    groups = offs.size(0) if offs is not None else 0
    if a_2d and b_2d:  # groups split the contraction: one (M, N) product per group
        size = [groups, self.size(0), mat2.size(1)]
    elif a_2d:  # groups split the rows of self (MoE: tokens sorted by expert)
        _require(
            groups == mat2.size(0),
            f"expected offs batch size to match mat2 batch size, got {groups} and {mat2.size(0)}",
        )
        size = [self.size(0), mat2.size(-1)]
    elif b_2d:  # groups split the columns of mat2
        _require(
            groups == self.size(0),
            f"expected offs batch size to match self batch size, got {groups} and {self.size(0)}",
        )
        size = [self.size(1), mat2.size(1)]
    else:
        _require(
            self.size(0) == mat2.size(0),
            f"expected self batch size to match mat2 batch size, got {self.size(0)} and {mat2.size(0)}",
        )
        size = [self.size(0), self.size(1), mat2.size(-1)]
    _require(
        self.size(-1) == mat2.size(-2),
        f"expected the contraction dimension of self and mat2 to match, got {self.size(-1)} and {mat2.size(-2)}",
    )
    return size, out_dtype


def grouped_mm_meta(
    self: torch.Tensor,
    mat2: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten::_grouped_mm``'s meta kernel for tpu tensors, as torch_tpu 0.2.0 registers it: a contiguous output."""
    size, dtype = _grouped_mm_out_size(self, mat2, offs, bias, out_dtype)
    return self.new_empty(size, dtype=dtype)


def grouped_mm_eager(
    self: torch.Tensor,
    mat2: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The simulator's eager ``_grouped_mm`` on host views: torch_tpu's rules, computed on the CPU.

    The CPU kernel runs what it accepts (so results equal a CPU run bit for bit); what it refuses once
    torch_tpu's checks passed (its CUDA-born rules: strides a multiple of 16 bytes) is computed one group at a time.
    """
    size, dtype = _grouped_mm_out_size(self, mat2, offs, bias, out_dtype)
    cpu_offs = offs.to(torch.int32) if offs is not None and offs.dtype == torch.int64 else offs
    try:
        return torch.ops.aten._grouped_mm.default(self, mat2, cpu_offs)
    except RuntimeError:
        pass
    out = self.new_zeros(size, dtype=dtype)
    if offs is None:
        return torch.bmm(self, mat2, out=out)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if self.dim() == 2 and mat2.dim() == 2:
            out[g] = self[:, start:end] @ mat2[start:end]
        elif self.dim() == 2:
            out[start:end] = self[start:end] @ mat2[g]
        else:
            out[:, start:end] = self[g] @ mat2[:, start:end]
        start = end
    return out


# aten op -> (the simulator's kernel, the wheel's module and function it mirrors)
MIRRORED: dict[str, tuple[Any, str, str]] = {
    "aten::_grouped_mm": (grouped_mm_meta, "torch_tpu._internal.compile.grouped_mm_meta", "_tpu_grouped_mm_meta"),
}


def _for_tpu(op: Any, tpu_kernel: Any, upstream: Any) -> Any:
    from torch._meta_registrations import device_hint

    def meta(*args: Any, **kwargs: Any) -> Any:
        # Fake tensors report their fake device here; tensors of other devices keep upstream's meta, and so does
        # every tensor once the simulator is disabled.
        if not _ACTIVE or device_hint(args[0]) != "tpu":
            return upstream(*args, **kwargs)
        return tpu_kernel(*args, **kwargs)

    meta.__name__ = f"hf_tpu_sim_{op.__name__}_meta"
    return meta


def _forget_cached_metas() -> None:
    """Fake tensors cache each op's output metadata in a class-wide table: drop it when the kernels change."""
    import sys

    fake_tensor = sys.modules.get("torch._subclasses.fake_tensor")
    if fake_tensor is not None:
        fake_tensor.FakeTensorMode.cache_clear()


def installed() -> bool:
    """True while the mirrored meta kernels are in force."""
    return _ACTIVE


def install() -> None:
    """Put the mirrored meta kernels in force for tpu tensors (idempotent; ``hf_tpu.disable()`` removes them).

    Upstream registers a meta kernel twice, as a dispatcher Meta kernel and as a Python-dispatcher kernel
    (``op.py_kernels``); both are replaced, as torch_tpu does. The dispatcher kernel is registered once per
    process and defers to upstream's while the mirror is off: in torch 2.13, removing a Python kernel that
    overrode another does not bring the first one back into the dispatch table.
    """
    global _LIB, _ACTIVE
    if _ACTIVE:
        return
    from hf_tpu import _patch

    register = _LIB is None
    lib = _LIB or torch.library.Library("aten", "IMPL", "Meta")
    for name, (kernel, _, _) in MIRRORED.items():
        op = getattr(torch.ops.aten, name.partition("::")[2]).default
        if register:
            upstream = op.py_kernels.get(_META)
            if upstream is None:
                raise RuntimeError(
                    f"torch {torch.__version__} has no Python meta kernel for {op} to keep for other devices; "
                    "hf_tpu's simulator was written for torch 2.11-2.15"
                )
            _UPSTREAM[op] = (upstream, _for_tpu(op, kernel, upstream))
            lib.impl(op, _UPSTREAM[op][1], allow_override=True)
        op.py_kernels[_META] = _UPSTREAM[op][1]
        op._dispatch_cache.clear()
    _LIB = lib
    _ACTIVE = True
    _forget_cached_metas()
    _patch.on_revert("sim", uninstall)


def uninstall() -> None:
    """Put upstream's meta kernels back in force for every device."""
    global _ACTIVE
    if not _ACTIVE:
        return
    for op, (upstream, _) in _UPSTREAM.items():
        op.py_kernels[_META] = upstream
        op._dispatch_cache.clear()
    _ACTIVE = False
    _forget_cached_metas()
