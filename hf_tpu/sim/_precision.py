"""float32 matmul precision on the simulated device: torch_tpu's API, and an opt-in emulation of its numerics.

torch_tpu 0.2.0 replaces ``torch.set_float32_matmul_precision``/``torch.get_float32_matmul_precision`` when it
initialises a device (``_loader._init_device_impl``): they set and read its own global StableHLO precision
(``precision_impl._set_global_precision``), ``'medium'`` = ``Precision.DEFAULT``, ``'high'`` = ``HIGH``,
``'highest'`` = ``HIGHEST``, anything else raises ValueError; torch's own CPU/CUDA setting is left untouched. The
initial global precision is ``DEFAULT`` (read from the wheel's compiled ``precision_impl`` on a host without
chips), so ``torch.get_float32_matmul_precision()`` answers ``'medium'`` on a TPU. ``torch.tpu.precision(mode)``
(experimental) overrides it locally, as a stack. The wheel documents (``_internal/precision/precision.py``) that
float32 matmuls run natively in bfloat16 on TPU and that the lowering of HIGH/HIGHEST is device-specific.

The simulator mirrors the API always, and by default (:func:`set_emulation`, ``hf_tpu.sim.enable(emulate_precision=
True)``) computes as a chip does: float32 matmuls, convolutions and attention on the device run at the precision
selected, as StableHLO's ``dot_general`` precision configs are commonly lowered on
TPU: ``DEFAULT`` one bfloat16 pass (inputs rounded to bfloat16, products accumulated in float32), ``HIGH`` three
bfloat16 passes (bf16x3: ``hi*hi + hi*lo + lo*hi``), ``HIGHEST`` float32. Which exact pass counts a given chip uses
is not stated in the wheel; the emulation shows the size of the drift, not the chip's bits.

``HF_TPU_SIM_MATMUL_PRECISION`` (``medium``, ``high`` or ``highest``; read once per process, here) sets the simulated
device's initial global precision instead of torch_tpu's ``'medium'``: a process started by a test or a script that
compares float32 results with the CPU's bit for bit (the test suite sets ``highest`` for its child processes) starts
there without code of its own. At ``'highest'`` the emulation costs nothing: the native core runs every contraction;
at ``'medium'`` it rounds the operands itself (mm, bmm, addmm and the other contractions it serves); ``'high'``'s
passes and convolutions run here.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_tpu import _env

__all__ = [
    "IMPLS",
    "Precision",
    "emulation_enabled",
    "get_float32_matmul_precision",
    "install",
    "matmul",
    "precision",
    "reduced",
    "set_emulation",
    "set_float32_matmul_precision",
]

aten = torch.ops.aten


class Precision(enum.Enum):
    """StableHLO precision configs, as ``torch.tpu.Precision`` names them."""

    DEFAULT = 0
    HIGH = 1
    HIGHEST = 2


_NAMES = {"medium": Precision.DEFAULT, "high": Precision.HIGH, "highest": Precision.HIGHEST}
_GLOBAL = [Precision.DEFAULT]
_STACK: list[Precision] = []
_EMULATE = [False]
_ENV = _env.SIM_MATMUL_PRECISION.name
_READ_ENV = [False]


def current() -> Precision:
    """The precision float32 matmuls run at now (the innermost ``torch.tpu.precision`` block, else the global)."""
    return _STACK[-1] if _STACK else _GLOBAL[0]


def set_float32_matmul_precision(precision: str) -> None:
    """torch_tpu's replacement of ``torch.set_float32_matmul_precision`` (same accepted values and error)."""
    if precision not in _NAMES:
        raise ValueError(f"expected to be one of 'highest', 'high', or 'medium', got '{precision}'")
    _GLOBAL[0] = _NAMES[precision]
    _sync_native()


def get_float32_matmul_precision() -> str:
    """torch_tpu's replacement of ``torch.get_float32_matmul_precision``: ``'medium'`` until set otherwise."""
    return {v: k for k, v in _NAMES.items()}[_GLOBAL[0]]


@contextlib.contextmanager
def precision(mode: Precision) -> Iterator[None]:
    """``torch.tpu.precision``: run the block's float32 matmuls at ``mode`` (a :class:`Precision`).

    Like torch_tpu's, it is not traceable: under torch.compile it breaks the graph.

    Example:
        >>> import torch, hf_tpu.sim
        >>> with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
        ...     y = torch.ones(2, 2, device="tpu") @ torch.ones(2, 2, device="tpu")
    """
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(
            msg=(
                "`precision` context manager is not yet traceable by TorchDynamo, so the surrounding frame will "
                "fall back to eager execution. We plan to make it traceable in future releases."
            )
        )
    if not isinstance(mode, Precision):
        raise ValueError(
            "expected to be one of 'PrecisionConfig.DEFAULT', 'PrecisionConfig.HIGH', or 'PrecisionConfig.HIGHEST', "
            f"got '{mode}'"
        )
    with _pushed(mode):
        yield


@contextlib.contextmanager
def _pushed(mode: Precision) -> Iterator[None]:
    _STACK.append(mode)
    _sync_native()
    try:
        yield
    finally:
        _STACK.pop()
        _sync_native()


@contextlib.contextmanager
def compiled_at(mode: Precision) -> Iterator[None]:
    """Run a compiled graph at ``mode``, the precision in force when it was compiled, whatever is in force now.

    A TPU does so (run 20 on a v5e, torch_tpu 0.2.0): torch_tpu compiles a program's float32 matmuls at the
    precision in force and the program keeps it, so a graph compiled at ``'medium'`` still computes one bfloat16
    pass after ``torch.set_float32_matmul_precision('highest')`` or inside ``torch.tpu.precision(HIGHEST)``; a graph
    first compiled at ``'highest'`` stays exact. (On the chip the program outlives even ``torch._dynamo.reset()``: a
    recompile of the same graph reuses it. The simulator keeps the precision per compiled graph only.)
    """
    if current() is mode:
        yield
        return
    with _pushed(mode):
        yield


def set_emulation(enabled: bool) -> None:
    """Run float32 matmuls, convolutions and attention on the simulated device at the selected TPU precision (or
    in float32, as the CPU does)."""
    _EMULATE[0] = bool(enabled)
    _sync_native()


def emulation_enabled() -> bool:
    """Whether :func:`set_emulation` is on."""
    return _EMULATE[0]


def reduced() -> bool:
    """Whether float32 contractions on the device run below float32 now (emulation on, precision not HIGHEST)."""
    return _EMULATE[0] and current() is not Precision.HIGHEST


def native_mode() -> int:
    """What the native core does with a float32 contraction now: 0 the CPU's float32 (emulation off, or
    ``'highest'``), 1 one bfloat16 pass itself (``'medium'``, as :func:`_passes`), 2 hand it to its Python kernel."""
    if not reduced():
        return 0
    return 1 if current() is Precision.DEFAULT else 2


def _sync_native() -> None:
    from hf_tpu.sim._counters import STATE

    if STATE.native is not None:
        STATE.native.set_emulate(native_mode())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _passes(a: torch.Tensor, b: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The bfloat16 operand pairs whose products sum to ``a @ b`` at the current precision (None: full float32)."""
    if not _EMULATE[0] or a.dtype != torch.float32 or b.dtype != torch.float32:
        return None
    mode = _STACK[-1] if _STACK else _GLOBAL[0]
    if mode is Precision.HIGHEST:
        return None
    a_hi, b_hi = _bf16(a), _bf16(b)
    if mode is Precision.DEFAULT:
        return [(a_hi, b_hi)]
    a_lo, b_lo = _bf16(a - a_hi), _bf16(b - b_hi)
    return [(a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` at the emulated precision (host tensors too: the simulator's fused attention uses it)."""
    pairs = _passes(a, b)
    if pairs is None:
        return torch.matmul(a, b)
    out = torch.matmul(*pairs[0])
    for x, y in pairs[1:]:
        out = out + torch.matmul(x, y)
    return out


def _bilinear(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op(a, b, *rest)``, bilinear in ``a`` and ``b``, at the emulated precision."""

    call = op._op  # the C++ callable: skips OpOverload.__call__'s Python frame on the common path

    def run(a: torch.Tensor, b: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        pairs = _passes(a, b)
        if pairs is None:
            return call(a, b, *rest, **kwargs)
        out = op(*pairs[0], *rest, **kwargs)
        for x, y in pairs[1:]:
            out = out + op(x, y, *rest, **kwargs)
        return out

    return run


def _accumulate(op: Callable[..., torch.Tensor], plain: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op(c, a, b, beta=, alpha=)`` = ``beta*c + alpha*plain(a, b)``, the product at the emulated precision."""

    call = op._op

    def run(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
        pairs = _passes(a, b)
        if pairs is None:
            return call(c, a, b, beta=beta, alpha=alpha)
        out = op(c, *pairs[0], beta=beta, alpha=alpha)
        for x, y in pairs[1:]:
            out = out + plain(x, y) * alpha
        return out

    return run


def _convolution(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *rest: Any) -> torch.Tensor:
    pairs = _passes(inp, weight)
    if pairs is None:
        return aten.convolution.default(inp, weight, bias, *rest)
    out = aten.convolution.default(*pairs[0], bias, *rest)
    for x, w in pairs[1:]:
        out = out + aten.convolution.default(x, w, None, *rest)
    return out


def _addbmm_plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return aten.bmm.default(a, b).sum(0)


# Implementations of the device's float32 contractions, keyed by overload (the ``out=`` variants keep the CPU's).
IMPLS: dict[str, Callable[..., Any]] = {
    "aten.mm.default": _bilinear(aten.mm.default),
    "aten.bmm.default": _bilinear(aten.bmm.default),
    "aten.mv.default": _bilinear(aten.mv.default),
    "aten.dot.default": _bilinear(aten.dot.default),
    "aten.addmm.default": _accumulate(aten.addmm.default, aten.mm.default),
    "aten.baddbmm.default": _accumulate(aten.baddbmm.default, aten.bmm.default),
    "aten.addmv.default": _accumulate(aten.addmv.default, aten.mv.default),
    "aten.addbmm.default": _accumulate(aten.addbmm.default, _addbmm_plain),
    "aten::convolution_overrideable": _convolution,
}


def _initial_from_environment() -> None:
    """The device's initial global precision: ``HF_TPU_SIM_MATMUL_PRECISION`` if set (read once per process), else
    torch_tpu's ``'medium'``."""
    if _READ_ENV[0]:
        return
    value = _env.SIM_MATMUL_PRECISION.get() if _env.SIM_MATMUL_PRECISION.is_set() else None  # (refused: raises)
    _READ_ENV[0] = True
    if value:
        _GLOBAL[0] = _NAMES[value]


def _keeping(upstream: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``upstream``'s name, signature and docstring."""

    def replacement(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return functools.update_wrapper(replacement, upstream)


def install() -> None:
    """Replace ``torch.set/get_float32_matmul_precision`` with torch_tpu's behaviour (reverted by hf_tpu.disable()).

    Raises:
        ValueError: ``HF_TPU_SIM_MATMUL_PRECISION`` holds something other than ``medium``, ``high``, ``highest``.
    """
    from hf_tpu._patch import original, patch

    _initial_from_environment()

    for name, fn in (
        ("set_float32_matmul_precision", set_float32_matmul_precision),
        ("get_float32_matmul_precision", get_float32_matmul_precision),
    ):
        # torch's name, signature and docstring kept (torch_tpu's replacements are plain functions of its own;
        # what a caller can inspect stays torch's: tests/test_patch_contract.py)
        patch(torch, name, _keeping(original(torch, name), fn), feature="sim", package="torch",
              versions=">=2.11,<=2.15")  # fmt: skip
