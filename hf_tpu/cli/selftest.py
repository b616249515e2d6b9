"""``hf-tpu selftest``: run every capability's check on this host and report (see :mod:`hf_tpu.selftest`).

Example:
    $ hf-tpu selftest --report selftest.json          # on a TPU VM
    $ hf-tpu --simulate selftest --quick              # anywhere
    $ hf-tpu selftest --only runtime,device
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

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
    text = ", ".join(f"{k}={v}" for k, v in figures.items())
    return text if len(text) <= width else text[: width - 3] + "..."


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


def build_report(results: list, argv: list[str] | None = None) -> dict[str, Any]:
    """The JSON report: when, what ran, the ``hf-tpu env`` report, and every check's result."""
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
    }


def run(args: argparse.Namespace) -> int:
    from hf_tpu import selftest

    if args.list:
        selftest.discover()
        for name, check in selftest.checks().items():
            print(f"{name:12} {'quick' if check.quick else 'full ':5}  {check.description}")
        return 0
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    bar = _progress_bar()
    try:
        results = selftest.run_checks(only=only, quick=args.quick, progress=bar.step)
    except KeyError as err:
        print(f"hf-tpu selftest: {err.args[0]}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    print(format_results(results), end="")
    if args.report:
        report = build_report(results, getattr(args, "argv", None))
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report written to {args.report}")
    return 1 if any(r.status == "failed" for r in results) else 0


class _progress_bar:
    """A tqdm bar on stderr naming the check that runs; silent when stderr is not a terminal."""

    def __init__(self) -> None:
        self._bar = None

    def step(self, name: str, index: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="check", file=sys.stderr, leave=False)
        self._bar.n = index
        self._bar.set_description(name)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
