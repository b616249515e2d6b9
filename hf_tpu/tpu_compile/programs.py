"""Lower graphs through torch_tpu's real front end and compile them with libtpu for a named TPU, on any host.

:func:`lower_and_compile` runs two child processes: the lowering process (:mod:`hf_tpu.tpu_compile._child`:
torch_tpu's device init and the stand-ins of :func:`hf_tpu._torch_tpu.start_lowering`, which patch the whole
process) calls an entry that runs hf_tpu code on deferred ``tpu`` tensors and records each program torch_tpu
lowers; the compiling process (:mod:`hf_tpu.tpu_compile._xla`) compiles each for the target with libtpu's
compile-only client. Each program's :class:`ProgramRecord` says whether it lowered (else the error and the source
line), whether it compiled (else the compiler's message), and what the compiler reports: seconds, HBM by kind,
FLOPs, bytes accessed, ``optimal_seconds``. :func:`lower_and_compile_each` lowers several entries in one lowering
process and compiles them in one compiling process (each process pays torch_tpu's device start, or libtpu's, and
the lowering process several seconds of imports); :func:`compile_lowered` compiles one lowering (``compile=False``)
for another target.

Example:
    >>> from hf_tpu.tpu_compile import lower_and_compile                                   # doctest: +SKIP
    >>> result = lower_and_compile("hf_tpu.tpu_compile._generate:lower_generate",          # doctest: +SKIP
    ...                            {"model": "tiny-llama/", "max_prompt_len": 16}, "v6e-1")
    >>> [(p.name, p.compiled) for p in result.programs]                                    # doctest: +SKIP
    [('prefill-16', True), ('decode', True)]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hf_tpu.errors import HfTpuRuntimeError
from hf_tpu.tpu_compile.targets import Target, target as find_target

__all__ = ["LoweringResult", "ProgramRecord", "child_environment", "compile_lowered", "lower_and_compile",
           "lower_and_compile_each"]

PROGRESS_PREFIX = "hf_tpu.tpu_compile:"


@dataclass
class ProgramRecord:
    """One program: lowered by torch_tpu's front end, compiled by libtpu for the target (see the module doc).

    The compiler's figures are None until the program compiled.

    Attributes:
        name: the program's label (``"prefill-16"``, ``"decode"``, ...; ``"graph-<i>"`` when the entry gave none).
        lowered: whether torch_tpu lowered it.
        compiled: whether libtpu compiled it.
        error: why it failed to lower or compile, else None.
        where: the source line the lowering failure came from, else None.
        lower_seconds: seconds the lowering took.
        compile_seconds: seconds libtpu's compile took.
        flops: XLA's cost analysis: floating-point operations of one run.
        bytes_accessed: XLA's cost analysis: bytes read and written by one run.
        transcendentals: XLA's cost analysis: transcendental operations of one run.
        optimal_seconds: XLA's estimate of one run's seconds (negative where it cannot estimate, as with Mosaic
            custom calls).
        hbm_bytes: the part of ``bytes_accessed`` in HBM, from libtpu's dumped HLO (``dump_hlo`` only).
        hlo_path: where the scheduled HLO was kept (``dump_hlo`` only).
        argument_bytes: XLA's memory analysis: bytes of the arguments.
        output_bytes: bytes of the outputs.
        alias_bytes: bytes of outputs aliased to (donated) arguments.
        temp_bytes: bytes of temporaries.
        code_bytes: bytes of generated code.
        donated: indices of the arguments torch_tpu donated.
        custom_calls: how many ``tpu_custom_call`` (Pallas/Mosaic kernels) the program holds.
        arguments: the arguments as lowered, ``[shape, dtype name]`` each.
        outputs: the outputs as lowered, likewise.
        text: the StableHLO text (left out of ``repr`` and, by default, of :meth:`to_dict`).
    """

    name: str
    lowered: bool = False
    compiled: bool = False
    error: str | None = None
    where: str | None = None
    lower_seconds: float | None = None
    compile_seconds: float | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    transcendentals: float | None = None
    optimal_seconds: float | None = None
    hbm_bytes: float | None = None  # the part of bytes_accessed in HBM, from libtpu's dumped HLO (dump_hlo only)
    hlo_path: str | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    code_bytes: int | None = None
    donated: list[int] = field(default_factory=list)
    custom_calls: int = 0
    arguments: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    text: str = field(default="", repr=False)

    @property
    def peak_bytes(self) -> int | None:
        """HBM the program holds while it runs: its arguments, its outputs not aliased to an argument, its temps."""
        if not self.compiled:
            return None
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def to_dict(self, text: bool = False) -> dict:
        """The record as a plain dict (for JSON).

        Args:
            text: keep the program's text and its argument and output lists; False (the default) drops them.

        Returns:
            Each field's name mapped to its value.
        """
        out = asdict(self)
        if not text:
            out.pop("text")
            out.pop("arguments")
            out.pop("outputs")
        return out


@dataclass
class LoweringResult:
    """What :func:`lower_and_compile` found: one record per program, the entry's facts (``info``), the eager traffic
    the stand-in met outside graphs, and an error when the entry itself failed (with where it came from).

    Attributes:
        target: the :class:`~hf_tpu.tpu_compile.Target` compiled for.
        programs: one :class:`ProgramRecord` per program, in lowering order.
        info: the facts the entry returned (its ``labels`` taken out).
        eager: the counts of eager traffic the lowering stand-in met outside graphs.
        error: why the entry itself failed, else None.
        where: the source line that failure came from, else None.
        lower_seconds: seconds the lowering process took.
        compile_seconds: seconds libtpu took over all programs.
    """

    target: Target
    programs: list[ProgramRecord]
    info: dict[str, Any]
    eager: dict[str, int]
    error: str | None = None
    where: str | None = None
    lower_seconds: float = 0.0
    compile_seconds: float = 0.0


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def child_environment() -> dict[str, str]:
    """The environment of the lowering and compiling processes: torch_tpu autoloaded (never the simulator), libtpu
    told not to look for cloud metadata nor to lock the host's chips, its logs quiet."""
    env = dict(os.environ)
    for name in ("HF_TPU_SIMULATE", "TORCH_DEVICE_BACKEND_AUTOLOAD", "JAX_PLATFORMS"):
        env.pop(name, None)
    # ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu takes a host-wide lock file (/tmp/libtpu_lockfile) for the chips it would
    # own; there are none, and two plans (or a plan and a test) may compile at once.
    env.update({"TPU_SKIP_MDS_QUERY": "1", "TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3",
                "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})  # fmt: skip
    return env


def _run_child(args: list[str], progress: Callable[[str], None] | None, timeout: float | None) -> str:
    """Run ``python -m <args>``; forward its progress lines; return the tail of what it printed (for errors)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args], env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS_PREFIX):
                if progress is not None:
                    progress(line[len(PROGRESS_PREFIX) :].strip())
                continue
            tail = (tail + [line.rstrip()])[-40:]
        proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return "\n".join(tail)


def lower_and_compile(
    entry: str,
    kwargs: dict[str, Any],
    target: str | Target = "v6e-1",
    *,
    compile: bool = True,
    progress: Callable[[str], None] | None = None,
    timeout: float | None = None,
    dump_hlo: str | None = None,
) -> LoweringResult:
    """Lower what ``entry`` (``"module:function"``, called as ``function(session, **kwargs)`` in the lowering
    process) compiles, then compile each program for ``target`` (``compile=False``: lower only). With ``dump_hlo``
    (a folder), libtpu's scheduled HLO of each program is kept there as ``<name>.hlo.txt`` and each record gets
    ``hbm_bytes``, the part of ``bytes_accessed`` that is HBM traffic (:mod:`hf_tpu.tpu_compile.hlo_bytes`; the
    compile takes about 3x longer).

    Args:
        entry: ``"module:function"``; the function gets a lowering session and ``kwargs`` in a child process with
            torch_tpu (never the simulator).
        kwargs: JSON-serializable keyword arguments of ``entry``.
        target: a :class:`Target` or its name in :data:`TARGETS`; ``"v6e-1"`` by default.
        compile: also compile each lowered program for ``target`` (True, the default) or lower only (then
            :func:`compile_lowered` compiles the result, for one target or several).
        progress: called with each progress line the child processes print; None: not reported.
        timeout: seconds each child process may take to exit once its output has ended; None (the default): no
            limit.
        dump_hlo: a folder to keep each program's scheduled HLO in (and measure HBM traffic); None: not kept.

    Returns:
        A :class:`LoweringResult`; a program that failed to lower or compile is a record saying so, not an error.

    Raises:
        hf_tpu.tpu_compile.targets.UnknownTargetError: ``target`` is not a known target name.
        RuntimeError (HfTpuRuntimeError): a child process died without writing its result (the message holds the end of
            its output).
    """
    chosen = find_target(target) if isinstance(target, str) else target
    raw = _lower(entry, kwargs, progress, timeout)
    result = _result(chosen, raw.get("labels") or [], raw["programs"], raw.get("info") or {}, raw.get("eager") or {},
                     raw.get("error"), raw.get("where"))  # fmt: skip
    result.lower_seconds = raw.get("seconds", 0.0)
    if compile:
        _compile([result], chosen, progress, timeout, dump_hlo)
    return result


def lower_and_compile_each(
    entries: dict[str, tuple[str, dict[str, Any]]],
    target: str | Target = "v6e-1",
    *,
    compile: bool = True,
    progress: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> dict[str, LoweringResult]:
    """:func:`lower_and_compile` of several entries in one lowering process and one compiling process, instead of
    two processes each (each pays torch_tpu's device start, or libtpu's, again). ``entries`` maps a name to
    ``(entry, kwargs)``; they run in their order, each after ``torch._dynamo.reset()`` so that no compiled code or
    guard of an earlier entry is reused (:func:`hf_tpu.tpu_compile._child.lower_each`), and an entry that raises is
    recorded and the next one runs. What the entries leave in the process besides (a patch enabled, a kernel
    registered) the next ones see: an entry that must start clean runs alone.

    Args:
        entries: name -> ``("module:function", kwargs)``, as :func:`lower_and_compile` takes them.
        target, compile, progress, timeout: as for :func:`lower_and_compile`.

    Returns:
        name -> the :class:`LoweringResult` of that entry: its own programs, labels, info, error (with where it came
        from) and the eager traffic it alone caused, as :func:`lower_and_compile` returns it for the entry alone.
        ``lower_seconds`` is the seconds of its own programs.

    Raises:
        hf_tpu.tpu_compile.targets.UnknownTargetError: ``target`` is not a known target name.
        RuntimeError (HfTpuRuntimeError): a child process died without writing its result; or the lowering process
            failed outside the entries.
    """
    chosen = find_target(target) if isinstance(target, str) else target
    spec = {name: {"entry": entry, "kwargs": kwargs} for name, (entry, kwargs) in entries.items()}
    raw = _lower("hf_tpu.tpu_compile._child:lower_each", {"entries": spec}, progress, timeout)
    groups = (raw.get("info") or {}).get("groups")
    if raw.get("error") or groups is None or [g["name"] for g in groups] != list(entries):
        raise HfTpuRuntimeError(f"the lowering process failed outside its entries: {raw.get('error')}\n at "
                                f"{raw.get('where')}")  # fmt: skip
    results = {}
    for g in groups:
        own = raw["programs"][g["first"] : g["first"] + g["count"]]
        results[g["name"]] = _result(chosen, g["labels"], own, g["info"], g["eager"], g["error"], g.get("where"))
        results[g["name"]].lower_seconds = sum(p["seconds"] for p in own)
    if compile:
        _compile(list(results.values()), chosen, progress, timeout, None)
    return results


def compile_lowered(
    result: LoweringResult,
    target: str | Target,
    *,
    progress: Callable[[str], None] | None = None,
    timeout: float | None = None,
    dump_hlo: str | None = None,
) -> LoweringResult:
    """``result``'s programs (``lower_and_compile(..., compile=False)``) compiled for ``target``: what
    :func:`lower_and_compile` with that target returns, in a new :class:`LoweringResult` (``result`` is left as it
    is, so one lowering compiles for several targets; the lowering does not depend on the target).

    Args:
        result: a lowering not compiled yet.
        target, progress, timeout, dump_hlo: as for :func:`lower_and_compile`.

    Returns:
        A new :class:`LoweringResult` for ``target``, its records copies of ``result``'s with the compiler's figures.
    """
    chosen = find_target(target) if isinstance(target, str) else target
    copied = replace(result, target=chosen, programs=[replace(p) for p in result.programs], info=dict(result.info),
                     eager=dict(result.eager))  # fmt: skip
    _compile([copied], chosen, progress, timeout, dump_hlo)
    return copied


def _lower(entry: str, kwargs: dict[str, Any], progress, timeout) -> dict:
    """Run the lowering process on ``entry``; its raw result (programs as dicts, labels, info, eager, error)."""
    with tempfile.TemporaryDirectory(prefix="hf_tpu_tpu_compile_") as tmp:
        spec, lowered = os.path.join(tmp, "spec.json"), os.path.join(tmp, "lowered.json")
        with open(spec, "w") as f:
            json.dump({"entry": entry, "kwargs": kwargs}, f)
        tail = _run_child(["hf_tpu.tpu_compile._child", spec, lowered], progress, timeout)
        if not os.path.exists(lowered):
            raise HfTpuRuntimeError(f"the lowering process died before writing its result; its last output:\n{tail}")
        with open(lowered) as f:
            return json.load(f)


def _result(chosen: Target, labels: list, raw_programs: list[dict], info: dict, eager: dict, error, where):
    """The :class:`LoweringResult` of one entry's raw programs (``labels``: one name per program, else none)."""
    programs = []
    for i, p in enumerate(raw_programs):
        name = labels[i] if i < len(labels) and len(labels) == len(raw_programs) else f"graph-{i}"
        programs.append(ProgramRecord(
            name=name, lowered=True, lower_seconds=p["seconds"], donated=p["donated"],
            custom_calls=p["text"].count("tpu_custom_call"), arguments=p["arguments"], outputs=p["outputs"],
            text=p["text"],
        ))  # fmt: skip
    result = LoweringResult(target=chosen, programs=programs, info=info, eager=eager, error=error, where=where)
    if result.error and not programs:
        result.programs.append(ProgramRecord(name="graph-0", error=result.error, where=result.where))
    return result


def _compile(results: list[LoweringResult], chosen: Target, progress, timeout, dump_hlo: str | None) -> None:
    """Compile the programs of ``results`` for ``chosen`` in one compiling process (none when nothing lowered) and
    fill in each record; a result none of whose programs lowered is left as it is."""
    results = [r for r in results if any(p.lowered for p in r.programs)]
    programs = [p for r in results for p in r.programs]
    if not programs:
        return
    with tempfile.TemporaryDirectory(prefix="hf_tpu_tpu_compile_") as tmp:
        texts, compiled = os.path.join(tmp, "texts.json"), os.path.join(tmp, "compiled.json")
        with open(texts, "w") as f:
            json.dump([p.text for p in programs], f)
        if progress is not None:
            progress(f"compiling {len(programs)} program(s) for {chosen.name} with libtpu")
        dump = [os.path.abspath(dump_hlo)] if dump_hlo is not None else []
        tail = _run_child(["hf_tpu.tpu_compile._xla", texts, chosen.topology, compiled, *dump], progress, timeout)
        if not os.path.exists(compiled):
            raise HfTpuRuntimeError(f"the compiling process died before writing its result; its last output:\n{tail}")
        with open(compiled) as f:
            records = json.load(f)
    for program, record in zip(programs, records):
        for key, value in record.items():
            setattr(program, key, value)
        if program.hlo_path:
            named = os.path.join(os.path.dirname(program.hlo_path), f"{_file_name(program.name)}.hlo.txt")
            os.replace(program.hlo_path, named)
            program.hlo_path = named
    for result in results:
        result.compile_seconds = sum(p.compile_seconds or 0.0 for p in result.programs)
