"""Self-test checks: one per capability, run by ``hf-tpu selftest`` on a TPU VM (or on the simulated device).

A capability registers its check in a module named ``_selftest.py`` next to its code (``hf_tpu/_selftest.py``
for the runtime and the device, ``hf_tpu/<area>/_selftest.py`` for the others); :func:`discover` finds those
files without importing anything else, so adding a capability's check needs no change here.

A check takes a :class:`CheckContext`, compares what the ``tpu`` device computes with the same computation on
CPU, and returns the figures that matter on TPU (wall time of cold and warm calls, and on the simulator compiles,
host<->device copies and host syncs). It raises :class:`SkipCheck` when it cannot run on this host (e.g. tensor
parallel with one chip); any other exception fails it.

A check registered with ``exclusive=True`` starts processes of its own that need every chip of the host (the
tensor-parallel check launches one rank per chip). On a TPU VM the chips belong to the first process that runs a
device operation (torch_tpu initialises its device lazily, on first use, and keeps it until the process exits), so
exclusive checks run first, before any check touches the device in this process.

Example:
    >>> from hf_tpu.selftest import register_check
    >>> @register_check("example", description="2 + 2 on the device")   # doctest: +SKIP
    ... def _check(ctx):
    ...     x = ctx.to_device(torch.tensor(2.0))
    ...     ctx.assert_close(x + x, torch.tensor(4.0))
    ...     return {"answer": (x + x).item()}
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hf_tpu.errors import HfTpuError, HfTpuValueError, UnknownNameError

__all__ = [
    "CheckContext",
    "CheckFailed",
    "CheckResult",
    "SkipCheck",
    "checks",
    "discover",
    "register_check",
    "run_checks",
]

Status = Literal["passed", "failed", "skipped"]


class SkipCheck(HfTpuError):
    """Raised by a check that cannot run on this host; the message is the reason shown in the report."""


class CheckFailed(HfTpuError, AssertionError):
    """Raised by a check whose device result differs from what it expects (the CPU result, no new compile)."""


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[CheckContext], dict[str, Any] | None]
    description: str
    quick: bool  # part of `--quick`
    order: int  # lower runs first (runtime and device before the capabilities that need them)
    module: str
    exclusive: bool = False  # needs every chip free (starts its own processes): runs before the in-process checks


@dataclass
class CheckResult:
    name: str
    status: Status
    description: str = ""
    reason: str | None = None  # why it was skipped
    error: str | None = None  # what failed (the exception, and where)
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_REGISTRY: dict[str, Check] = {}


def register_check(
    name: str, *, description: str = "", quick: bool = True, order: int = 50, exclusive: bool = False
) -> Callable[[Callable], Callable]:
    """Register ``fn(ctx) -> figures`` as the self-test check ``name`` (one name, one check).

    ``exclusive=True``: the check starts processes that need every chip of the host; it runs before the checks
    that use the device in this process (see the module docstring).

    Example:
        >>> @register_check("device_map", description="device_map='auto' places a tiny model")  # doctest: +SKIP
        ... def _check(ctx): ...
    """

    def decorator(fn: Callable) -> Callable:
        existing = _REGISTRY.get(name)
        if existing is not None and (existing.module, existing.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise HfTpuValueError(
                f"self-test check {name!r} is registered twice: by {existing.module}.{existing.fn.__qualname__} "
                f"and by {fn.__module__}.{fn.__qualname__}; give one of them another name"
            )
        _REGISTRY[name] = Check(
            name, fn, description or (fn.__doc__ or "").strip().split("\n")[0], quick, order, fn.__module__, exclusive
        )
        return fn

    return decorator


def discover() -> list[str]:
    """Import every ``hf_tpu/**/_selftest.py`` module (which registers its checks); return their names."""
    import importlib

    root = Path(__file__).resolve().parent
    names = []
    for path in sorted(root.rglob("_selftest.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        name = ".".join(rel.parts)
        importlib.import_module(name)
        names.append(name)
    return names


def checks() -> dict[str, Check]:
    """The registered checks, in the order they run: exclusive checks first, then by ``order`` and name."""
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (not kv[1].exclusive, kv[1].order, kv[0])))


class CheckContext:
    """What a check gets: the runtime, the device, helpers to compare with CPU and to measure."""

    def __init__(self, quick: bool = False) -> None:
        from hf_tpu import runtime

        self.quick = quick
        self.info = runtime.detect()
        self.simulated = self.info.mode == "simulated"

    @property
    def device(self):
        import torch

        return torch.device("tpu", 0)

    def to_device(self, obj):
        """``obj.to("tpu")`` for a tensor or a module."""
        return obj.to(self.device)

    @staticmethod
    def assert_close(actual, expected, **kwargs) -> None:
        """``torch.testing.assert_close`` after bringing ``actual`` back to the host."""
        import torch

        actual = actual.cpu() if isinstance(actual, torch.Tensor) else actual
        torch.testing.assert_close(actual, expected, **kwargs)

    def compare(
        self, actual, expected, figures: dict[str, Any], *, layers: int = 1, what: str = "the result"
    ) -> float:
        """Check a float32 ``tpu`` result against the CPU's at the tolerance of the float32 matmul precision in force
        (:func:`hf_tpu.numerics.float32_tolerance`: measured on a chip; a TPU's default, ``'medium'``, is one
        bfloat16 pass); add ``precision``, ``tolerance`` and the largest ``max_err`` so far to ``figures``.

        Raises:
            CheckFailed: the error passes the tolerance (the message names both and the precision).
        """
        from hf_tpu import numerics

        precision = numerics.matmul_precision()
        try:
            err = numerics.assert_close_to_cpu(actual, expected, precision=precision, layers=layers, what=what)
        except numerics.ToleranceError as exc:
            raise CheckFailed(str(exc)) from None
        figures["precision"] = precision
        figures["tolerance"] = max(figures.get("tolerance", 0.0), numerics.float32_tolerance(precision, layers=layers))
        figures["max_err"] = max(figures.get("max_err", 0.0), float(f"{err:.3g}"))
        return err

    @staticmethod
    @contextlib.contextmanager
    def exact_float32() -> Iterator[None]:
        """Run the block at float32 matmul precision ``'highest'`` (a check that compares greedy tokens with the
        CPU's needs float32 products: at a TPU's default one bfloat16 pass, near-ties flip), then restore it."""
        import torch

        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)

    @contextlib.contextmanager
    def measure(self, figures: dict[str, Any], prefix: str) -> Iterator[None]:
        """Add ``<prefix>_s`` (wall time), ``<prefix>_tpu_cache_requests``/``_misses`` (torch_tpu's cache; a miss
        is a compile) and, on the simulator, ``<prefix>_compiles`` and the copy/sync counts.

        Read a result back to the host inside the block, so that the time includes the device's work.
        """
        from hf_tpu import _torch_tpu

        t0 = time.perf_counter()
        tpu_before = _torch_tpu.cache_stats()
        if self.simulated:
            from hf_tpu.sim import stats

            with stats() as s:
                yield
            for key in ("compiles", "h2d_copies", "d2h_copies", "host_syncs", "shape_signatures"):
                figures[f"{prefix}_{key}"] = getattr(s, key)
        else:
            yield
        figures[f"{prefix}_s"] = round(time.perf_counter() - t0, 6)
        if tpu_before is not None:  # torch_tpu's own cache (the simulator mirrors it): misses are compiles
            spent = _torch_tpu.cache_stats() - tpu_before
            figures[f"{prefix}_tpu_cache_requests"] = spent.requests
            figures[f"{prefix}_tpu_cache_misses"] = spent.misses


def _error_text(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def run_checks(
    only: list[str] | None = None,
    quick: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[CheckResult]:
    """Run the registered checks (``only`` those names, if given) and return one result per check.

    ``progress(name, index, total)`` is called before each check. When the runtime check fails (no TPU in this
    process), the checks after it are skipped with that reason.
    """
    discover()
    registered = checks()
    if only:
        unknown = [n for n in only if n not in registered]
        if unknown:
            raise UnknownNameError(f"unknown self-test check(s) {', '.join(unknown)}; known: {', '.join(registered)}")
    selected = [c for c in registered.values() if (not only or c.name in only) and (not quick or c.quick or only)]
    ctx = CheckContext(quick=quick)
    results: list[CheckResult] = []
    no_device: str | None = None
    for index, check in enumerate(selected):
        if progress:
            progress(check.name, index, len(selected))
        if no_device and check.name != "runtime":
            results.append(CheckResult(check.name, "skipped", check.description, reason=no_device))
            continue
        t0 = time.perf_counter()
        result = CheckResult(check.name, "passed", check.description)
        try:
            result.figures = dict(check.fn(ctx) or {})
        except SkipCheck as skip:
            result.status, result.reason = "skipped", str(skip) or "skipped"
        except Exception as err:  # noqa: BLE001 - a failing check is reported, never raised
            result.status, result.error = "failed", _error_text(err)
            if check.name == "runtime":
                no_device = "no tpu device in this process (see the runtime check)"
        result.seconds = round(time.perf_counter() - t0, 3)
        results.append(result)
    return results
