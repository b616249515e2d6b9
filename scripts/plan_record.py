"""docs/planning.md's real-shape figures, made by ``hf-tpu plan`` and kept in docs/plan_records.json.

Each run named in :data:`RUNS` is one exact ``hf-tpu plan ... --json`` command. ``run`` executes it (in this
Python's environment: torch-tpu, libtpu and jax installed; no TPU needed) and writes its JSON output to the record
with the date, the commit, the package versions and the host; ``docs`` writes docs/planning.md's table of real
shapes from the record. tests/tpu_compile/test_plan_record.py checks that the page's rows are the record's, and that
the plan's arithmetic today gives the record's projection; tests/contract/test_plan_record.py runs the small run
again and compares its compiler figures with the record's (libtpu's counts are deterministic: the same bytes and
FLOPs on every run and host; only the seconds differ).

    python scripts/plan_record.py run llama-3-8b-v6e-1        # minutes on a 2-core host: not in any test tier
    python scripts/plan_record.py run llama-3-8b-2-layers-v6e-1 --record /tmp/r.json
    python scripts/plan_record.py docs                         # rewrite the page's table from the record

``run --from FILE`` records FILE, the command's stdout from a run made by hand, instead of running it again.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_tpu.tpu_compile.plan import Plan, human  # noqa: E402
from hf_tpu.tpu_compile.programs import ProgramRecord  # noqa: E402
from hf_tpu.tpu_compile.targets import target as find_target  # noqa: E402

RECORD = ROOT / "docs" / "plan_records.json"
PAGE = ROOT / "docs" / "planning.md"
PACKAGES = ("torch", "torch-tpu", "libtpu", "jax", "jaxlib", "transformers", "hf-tpu")

#: name -> the run: the row's label, the model directory (relative to the repository's root) and the command's
#: arguments after it; ``config`` overrides fields of that directory's config.json (the run then plans a copy of it
#: in a temporary directory, named in the command as ``<model>+overrides``).
RUNS: dict[str, dict] = {
    "llama-3-8b-v6e-1": {
        "label": "Llama-3-8B", "model": "llama-3-8b-shape",
        "args": ["--target", "v6e-1", "--max-prompt-len", "2048", "--max-new-tokens", "256"],
    },
    "llama-3-8b-v5e-1": {
        "label": "Llama-3-8B", "model": "llama-3-8b-shape",
        "args": ["--target", "v5e-1", "--max-prompt-len", "2048", "--max-new-tokens", "256"],
    },
    # The same shape cut down until it plans in seconds (the contract tier runs it again and compares).
    "llama-3-8b-2-layers-v6e-1": {
        "label": "Llama-3-8B cut to 2 layers, 256 wide, vocabulary 2048", "model": "llama-3-8b-shape",
        "config": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "vocab_size": 2048},
        "args": ["--target", "v6e-1", "--max-prompt-len", "32", "--max-new-tokens", "8"],
    },
}  # fmt: skip

#: The rows docs/planning.md's table shows, in order (the small run is the contract tier's, not a real shape).
DOC_ROWS = ["llama-3-8b-v6e-1"]
BEGIN = ("<!-- plan-records: begin (python scripts/plan_record.py docs writes this table from "
         "docs/plan_records.json) -->")
END = "<!-- plan-records: end -->"
#: The runs whose whole output (the table ``hf-tpu plan`` prints without ``--json``, for the recorded figures) the
#: page shows, each between its own markers.
DOC_OUTPUTS = ["llama-3-8b-v5e-1"]
OUTPUT_NOTE = ("<!-- docs-test: not checked: hf-tpu plan's output, recorded in docs/plan_records.json (the suite has "
               "no torch-tpu); tests/tpu_compile/test_plan_record.py checks it is the record's -->")
HEADER = ("| model shape | target | weights | KV cache | HBM total | fits | prefill lower + compile | decode lower + "
          "compile | decode step (est.) | from bytes accessed | bytes over floor |")  # fmt: skip


def command(name: str) -> list[str]:
    """The run's command as a user types it (``hf-tpu plan MODEL ARGS --json``)."""
    run = RUNS[name]
    model = run["model"] + ("+overrides" if run.get("config") else "")
    return ["hf-tpu", "plan", model, *run["args"], "--json"]


def versions() -> dict[str, str | None]:
    """The installed versions of the packages a plan depends on (None where one is missing)."""
    found = {}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_tpu"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    return head + (" (hf_tpu/ modified)" if dirty else "")


def run_plan(name: str, timeout: float | None = None) -> tuple[dict, float, int]:
    """Run ``name``'s command in this Python's environment: its JSON object, wall seconds and exit status."""
    spec = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(ROOT / spec["model"])
        if spec.get("config"):
            config = json.loads((ROOT / spec["model"] / "config.json").read_text())
            config.update(spec["config"])
            model = os.path.join(tmp, "model")
            os.makedirs(model)
            Path(model, "config.json").write_text(json.dumps(config, indent=2))
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "hf_tpu.cli", "plan", model, *spec["args"], "--json"],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)  # fmt: skip
        seconds = time.perf_counter() - started
    if not proc.stdout.strip():
        raise SystemExit(f"{' '.join(command(name))} printed no plan (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), seconds, proc.returncode


def record_entry(name: str, plan: dict, seconds: float | None, status: int, commit: str | None = None) -> dict:
    """The record of one run: the command, when, where and with what, and the plan it printed."""
    plan = dict(plan)
    plan["model"] = RUNS[name]["model"] + ("+overrides" if RUNS[name].get("config") else "")  # not a temp path
    return {
        "command": " ".join(command(name)),
        "config_overrides": RUNS[name].get("config", {}),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit or _commit(),
        "versions": versions(),
        "host": {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
                 "machine": platform.machine(), "tpu": None},  # fmt: skip
        "wall_seconds": None if seconds is None else round(seconds, 1),
        "exit_status": status,
        "plan": plan,
    }


def load(path: Path = RECORD) -> dict:
    """The record file: ``{"runs": {name: entry}}`` (empty when there is none yet)."""
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def rebuild(plan: dict) -> Plan:
    """The :class:`~hf_tpu.tpu_compile.plan.Plan` a recorded ``--json`` object came from (its figures as recorded;
    what the plan derives from them, such as the decode projection, is computed by today's code)."""
    return Plan(
        target=find_target(plan["target"]), model=plan["model"], fits=plan["fits"], hbm=plan["hbm_bytes"],
        programs=[ProgramRecord(**p) for p in plan["programs"]], info=plan["info"], note=plan["note"],
        error=plan["error"], kind=plan["kind"], does_not_fit=plan["verdict"] == "does not fit",
        out_of_memory=plan["out_of_memory"], suggestions=plan["suggestions"],
    )  # fmt: skip


def row(name: str, entry: dict) -> list[str]:
    """The page's table row of one recorded run, cell by cell."""
    plan, hbm = entry["plan"], entry["plan"]["hbm_bytes"]
    programs = {p["name"].split("-")[0]: p for p in plan["programs"]}

    def seconds(kind: str) -> str:
        p = programs.get(kind)
        if p is None or not p["compiled"]:
            return "—"
        return f"{p['name']}: {p['lower_seconds']:.1f} s + {p['compile_seconds']:.1f} s"

    decode = plan["decode"] or {}
    over = f"{decode['bytes_over_floor']:.2f}x" if decode else "—"
    if decode.get("hbm_over_floor"):
        over += f" (HBM: {decode['hbm_over_floor']:.2f}x)"
    return [
        RUNS[name]["label"], plan["target"], human(hbm["weights"]), human(hbm["kv_cache"]), human(hbm["total"]),
        "yes" if plan["verdict"] == "fits" else plan["verdict"], seconds("prefill"), seconds("decode"),
        f"{decode['projected_ms']:.1f} ms ({decode['projected_tokens_per_second']:.0f} tok/s)" if decode else "—",
        f"{decode['projected_ms_from_bytes_accessed']:.1f} ms" if decode else "—", over,
    ]  # fmt: skip


def table(record: dict) -> str:
    """docs/planning.md's table of the record's :data:`DOC_ROWS`, between its markers."""
    lines = [BEGIN, HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += ["| " + " | ".join(row(name, record["runs"][name])) + " |" for name in DOC_ROWS]
    return "\n".join([*lines, END])


def output_markers(name: str) -> tuple[str, str]:
    """The markers around ``name``'s output on the page."""
    return (f"<!-- plan-output: {name} (python scripts/plan_record.py docs writes it from docs/plan_records.json) -->",
            f"<!-- plan-output: end {name} -->")  # fmt: skip


def output(name: str, record: dict) -> str:
    """``name``'s output as the page shows it: what ``hf-tpu plan`` prints for the recorded figures, fenced."""
    begin, end = output_markers(name)
    text = rebuild(record["runs"][name]["plan"]).table()
    return "\n".join([begin, OUTPUT_NOTE, "```", text, "```", end])


def page_table(text: str, begin: str = BEGIN, end: str = END) -> str:
    """The block between ``begin`` and ``end`` (the table's markers by default) in docs/planning.md's ``text``."""
    found = re.search(re.escape(begin) + r".*?" + re.escape(end), text, re.S)
    if found is None:
        raise SystemExit(f"docs/planning.md has no {begin!r} ... {end!r} block")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    runner = sub.add_parser("run", help="run a named plan and write it to the record")
    runner.add_argument("name", choices=sorted(RUNS))
    runner.add_argument("--record", type=Path, default=RECORD, help="the record file (docs/plan_records.json)")
    runner.add_argument("--from", dest="source", type=Path, help="the command's stdout from a run made by hand")
    runner.add_argument("--commit", help="with --from: the commit the run was made at (default: HEAD)")
    runner.add_argument("--wall-seconds", type=float, help="with --from: the run's wall seconds")
    runner.add_argument("--timeout", type=float, default=None, help="seconds before the command is stopped")
    sub.add_parser("docs", help="write docs/planning.md's table from the record")
    args = parser.parse_args(argv)
    if args.what == "docs":
        text, record = PAGE.read_text(), load()
        text = text.replace(page_table(text), table(record))
        for name in DOC_OUTPUTS:
            text = text.replace(page_table(text, *output_markers(name)), output(name, record))
        PAGE.write_text(text)
        print(f"wrote {len(DOC_ROWS)} rows and {len(DOC_OUTPUTS)} outputs into {PAGE.relative_to(ROOT)}")
        return 0
    if args.source:
        plan, seconds = json.loads(args.source.read_text()), args.wall_seconds
        status = plan["exit_status"]
    else:
        plan, seconds, status = run_plan(args.name, args.timeout)
    record = load(args.record)
    record["runs"][args.name] = record_entry(args.name, plan, seconds, status, args.commit)
    record["runs"] = dict(sorted(record["runs"].items()))
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.name}: {' | '.join(row(args.name, record['runs'][args.name]))} -> {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
