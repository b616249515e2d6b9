"""``hf-tpu bench [NAME ...] [--quick] [--json PATH] [--list] [OPTIONS]``: run the project's benchmarks.

Each benchmark (:mod:`hf_tpu.benchmarks`) measures its figures side by side in one run: compiles and new eager shape
signatures counted by the simulated ``tpu`` device, host<->device copies, and time ratios. Every benchmark runs in
a fresh process (``python -m hf_tpu.benchmarks``), so that graphs compiled and shapes seen by one are not
counted in the next. A benchmark whose optional dependency is missing is reported as skipped, with the reason.

- ``hf-tpu bench`` runs all of them in ``--quick`` mode (small sizes, few iterations);
- ``hf-tpu bench moe training`` runs those two with their full default sizes (``--quick`` to shrink them);
- ``hf-tpu bench generate --lengths 6 --max-prompt 128``: one benchmark with its own options
  (``hf-tpu bench generate --help`` lists them);
- ``--json PATH`` writes every benchmark's options, figures and runtime, with the package versions.

Each benchmark ends with one status line: ``ok`` (every target met), ``missed`` (a timing target missed, named on
the line: time ratios depend on the machine and its load, so this does not change the exit status), ``targets
missed`` (a count target missed: compiles, copies; exit status 1), ``error`` or ``skipped``.

Example:
    $ hf-tpu bench --list
    $ hf-tpu bench sim_forward --quick --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["register", "run", "summary_table"]

# Flags of `hf-tpu bench` itself that may also come after the benchmark names.
_OWN_FLAGS = ("quick", "json", "list", "simulate", "sim_generation", "sim_hbm")


def _own_flags(parser: argparse.ArgumentParser, default=None) -> None:
    kw = {} if default is None else {"default": default}
    parser.add_argument("--list", action="store_true", help="list the benchmarks and whether they can run here", **kw)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few iterations (the default when no NAME is given)", **kw
    )
    parser.add_argument("--json", metavar="PATH", help="write options, figures, runtime and versions to PATH", **kw)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from hf_tpu.benchmarks import BENCHMARKS

    width = max(map(len, BENCHMARKS))
    listing = "\n".join(f"  {name:<{width}}  {b.summary}" for name, b in BENCHMARKS.items())
    parser = subparsers.add_parser(
        "bench",
        help="measure compiles, host<->device copies and step times",
        description="Run the project's benchmarks (all of them, quick, when no NAME is given). Options after a "
        "single NAME are that benchmark's own (hf-tpu bench NAME --help).",
        epilog=f"benchmarks:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="hf-tpu bench [--list] [--quick] [--json PATH] [--simulate] [NAME ...] [BENCHMARK OPTIONS]",
    )
    _own_flags(parser)
    parser.add_argument(
        "benchmark_args", nargs=argparse.REMAINDER, metavar="NAME ... [OPTIONS]", help=argparse.SUPPRESS
    )
    return parser


def _split(args: argparse.Namespace) -> tuple[list[str], list[str], argparse.Namespace]:
    """Benchmark names, the options after them, and the bench flags (given before or after the names)."""
    rest = list(args.benchmark_args)
    names: list[str] = []
    while rest and not rest[0].startswith("-"):
        names.append(rest.pop(0))
    late = argparse.ArgumentParser(add_help=False)
    _own_flags(late, default=argparse.SUPPRESS)
    late.add_argument("--simulate", action="store_true", default=argparse.SUPPRESS)
    late.add_argument("--sim-generation", default=argparse.SUPPRESS)
    late.add_argument("--sim-hbm", type=float, default=argparse.SUPPRESS)
    known, options = late.parse_known_args(rest)
    flags = argparse.Namespace(**{k: getattr(args, k, None) for k in _OWN_FLAGS})
    for key, value in vars(known).items():
        setattr(flags, key, value)
    return names, options, flags


def _list() -> int:
    from hf_tpu.benchmarks import BENCHMARKS, missing_requirements

    width = max(map(len, BENCHMARKS))
    for name, b in BENCHMARKS.items():
        missing = missing_requirements(name)
        state = f"  [skipped here: {'; '.join(missing)}]" if missing else ""
        print(f"{name:<{width}}  {b.summary}{state}")
    return 0


def _child_env() -> dict[str, str]:
    # The child must import this same hf_tpu (a checkout run with PYTHONPATH, or the installed package).
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    return env


def _run_one(name: str, options: list[str], quick: bool) -> dict:
    from hf_tpu.benchmarks import missing_requirements

    missing = missing_requirements(name)
    if missing:
        print(f"== {name}: skipped: {'; '.join(missing)}", flush=True)
        return {"status": "skipped", "reason": "; ".join(missing)}
    print(f"== {name}{' (quick)' if quick else ''}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hf-tpu-bench-") as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "hf_tpu.benchmarks", "--figures", str(out)]
        cmd += ["--quick"] if quick else []
        cmd += [name, *options]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=_child_env(), check=False)
        seconds = round(time.perf_counter() - start, 2)
        record = json.loads(out.read_text()) if out.exists() else {}
    status = _status(proc.returncode, record)
    if status == "error":
        record["reason"] = f"exit status {proc.returncode} (its output is above)"
    why = f" ({'; '.join(record['figures']['timing_missed'])})" if status == "missed" else ""
    print(f"== {name}: {status}{why} in {seconds:.1f}s", flush=True)
    return {"status": status, "seconds": seconds, **record}


def summary_table(results: dict[str, dict]) -> str:
    """The closing summary: one line per benchmark, columns as wide as their longest entry."""
    name_w = max(map(len, results), default=0)
    status_w = max((len(r["status"]) for r in results.values()), default=0)
    lines = []
    for name, r in results.items():
        detail = r.get("reason") or f"{r['seconds']:.1f}s"
        if r["status"] == "missed":
            detail += f"  ({'; '.join(r['figures']['timing_missed'])})"
        lines.append(f"  {name:<{name_w}}  {r['status']:<{status_w}}  {detail}")
    return "\n".join(lines) + "\n"


def _status(returncode: int, record: dict) -> str:
    """``ok``, ``missed`` (a timing target), ``targets missed`` (a count target: exit 1) or ``error``."""
    if returncode == 0:
        return "missed" if (record.get("figures") or {}).get("timing_missed") else "ok"
    return "targets missed" if record else "error"  # with a record, the benchmark ran to its end


def _versions() -> dict:
    from hf_tpu.cli.env import package_versions

    return package_versions()


def run(args: argparse.Namespace) -> int:
    from hf_tpu.benchmarks import BENCHMARKS

    names, options, flags = _split(args)
    if flags.list:
        return _list()
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(
            f"hf-tpu bench: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)} "
            "(hf-tpu bench --list)",
            file=sys.stderr,
        )
        return 2
    if options and len(names) != 1:
        print(
            f"hf-tpu bench: benchmark options {' '.join(options)} need exactly one benchmark name before them "
            f"(got {len(names)}): hf-tpu bench NAME {' '.join(options)}",
            file=sys.stderr,
        )
        return 2
    if flags.sim_generation or flags.sim_hbm:
        print(
            "hf-tpu bench: note: the benchmarks run on the default simulated v6e; --sim-generation/--sim-hbm "
            "do not change their figures",
            file=sys.stderr,
        )
    if len(names) == 1 and any(o in ("-h", "--help") for o in options):
        from hf_tpu.benchmarks.__main__ import benchmark_parser

        benchmark_parser(names[0]).print_help()
        return 0
    from hf_tpu.cli._model_path import check_output_file

    check_output_file(flags.json, "--json")
    quick = bool(flags.quick) or not names
    selected = names or list(BENCHMARKS)
    results = {name: _run_one(name, options, quick) for name in selected}

    print("\nsummary:")
    print(summary_table(results), end="")
    if flags.json:
        report = {
            "command": ["hf-tpu", *getattr(args, "argv", [])],
            "quick": quick,
            "versions": _versions(),
            "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "benchmarks": results,
        }
        Path(flags.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"figures written to {flags.json}")
    return 0 if all(r["status"] in ("ok", "missed", "skipped") for r in results.values()) else 1
