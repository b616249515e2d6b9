"""Benchmark: does each fast-path architecture's decode program compile for a real TPU (v6e-1), and what would a
step cost? No TPU is needed: torch_tpu's real lowering and libtpu's compiler (:mod:`hf_tpu.tpu_compile`).

For every architecture that docs/architectures.md lists on hf_tpu's fast path, its tiny config (the sweep's,
:mod:`hf_tpu.benchmarks._tiny_configs`) is saved and hf_tpu's warm-up (prompt bucket 16, 8 new tokens, float32)
is lowered through torch_tpu and compiled by libtpu for ``--target``. A row says whether the decode program
compiled, its projected step in microseconds (the compiler's counts over the chip's published bandwidth and peak:
an estimate, not a measurement), or the first line of why not. Rows go to ``--rows`` (default
docs/arch_compile.json) as they come; ``--resume`` measures only architectures without a row there;
``--write-docs`` puts the column into docs/architectures.md's table (arch_sweep's ``--write-docs`` keeps it).
Needs torch-tpu, libtpu and jax. Run::

    python benchmarks/arch_compile.py --resume --write-docs
    hf-tpu bench arch_compile --archs llama qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMN", "COMPILE_NOTE", "DOCS_PAGE", "QUICK", "ROWS", "add_arguments", "cell", "load_rows", "lower_many", "measure", "measure_many", "print_table", "run",
    "write_docs",
]  # fmt: skip

QUICK = {"archs": ["llama", "qwen3_moe"]}
ROWS = Path(__file__).resolve().parents[2] / "docs" / "arch_compile.json"
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"  # arch_sweep's page
COLUMN = "v6e-1 decode (est.)"
# The sentence arch_sweep's page puts above its table for this column.
COMPILE_NOTE = (
    "*v6e-1 decode (est.)*: for a fast-path architecture, whether its decode program compiles for a real TPU v6e "
    "through torch_tpu's own lowering and libtpu's compiler, with no TPU (`python benchmarks/arch_compile.py "
    "--write-docs`, docs/planning.md), and the projected step of that tiny model from the compiler's counts (an "
    "estimate, not a measurement)."
)


# Long errors that have a short name (docs/planning.md explains each).
_KNOWN = {
    "failed to transfer to 'tpu'": "a host tensor copied into the graph while lowering needs a chip (PjRt client)",
    "PjRt client": "needs a chip to lower (PjRt client)",
    "plugin version": "StableHLO newer than libtpu's compile-only plugin takes",
}


def load_rows(path: Path | str = ROWS) -> dict[str, dict]:
    """The saved rows by architecture ({} when there are none)."""
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def cell(row: dict | None) -> str:
    """The table cell of a row: ``compiles, 41 µs``, ``**no**: <why>``, or empty without a row."""
    if not row:
        return ""
    if row.get("compiled"):
        return f"compiles, {row['step_us']:.0f} µs"
    error = row.get("error") or ""
    for known, short in _KNOWN.items():
        if known in error:
            error = short
            break
    return "**no**: " + error.replace("|", "\\|")[:90]


def fast_path_archs() -> list[str]:
    """The architectures docs/architectures.md lists on hf_tpu's fast path."""
    found = []
    for line in DOCS_PAGE.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 8 and cells[2] == "fast path":
            found.append(cells[0])
    return found


def headline(text: str) -> str:
    """The line of an error that says what failed (Dynamo's "backend='tpu' raised:" wrapper line skipped)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    useful = [line for line in lines if not line.endswith("raised:") and not line.startswith("While executing")]
    return (useful or lines or [""])[0][:200]


def lower_many(session, models: dict[str, str], **kwargs: Any) -> dict[str, Any]:
    """Lowering-process entry: generate's warm-up for each ``arch -> model directory`` in turn; a failure is that
    architecture's, and the next one goes on. Labels name each program ``arch/program``."""
    from hf_tpu.tpu_compile import lower_generate

    labels: list[str] = []
    errors: dict[str, str] = {}
    import torch

    for arch, path in models.items():
        # Dynamo's caches start afresh: a model of the class just lowered could reuse its programs (the freed model's
        # id matches the new one's), and this architecture would lower nothing of its own.
        torch._dynamo.reset()
        before = len(session.programs)
        try:
            info = lower_generate(session, path, **kwargs)
            names = info.get("labels") or []
        except Exception as exc:  # noqa: BLE001 - one architecture's failure is its row
            errors[arch] = headline(f"{type(exc).__name__}: {exc}")
            names = []
        made = len(session.programs) - before
        names = names if len(names) == made else [f"graph-{k}" for k in range(made)]
        labels += [f"{arch}/{n}" for n in names]
    return {"labels": labels, "errors": errors}


def measure_many(archs: list[str], target: str = "v6e-1") -> dict[str, dict]:
    """Rows for ``archs``, lowered in one process and compiled in another (see the module doc)."""
    from hf_tpu.benchmarks._tiny_configs import tiny_config
    from hf_tpu.tpu_compile import lower_and_compile
    from hf_tpu.tpu_compile.plan import Plan

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for arch in archs:
            rows[arch] = {"arch": arch, "target": target, "compiled": False}
            try:
                tiny_config(arch).save_pretrained(f"{tmp}/{arch}")
                models[arch] = f"{tmp}/{arch}"
            except Exception as exc:  # noqa: BLE001 - a config that does not save is the row
                rows[arch]["error"] = headline(f"{type(exc).__name__}: {exc}")
        kwargs = {"dtype": "float32", "max_prompt_len": 16, "max_new_tokens": 8}
        try:
            result = lower_and_compile(f"{__name__}:lower_many", {"models": models, **kwargs}, target)
        except RuntimeError as exc:  # the lowering process died (a crash): each architecture on its own
            if len(archs) == 1:
                rows[archs[0]]["error"] = str(exc).splitlines()[0]
                return rows
            for arch in archs:
                rows.update(measure_many([arch], target))
            return rows
    for arch, error in (result.info.get("errors") or {}).items():
        rows[arch]["error"] = error
    if result.error:  # the entry itself failed: nothing per architecture to tell
        for arch in models:
            rows[arch].setdefault("error", headline(result.error))
    by_arch: dict[str, list] = {}
    for program in result.programs:
        arch, _, name = program.name.partition("/")
        program.name = name
        by_arch.setdefault(arch, []).append(program)
    for arch, programs in by_arch.items():
        decodes = [p for p in programs if "decode" in p.name]
        chosen = decodes[-1] if decodes else programs[-1]
        if chosen.compiled:
            plan = Plan(result.target, arch, True, {}, programs)
            rows[arch].update(compiled=True, program=chosen.name, step_us=plan.step_seconds(chosen) * 1e6,
                              bytes_accessed=chosen.bytes_accessed, flops=chosen.flops)  # fmt: skip
            rows[arch].pop("error", None)
        else:
            rows[arch]["error"] = headline(chosen.error or "not compiled")
    for arch in models:
        if arch not in by_arch and "error" not in rows[arch]:
            rows[arch]["error"] = "nothing was lowered"
    return rows


def measure(arch: str, target: str = "v6e-1") -> dict[str, Any]:
    """One architecture's row."""
    return measure_many([arch], target)[arch]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", nargs="+", default=None, help="architectures (default: every fast-path one)")
    parser.add_argument("--target", default="v6e-1", help="TPU target (default: v6e-1)")
    parser.add_argument("--rows", default=str(ROWS), help=f"rows file (default: {ROWS})")
    parser.add_argument("--resume", action="store_true", help="measure only architectures without a row")
    parser.add_argument("--write-docs", action="store_true", help="put the column into docs/architectures.md")
    parser.add_argument("--chunk", type=int, default=12, help="architectures per lowering process (default: 12)")


def run(args: argparse.Namespace) -> dict:
    rows = load_rows(args.rows) if (args.resume or args.write_docs) else {}
    archs = args.archs or fast_path_archs()
    todo = [a for a in archs if not (args.resume and a in rows)]
    for start in range(0, len(todo), max(1, args.chunk)):
        found = measure_many(todo[start : start + max(1, args.chunk)], args.target)
        for arch, row in found.items():
            rows[arch] = row
            print(f"{arch:<28} {cell(row)}", flush=True)
        if args.rows:
            Path(args.rows).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    if args.write_docs:
        write_docs(rows)
    measured = [rows[a] for a in archs if a in rows]
    compiled = sum(1 for r in measured if r.get("compiled"))
    return {"architectures": len(measured), "compiled": compiled, "rows": measured}


def write_docs(rows: dict[str, dict]) -> None:
    """Put (or refresh) the compile column in docs/architectures.md's table, from ``rows``."""
    out = []
    text = DOCS_PAGE.read_text()
    for line in text.splitlines():
        if line.startswith("| architecture |") and COMPILE_NOTE not in text:
            out += [COMPILE_NOTE, ""]
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] if line.startswith("|") else []
        if len(cells) in (8, 9):
            base = cells[:8]
            if base[0] == "architecture":
                extra = COLUMN
            elif set(base[0]) <= {"-"}:
                out.append("|" + "---|" * 9)  # as arch_sweep writes it
                continue
            else:
                extra = cell(rows.get(base[0])) if base[2] == "fast path" else ""
            line = "| " + " | ".join(base + [extra]) + " |"
        out.append(line)
    DOCS_PAGE.write_text("\n".join(out) + "\n")


def print_table(figures: dict) -> None:
    for row in figures["rows"]:
        print(f"{row['arch']:<28} {cell(row)}")
    print(f"{figures['compiled']} of {figures['architectures']} decode programs compiled for the target "
          "(projected steps: the compiler's estimate, not measurements)")  # fmt: skip
