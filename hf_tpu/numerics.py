"""How far a ``tpu`` result may differ from the CPU's: tolerances from the float32 matmul precision in force.

On a TPU, torch_tpu runs float32 matmuls at a global precision (``torch.set_float32_matmul_precision``, replaced by
torch_tpu at device init): ``'medium'``, its default, is one bfloat16 pass; ``'high'`` about bf16x3; ``'highest'``
float32. So a float32 model on a chip drifts from the CPU by about 1e-3 of its output's scale at the default, and a
check that compares ``tpu`` with the CPU at CPU float32 tolerances fails there (``hf-tpu selftest`` did, on a v5e).
The simulated device computes at the same precisions (:mod:`hf_tpu.sim._precision`), so the drift shows in CI too.

Every comparison of a ``tpu`` result with the CPU's (the self-test, the chip tier, the suite) takes its tolerance
from :func:`float32_tolerance`, whose figures come from measurements on a chip (:data:`CHIP_MATMUL_ERROR`; method
and figures in docs/simulator.md), or sets ``'highest'`` where it needs exact float32 (greedy tokens against the
CPU's). The error is measured as ``max|actual - expected| / max|expected|``: a matmul's error scales with its
output's magnitude, not with each element's, so an elementwise relative tolerance fails on outputs near zero.

Example:
    >>> import torch
    >>> from hf_tpu.numerics import assert_close_to_cpu, float32_tolerance
    >>> float32_tolerance("highest") <= float32_tolerance("high") < float32_tolerance("medium")
    True
    >>> assert_close_to_cpu(torch.ones(3) * (1 + 1e-4), torch.ones(3), precision="medium")  # within 4e-3 of scale
    0.0001...
"""

from __future__ import annotations

from typing import Any

from hf_tpu.errors import HfTpuError, HfTpuValueError

__all__ = [
    "CHIP_MATMUL_ERROR",
    "PRECISIONS",
    "ToleranceError",
    "assert_close_to_cpu",
    "bfloat16_tolerance",
    "float32_tolerance",
    "greedy_tie",
    "matmul_precision",
    "max_error",
]

PRECISIONS = ("medium", "high", "highest")

# Float32 matmuls of standard normals (256 x K @ K x 256, K = 32 .. 4096) on a TPU v5e through torch_tpu 0.2.0,
# max|tpu - float64| / max|float64|, the largest over K at each precision (run 18, 2026-12-07, stage numerics of
# scripts/chip_torch_tpu.py: medium 2.45e-3 .. 2.61e-3, exactly one bfloat16 pass; high 1.2e-5 .. 1.9e-5; highest
# 9.4e-8 .. 5.6e-7; docs/chip_v5e_numerics.jsonl holds the records, docs/simulator.md the method and the rest).
CHIP_MATMUL_ERROR: dict[str, float] = {"medium": 2.61e-3, "high": 1.9e-5, "highest": 5.6e-7}

# What a check allows per float32 layer, relative to the output's scale: twice the chip's matmul error (the spread over
# inputs), and never below twice what the elementwise functions a layer holds cost on a chip at float32 (run 18:
# tanh 4.4e-5 and log 3.7e-5 of their scale, exp 4.7e-7, erf 4.0e-7, log_softmax 2.2e-6; the CPU's ~5e-8).
_ELEMENTWISE_FLOOR = 1e-4
_TOLERANCE: dict[str, float] = {p: max(2 * e, _ELEMENTWISE_FLOOR) for p, e in CHIP_MATMUL_ERROR.items()}


class ToleranceError(HfTpuError, AssertionError):
    """A ``tpu`` result is further from the CPU's than the precision in force allows."""


def matmul_precision() -> str:
    """The float32 matmul precision float32 work on ``tpu`` runs at now: ``'medium'``, ``'high'`` or ``'highest'``.

    On a TPU (torch_tpu) and on the simulated device ``torch.get_float32_matmul_precision`` answers the device's
    global precision, ``'medium'`` until set otherwise.
    """
    import torch

    value = torch.get_float32_matmul_precision()
    return value if value in PRECISIONS else "highest"


def float32_tolerance(precision: str | None = None, *, layers: int = 1) -> float:
    """The largest ``max|actual - expected| / max|expected|`` a float32 ``tpu`` result may have against the CPU's.

    Args:
        precision: ``'medium'``, ``'high'`` or ``'highest'``; default: the one in force (:func:`matmul_precision`).
        layers: how many matmul layers the result went through (errors add up, about linearly, through a stack).

    Raises:
        HfTpuValueError: an unknown precision or a layer count below 1.
    """
    precision = precision or matmul_precision()
    if precision not in _TOLERANCE:
        raise HfTpuValueError(f"unknown float32 matmul precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if layers < 1:
        raise HfTpuValueError(f"layers must be >= 1, got {layers}")
    return _TOLERANCE[precision] * layers


def bfloat16_tolerance(layers: int = 1) -> float:
    """The largest ``max|actual - expected| / max|expected|`` a bfloat16 ``tpu`` result may have against the CPU's
    bfloat16 result: one bfloat16 unit (2**-7 of the scale) per layer the result went through. A chip accumulates and
    fuses in another order than the CPU (run 18: a 2-layer Llama's bf16 logits 2.5e-2 off, 4 layers' worth).
    """
    if layers < 1:
        raise HfTpuValueError(f"layers must be >= 1, got {layers}")
    return 2.0**-7 * layers


def max_error(actual: Any, expected: Any) -> float:
    """``max|actual - expected| / max|expected|`` in float64 (``actual`` brought to the host first)."""
    import torch

    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    if a.shape != e.shape:
        raise ToleranceError(f"shapes differ: {tuple(a.shape)} on the device, {tuple(e.shape)} on the CPU")
    if e.numel() == 0:
        return 0.0
    scale = float(e.abs().max())
    diff = float((a - e).abs().max())
    if scale == 0.0:
        return diff
    return diff / scale


def assert_close_to_cpu(
    actual: Any, expected: Any, *, precision: str | None = None, layers: int = 1, what: str = "the result"
) -> float:
    """Check a float32 ``tpu`` result against the CPU's at the tolerance of ``precision``; return the error.

    Non-float tensors must be equal. NaN or inf on either side fails.

    Raises:
        ToleranceError: the error passes the tolerance (the message names both, and the precision).
    """
    import torch

    if not actual.is_floating_point():
        got = actual.detach().cpu()
        if got.shape != expected.shape or not torch.equal(got, expected.cpu()):
            raise ToleranceError(f"{what}: the device's integer values differ from the CPU's")
        return 0.0
    if not (torch.isfinite(actual.detach().cpu()).all() and torch.isfinite(expected.cpu()).all()):
        raise ToleranceError(f"{what}: a NaN or inf on the device or the CPU")
    precision = precision or matmul_precision()
    tol = float32_tolerance(precision, layers=layers)
    err = max_error(actual, expected)
    if err > tol:
        raise ToleranceError(
            f"{what}: max|tpu - cpu| / max|cpu| = {err:.3g}, over {tol:.3g} allowed at float32 matmul precision "
            f"{precision!r} ({layers} layer(s)); the chip's own matmul error at that precision is "
            f"{CHIP_MATMUL_ERROR[precision]:.3g}"
        )
    return err


def greedy_tie(logits: Any, chosen: int, expected: int, *, dtype: Any = None) -> tuple[bool, float, float]:
    """Whether the device's greedy token ``chosen`` and the CPU's ``expected`` tie within the arithmetic's precision.

    ``logits`` are the CPU's logits at the first step where the tokens differ (over the common prefix). The margin is
    ``logits[expected] - logits[chosen]``; it is a tie when the margin is at most two units in the last place of
    ``dtype`` (bfloat16 by default: where the device computes in bfloat16, its accumulation order differs from the
    CPU's) at the logits' scale. A larger margin is a wrong answer, never a tie.

    Returns:
        (tie, margin, allowed)
    """
    import torch

    dtype = dtype or torch.bfloat16
    row = logits.detach().float().cpu().reshape(-1)
    margin = float(row[expected] - row[chosen])
    allowed = 2 * torch.finfo(dtype).eps * float(row.abs().max())
    return margin <= allowed, margin, allowed
