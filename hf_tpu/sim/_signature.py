"""The eager shape signature of an op on the simulated device: what torch_tpu would compile a program for.

torch_tpu compiles each eager op once per cache key; its C++ kernels build the key from the op's arguments
(``OpParamCacheKeys``/``EncodeParamCacheKey`` in the wheel's ``csrc/common``): tensors by shape and dtype, outputs by
shape and dtype ("Output shape is in GraphSignature"), ints, bools, floats, strings and dtypes by value, Scalars as
runtime values (``promoted_*``, ``PromoteScalar``), and device, layout, pin_memory and the like not at all
(``IgnoreInCacheKey(..., "Doesn't affect SHLO")``). :func:`kind` classifies a schema argument that way, the
fallback (``_ops``) appends each argument's part to a list, and :func:`count` counts the list once per process.
See "Shape signatures" in docs/simulator.md.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_tpu.sim._counters import STATE

__all__ = ["BAKE", "CONV", "SCALAR", "SCALARS", "SKIP", "count", "keyed", "kind"]

Tensor = torch.Tensor

# How each argument of an op enters its eager signature (see "Shape signatures" in docs/simulator.md):
CONV = 0  # tensors (and tensor lists): their shapes and dtypes; a device or storage is converted, not keyed
BAKE = 1  # ints, int lists, bools, floats, strings, dtypes: their values (baked into the compiled program)
SCALAR = 2  # Scalar: a runtime input (torch_tpu promotes it to a tensor): its type, and its value if 0, 1 or -1
SKIP = 3  # generator, layout, memory format, pin_memory, non_blocking: no part of the program
SCALARS = 4  # Scalar[]: each one's type
_SKIP_NAMES = frozenset({"pin_memory", "non_blocking", "memory_format", "generator", "layout", "device"})
_SPECIAL_SCALARS = (0, 1, -1)
# Ops whose float arguments torch_tpu also promotes to runtime values (its fused optimizer kernels list lr, betas,
# weight_decay, eps, momentum, ... as promoted_*): a learning-rate schedule does not recompile the step.
_PROMOTED_FLOAT_OPS = frozenset(
    f"aten::_fused_{name}{suffix}" for name in ("adam", "adamw", "sgd", "adagrad") for suffix in ("", "_")
)


def kind(op_name: str, name: str, t: str) -> int:
    """How argument ``name`` of type ``t`` (TorchScript's spelling) of op ``op_name`` enters the signature."""
    if any(k in t for k in ("Tensor", "Device", "Storage", "Any")):
        return CONV
    if name in _SKIP_NAMES or any(k in t for k in ("Generator", "Layout", "MemoryFormat")):
        return SKIP
    if t in ("number", "Optional[number]"):  # at::Scalar in TorchScript's spelling
        return SCALAR
    if t in ("float", "Optional[float]") and op_name in _PROMOTED_FLOAT_OPS:
        return SCALAR
    if t in ("List[number]", "Optional[List[number]]"):
        return SCALARS
    return BAKE


def keyed(a: Any, how: int, sig: list) -> None:
    """Add non-tensor argument ``a`` of kind (``how``) ``BAKE``, ``SCALAR`` or ``SCALARS`` to the signature ``sig``."""
    if how == BAKE:
        sig.append(tuple(a) if a.__class__ is list else a)
    elif how == SCALAR:
        sig.append((a.__class__, a) if a in _SPECIAL_SCALARS else a.__class__)
    elif how == SCALARS:
        sig.append(None if a is None else tuple(x.__class__ for x in a))


def count(sig: list, out: Any) -> None:
    """Count one eager op and, if its signature (``sig`` plus the output shapes) is new, one shape signature."""
    STATE.py_ops += 1
    if STATE._in_graph:
        return
    if isinstance(out, Tensor):
        sig.append(out.shape)
        sig.append(out.dtype)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, Tensor):
                sig.append(o.shape)
                sig.append(o.dtype)
    key = tuple(sig)
    seen = STATE.seen
    if key not in seen:
        seen.add(key)
        STATE.py_signatures += 1
