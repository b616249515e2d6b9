"""Counters of the simulated device: transfers, host syncs, compiles, eager shape signatures, memory.

The device code bumps plain integers on one module-level object (the hot path must stay cheap); a
:func:`stats` block snapshots them on entry and reports the difference, so blocks nest freely.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import HfTpuError

__all__ = ["SimStrictError", "Stats", "stats", "strict"]

_FIELDS = ("compiles", "h2d_copies", "d2h_copies", "h2d_bytes", "d2h_bytes", "host_syncs", "shape_signatures", "ops")
_FIELDS += ("compile_cache_hits", "cpu_fallbacks")


class SimStrictError(HfTpuError, RuntimeError):
    """A host sync or a compile happened inside :func:`strict`."""


class _Shared:
    """A :class:`_State` field that the native core (``_native.py``) keeps or shares once it is loaded.

    ``how`` is ``"native"``: the core's value (read by ``get``, written by ``put``), the slot's before it loads;
    ``"sum"``: the slot (what Python counted) plus the core's count; ``"push"``: the slot, copied to the core
    (``put``) on every write.
    """

    def __init__(self, how: str, slot: str, get: str = "", put: str = "") -> None:
        self.how, self.slot, self.get, self.put = how, slot, get, put

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        n = obj.native
        if n is None or self.how == "push":
            return getattr(obj, self.slot)
        value = getattr(n, self.get)()
        return getattr(obj, self.slot) + value if self.how == "sum" else value

    def __set__(self, obj: Any, value: int) -> None:
        n = obj.native
        if n is not None and self.how == "sum":
            value -= getattr(n, self.get)()
        if n is not None and self.how == "native" and self.put:
            getattr(n, self.put)(value)
        else:
            setattr(obj, self.slot, value)
        if n is not None and self.how == "push":
            getattr(n, self.put)(value)


class _State:
    """Process-wide counters (monotonic) and memory accounting.

    With the native core loaded (``_native.py``), device memory, and the ops and shape signatures of the ops it
    runs, are counted in C++: the shared fields below (:class:`_Shared`) read and write both sides.
    """

    __slots__ = (
        *(n for n in _FIELDS if n not in ("ops", "shape_signatures")),
        "py_ops",
        "py_signatures",
        "_live",
        "_peak",
        "_window",
        "_in_graph",
        "_hbm",
        "native",
        "seen",
        "strict_syncs",
        "strict_compiles",
        "last_compile",
        "cpu_fallback",
        "graph_ops",
    )

    def __init__(self) -> None:
        self.native: Any = None  # the native core's module, once loaded
        for name in _FIELDS:
            setattr(self, name, 0)
        self.py_ops = 0  # ops the Python fallback ran (``ops`` adds the native core's)
        self.py_signatures = 0
        self._live = 0
        self._peak = 0  # since start or reset_peak()
        self._window = 0  # peak since the innermost open stats() block began
        self._in_graph = 0  # >0 while a compiled graph runs
        self._hbm = 0
        self.seen: set = set()  # eager op signatures seen by the Python fallback (see _signature.py)
        self.strict_syncs = 0  # depth of strict(host_syncs=True) blocks
        self.strict_compiles = 0
        self.last_compile = ""
        self.cpu_fallback = False  # torch_tpu's enable_cpu_fallback, mirrored (hf_tpu.sim.execution_mode)
        self.graph_ops = 0  # ops run inside compiled graphs (``ops`` counts them too): see graph_run()

    ops = _Shared("sum", "py_ops", get="ops")  # ops the Python fallback ran, plus the native core's
    shape_signatures = _Shared("sum", "py_signatures", get="signatures")
    live_bytes = _Shared("native", "_live", get="live")  # written by the Python path's allocations only
    peak_bytes = _Shared("native", "_peak", get="peak", put="set_peak")
    window_peak = _Shared("native", "_window", get="window", put="set_window")
    in_graph = _Shared("push", "_in_graph", put="set_in_graph")
    hbm_bytes = _Shared("push", "_hbm", put="set_hbm")


STATE = _State()
_LOCK = threading.Lock()


@contextlib.contextmanager
def graph_run() -> Iterator[None]:
    """Run a compiled graph: its ops count no eager shape signature, and add to ``STATE.graph_ops`` (so that the
    eager ops, what torch_tpu looks up in its compilation cache one by one, are ``ops - graph_ops``)."""
    outer = not STATE._in_graph
    start = STATE.ops if outer else 0
    STATE.in_graph += 1
    try:
        yield
    finally:
        STATE.in_graph -= 1
        if outer:
            STATE.graph_ops += STATE.ops - start


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class Stats:
    """What happened on the simulated device inside one ``with hf_tpu.sim.stats() as s:`` block.

    Fields read live while the block is open and freeze when it closes.

    Attributes:
        compiles: graphs compiled by the ``"tpu"`` torch.compile backend (each recompile counts).
        compile_cache_hits: graphs loaded from hf_tpu's persistent compile cache instead (not compiled).
        h2d_copies, h2d_bytes: host→device transfers and their bytes.
        d2h_copies, d2h_bytes: device→host transfers and their bytes.
        host_syncs: points where the host waited for a device value (``.item()``, ``.tolist()``, printing,
            ``.cpu()``, data-dependent shapes such as ``nonzero``).
        shape_signatures: eager op signatures (the op, its tensors' and outputs' shapes and dtypes, and the
            non-tensor arguments torch_tpu compiles in) this process had never run before; torch_tpu
            compiles each of them once, so this is the eager-mode compile count.
        ops: device ops executed eagerly.
        cpu_fallbacks: ops torch_tpu does not implement that ran on the host because the CPU fallback is on
            (``hf_tpu.sim.execution_mode.enable_cpu_fallback``, mirroring torch_tpu's); off, they raise instead.
        live_bytes: device memory in use at the end.
        peak_bytes: the most device memory in use during the block.
    """

    compiles: int = 0
    compile_cache_hits: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    host_syncs: int = 0
    shape_signatures: int = 0
    ops: int = 0
    cpu_fallbacks: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    _start: dict = field(default_factory=dict, repr=False)
    _open: bool = field(default=False, repr=False)
    _saved_window: int = field(default=0, repr=False)

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS and object.__getattribute__(self, "_open"):
            return getattr(STATE, name) - object.__getattribute__(self, "_start")[name]
        if name == "live_bytes" and object.__getattribute__(self, "_open"):
            return STATE.live_bytes
        if name == "peak_bytes" and object.__getattribute__(self, "_open"):
            return STATE.window_peak
        return object.__getattribute__(self, name)

    def _enter(self) -> None:
        self._start = {name: getattr(STATE, name) for name in _FIELDS}
        self._saved_window = STATE.window_peak
        STATE.window_peak = STATE.live_bytes
        self._open = True

    def _exit(self) -> None:
        values = {name: getattr(self, name) for name in (*_FIELDS, "live_bytes", "peak_bytes")}
        object.__setattr__(self, "_open", False)
        for name, value in values.items():
            setattr(self, name, value)
        STATE.window_peak = max(self._saved_window, STATE.window_peak)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON, benchmarks and assertions).

        Returns:
            Each counter's name (``"compiles"``, ``"h2d_copies"``, ..., ``"live_bytes"``, ``"peak_bytes"``) mapped
            to its value at the time of the call.
        """
        return {name: getattr(self, name) for name in (*_FIELDS, "live_bytes", "peak_bytes")}

    def report(self) -> str:
        """A short human-readable summary (also what ``str(stats)`` prints).

        Returns:
            A few lines of text, one per counter, with byte counts in readable units.
        """
        d = self.as_dict()
        lines = [
            "simulated tpu counters",
            f"  compiles (torch.compile, backend='tpu'): {d['compiles']}",
            f"  graphs loaded from the compile cache:    {d['compile_cache_hits']}",
            f"  new eager shape signatures:              {d['shape_signatures']}",
            f"  device ops executed:                     {d['ops']}",
            f"  host->device copies:                     {d['h2d_copies']} ({_fmt_bytes(d['h2d_bytes'])})",
            f"  device->host copies:                     {d['d2h_copies']} ({_fmt_bytes(d['d2h_bytes'])})",
            f"  host syncs:                              {d['host_syncs']}",
            f"  ops run on the host (CPU fallback):      {d['cpu_fallbacks']}",
            (
                f"  device memory live / peak:               {_fmt_bytes(d['live_bytes'])} / "
                f"{_fmt_bytes(d['peak_bytes'])}"
            ),
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


@contextlib.contextmanager
def stats() -> Iterator[Stats]:
    """Count what the simulated device does inside the block.

    Yields:
        A :class:`Stats` whose counters read live inside the block and freeze when it closes.

    Example:
        >>> import torch, hf_tpu.sim
        >>> with hf_tpu.sim.stats() as s:
        ...     x = torch.ones(4).to("tpu")
        ...     y = (x * 2).sum().item()
        >>> (s.h2d_copies, s.host_syncs)
        (1, 1)
    """
    s = Stats()
    s._enter()
    try:
        yield s
    finally:
        s._exit()


@contextlib.contextmanager
def strict(host_syncs: bool = True, recompiles: bool = True) -> Iterator[None]:
    """Raise :class:`SimStrictError` on a host sync (``host_syncs``) or a compile (``recompiles``) in the block.

    Use it after warm-up to prove a loop never waits on the device nor compiles a new graph.

    Args:
        host_syncs: raise on a host sync (``.item()``, ``.tolist()``, ``.cpu()``, ...) inside the block; True by
            default.
        recompiles: raise on a compile (a new graph or a new eager op signature) inside the block; True by default.

    Raises:
        SimStrictError: inside the block, at the first forbidden host sync or compile.

    Example:
        >>> import torch, hf_tpu.sim
        >>> x = torch.ones(4, device="tpu")
        >>> with hf_tpu.sim.strict():
        ...     y = x * 2            # fine: stays on the device
        ...     # y.item() here would raise SimStrictError
    """
    if host_syncs:
        STATE.strict_syncs += 1
    if recompiles:
        STATE.strict_compiles += 1
    try:
        yield
    finally:
        if host_syncs:
            STATE.strict_syncs -= 1
        if recompiles:
            STATE.strict_compiles -= 1
