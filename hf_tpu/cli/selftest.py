"""``hf-tpu selftest``: run every capability's check on this host and report (see :mod:`hf_tpu.selftest`).

What the checks and the libraries under them print while they run (a Trainer's loss dicts, transformers' and
diffusers' warnings, C-level logs) is captured, at the file-descriptor level, so that the table is the output: it
goes into the JSON report (``output``) and, with ``--debug`` (or ``HF_TPU_DEBUG=1``), to stderr after the table.

Example:
    $ hf-tpu selftest --report selftest.json          # on a TPU VM
    $ hf-tpu --simulate selftest --quick              # anywhere
    $ hf-tpu selftest --only runtime,device
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["build_report", "format_results", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "selftest",
        help="check every hf_tpu capability on this host and write a report",
        description="Run one check per hf_tpu capability on the tpu device (tiny models, compared with CPU) and "
        "report passed / failed / skipped with the figures that matter on TPU.",
    )
    parser.add_argument("--quick", action="store_true", help="only the fast checks")
    parser.add_argument("--report", metavar="FILE", help="write the JSON report (versions, runtime, checks) here")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated check names, e.g. runtime,device")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    return parser


def _figures_text(figures: dict[str, Any], width: int = 60) -> str:
    """The figures that fit ``width``, each whole (``name=value``), then ``+N more`` for the rest (in the report);
    a figure is never cut."""
    items = [f"{k}={v}" for k, v in figures.items()]
    shown: list[str] = []
    for i, item in enumerate(items):
        rest = len(items) - i - 1
        tail = f", +{rest} more" if rest else ""
        if shown and len(", ".join([*shown, item]) + tail) > width:
            return ", ".join(shown) + f", +{len(items) - len(shown)} more"
        shown.append(item)
    return ", ".join(shown)


def format_results(results: list) -> str:
    """A table: one line per check, then the reasons and errors in full."""
    name_w = max([len(r.name) for r in results] + [5])
    lines = [f"{'check'.ljust(name_w)}  {'status':7}  {'time':>7}  figures / reason"]
    for r in results:
        detail = r.reason if r.status == "skipped" else ("see below" if r.status == "failed" else "")
        detail = detail or _figures_text(r.figures)
        lines.append(f"{r.name.ljust(name_w)}  {r.status:7}  {r.seconds:6.2f}s  {detail}")
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        lines.append("")
        lines.append(f"{r.name} failed: {r.error}")
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "skipped")}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines) + "\n"


def build_report(results: list, argv: list[str] | None = None, output: str = "") -> dict[str, Any]:
    """The JSON report: when, what ran, the ``hf-tpu env`` report, every check's result and what the checks
    printed (``output``)."""
    from hf_tpu.cli.env import collect

    env = collect()
    return {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["hf-tpu", *(argv if argv is not None else sys.argv[1:])],
        "versions": env["versions"],
        "runtime": env["runtime"],
        "problems": env["problems"],
        "env": env["env"],
        "summary": {s: sum(r.status == s for r in results) for s in ("passed", "failed", "skipped")},
        "checks": [r.to_dict() for r in results],
        "output": output,
    }


def run(args: argparse.Namespace) -> int:
    from hf_tpu import selftest

    if args.list:
        selftest.discover()
        registered = selftest.checks()
        width = max(map(len, registered), default=5)
        for name, check in registered.items():
            print(f"{name.ljust(width)}  {'quick' if check.quick else 'full ':5}  {check.description}")
        return 0
    from hf_tpu.cli._model_path import check_output_file

    check_output_file(args.report, "--report")
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    with _captured_output() as (terminal, captured):
        bar = _progress_bar(terminal)
        try:
            results = selftest.run_checks(only=only, quick=args.quick, progress=bar.step)
        except KeyError as err:
            results = err
        finally:
            bar.close()
    if isinstance(results, KeyError):
        print(f"hf-tpu selftest: {results.args[0]}", file=sys.stderr)
        return 2
    output = "".join(captured)
    print(format_results(results), end="")
    if output and _debug(args):
        print(f"--- what the checks printed ---\n{output}", file=sys.stderr, end="" if output.endswith("\n") else "\n")
    if args.report:
        report = build_report(results, getattr(args, "argv", None), output)
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report written to {args.report}")
    return 1 if any(r.status == "failed" for r in results) else 0


def _debug(args: argparse.Namespace) -> bool:
    from hf_tpu import _env

    return bool(getattr(args, "debug", False)) or _env.DEBUG.get()


@contextlib.contextmanager
def _captured_output() -> Iterator[tuple[TextIO, list[str]]]:
    """Send what is written to stdout and stderr (Python objects and file descriptors 1 and 2) to a buffer.

    Yields ``(terminal, captured)``: a stream on the original stderr (for the progress bar) and a list that holds
    the captured text once the block ends.
    """
    captured: list[str] = []
    python_level = io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        saved = os.dup(1), os.dup(2)
    except OSError:  # no file descriptors 1 and 2 (an embedding host): capture the Python streams only
        saved = None
    terminal = os.fdopen(os.dup(saved[1]), "w") if saved else sys.stderr
    with tempfile.TemporaryFile() as fd_level:
        if saved:
            os.dup2(fd_level.fileno(), 1)
            os.dup2(fd_level.fileno(), 2)
        try:
            with (
                contextlib.redirect_stdout(python_level),
                contextlib.redirect_stderr(python_level),
                warnings.catch_warnings(),
            ):
                warnings.showwarning = _warning_to(python_level)
                yield terminal, captured
        finally:
            if saved:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
                terminal.close()
            fd_level.seek(0)
            captured.append(fd_level.read().decode(errors="replace") + python_level.getvalue())


def _warning_to(stream: TextIO):
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))

    return show


class _progress_bar:
    """Progress on the terminal's stderr: a tqdm bar naming the check that runs, or, when stderr is not a terminal
    (piped, a log file), one line per check, so that a piped run is not silent for minutes."""

    def __init__(self, stream: TextIO) -> None:
        self._bar = None
        self._stream = stream

    def step(self, name: str, index: int, total: int) -> None:
        if not self._stream.isatty():
            print(f"hf-tpu selftest: check {index + 1}/{total}: {name}", file=self._stream, flush=True)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="check", file=self._stream, leave=False)
        self._bar.n = index
        self._bar.set_description(name)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
