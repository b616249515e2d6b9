"""Benchmark: does each causal-LM architecture of the installed transformers run well on a TPU (the simulator)?

For every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a tiny random model is built from its config class
(defaults shrunk: hidden 64, 4 layers, 4 experts, 128 tokens of vocabulary, made consistent by the rules of
:mod:`hf_tpu.benchmarks._tiny_configs`), saved, loaded back with ``device_map="tpu"`` after ``hf_tpu.enable()`` on
the simulated device, and greedy ``generate`` runs for two prompt lengths in one bucket against the same model on
the CPU. Per architecture:

- *fast path*: whether hf_tpu's bucketed, compiled loop ran, or the reason ``generate`` gave for upstream's loop
  (a class with a ``generate`` of its own, which never reaches hf_tpu's loop, gets its prompts on the TPU as its
  user would put them, and that reason);
- *identical*: both generations token-identical to the CPU's;
- *compiles* and *new signatures* for the second prompt length (new eager op shapes: each one an op compile on
  torch_tpu);
- *copies per step*: host->device and device->host copies per decode step (a long and a short run differenced).

Architectures run in worker processes (``--jobs`` at once); one that crashes its worker or runs past ``--timeout``
becomes a row, and the sweep goes on. ``--rows PATH`` appends each row to PATH as it is measured; with ``--resume``
a stopped run goes on from PATH (only architectures without a row there are measured). ``--write-docs`` writes the
table to docs/architectures.md. Run::

    hf-tpu bench arch_sweep                              # every architecture
    hf-tpu bench arch_sweep --archs llama qwen3_moe      # some of them
    python benchmarks/arch_sweep.py --write-docs         # from a checkout: regenerate docs/architectures.md
    python benchmarks/arch_sweep.py --rows /tmp/rows.jsonl --resume --write-docs   # stopped? run it again

A command line it cannot run (an unknown architecture, ``--resume`` without ``--rows``) ends it with ``SystemExit``
and the message, as argparse does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hf_tpu.benchmarks import arch_compile
from hf_tpu.benchmarks._tiny_configs import SHRINK, VOCAB, build_model, tiny_config

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__all__ = [
    "QUICK",
    "SHRINK",
    "add_arguments",
    "architectures",
    "measure",
    "print_table",
    "rows_from_docs",
    "run",
    "sweep",
    "tiny_config",
]

# --quick: a dense and an MoE architecture, fewer tokens.
QUICK = {"archs": ["llama", "qwen3_moe"], "new_tokens": 8}
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
LENGTHS = (5, 11)  # two prompt lengths in one prompt bucket (16)

# the heading of the image-text-to-text sweep's section of the page (hf_tpu/benchmarks/vlm_sweep.py writes it)
VLM_SECTION = "## Image-text-to-text architectures"

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# its targets compare float32 results with the CPU's exactly: run at float32 matmul precision 'highest'
EXACT_FLOAT32 = True


def architectures() -> list[str]:
    """The model types with a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _kinds(config: Any) -> str:
    try:
        return _kinds_of(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config that refuses a global attribute: no kind named
        return ""


def _kinds_of(config: Any) -> str:
    kinds = []
    layer_types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "sliding_window", None) or "sliding_attention" in layer_types:
        kinds.append("sliding")
    if layer_types - {"full_attention", "sliding_attention", "attention", "indexed_attention"} or hasattr(
        config, "state_size"
    ):
        kinds.append("linear/SSM")
    if "indexed_attention" in layer_types:
        kinds.append("sparse indexer")
    if any(_per_layer(config, "kv_lora_rank")):
        kinds.append("MLA")
    if any((v or 0) > 1 for f in _EXPERT_FIELDS for v in _per_layer(config, f)):
        kinds.append("MoE")
    if getattr(config, "is_encoder_decoder", False):
        kinds.append("enc-dec")
    return ", ".join(kinds) or "full attention"


def _per_layer(config: Any, name: str) -> list:
    """``config``'s ``name`` for each of its layers where a heterogeneous config sets it per layer (upstream
    refuses to read such a field globally), else its one value."""
    try:
        return [getattr(config, name, None)]
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError: read it per layer
        return [getattr(layer, name, None) for layer in config.per_layer_config]


def _prompt(length: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=g)


def _per_step(long: Any, short: Any, steps: int) -> tuple[float, float]:
    return (long.h2d_copies - short.h2d_copies) / steps, (long.d2h_copies - short.d2h_copies) / steps


def measure(model_type: str, new_tokens: int = 20, workdir: str | None = None, config: Any = None) -> dict:
    """One architecture's row (see the module docstring); raises only for a failure outside the model.

    ``config``: a ready config instead of :func:`tiny_config`'s.
    """
    import hf_tpu
    import hf_tpu.sim

    hf_tpu.sim.enable()
    with hf_tpu.enabled():  # as a user's hf_tpu.enable(); what this call enabled is reverted after
        return _measure(model_type, new_tokens, workdir, config)


def _measure(model_type: str, new_tokens: int, workdir: str | None, config: Any) -> dict:
    import warnings

    import torch

    import hf_tpu.sim
    from hf_tpu.transformers import explain, generation
    from hf_tpu.transformers.route import own_generate

    row: dict[str, Any] = {"arch": model_type}
    try:
        config = config if config is not None else tiny_config(model_type)
        row["kind"] = _kinds(config)
        torch.manual_seed(0)
        model = build_model(model_type, config)
    except Exception as e:  # noqa: BLE001 - any failure to build is this architecture's verdict
        row.update(status="not buildable", reason=f"{type(e).__name__}: {_line(e)}")
        return row
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            model.save_pretrained(tmp)
            # the built class loads its own checkpoint (a text sub-config's model type may have no auto mapping)
            cpu = type(model).from_pretrained(tmp).eval()
            tpu = type(model).from_pretrained(tmp, device_map="tpu").eval()
        except Exception as e:  # noqa: BLE001
            row.update(status="not loadable", reason=f"{type(e).__name__}: {_line(e)}")
            return row
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    prompts = [_prompt(n, seed) for seed, n in enumerate(LENGTHS)]
    # a class with a generate of its own runs upstream's code, not hf_tpu's loop (which takes host inputs): its
    # prompts go on the model's device, as its user would put them
    own = own_generate(tpu)
    on_tpu = [ids.to(tpu.device) for ids in prompts] if own else prompts
    try:
        expected = [cpu.generate(ids, max_new_tokens=new_tokens, **kw) for ids in prompts]
    except Exception as e:  # noqa: BLE001 - upstream fails on the CPU too: not a TPU problem
        row.update(status="fails on CPU", reason=f"{type(e).__name__}: {_line(e)}")
        return row
    stage = "first prompt length"
    reads = len(hf_tpu.sim.host_reads())
    try:
        with warnings.catch_warnings():  # the route below says what generate's notes say
            warnings.simplefilter("ignore")
            runs = []
            for ids in on_tpu:
                with hf_tpu.sim.stats() as s:
                    got = tpu.generate(ids, max_new_tokens=new_tokens, **kw)
                runs.append((got, s))
                stage = "second prompt length"
            stage = "short run"
            with hf_tpu.sim.stats() as short:
                tpu.generate(on_tpu[1], max_new_tokens=2, **kw)
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"{stage}: {type(e).__name__}: {_line(e)}")
        return row
    identical = all(torch.equal(got.cpu(), want) for (got, _), want in zip(runs, expected, strict=True))
    # the route the calls took, after what their first traces found (hf_tpu.transformers.explain)
    route = explain(tpu, input_ids=prompts[1], max_new_tokens=new_tokens, **kw)
    graphs = generation.compiled_graphs(tpu)
    fast = route.fast and bool(graphs)
    notes = []
    if fast and route.loop == "cacheless":  # hf_tpu's loop without a cache: "no cache", with the reason it names
        notes.append("no cache" + (f": {route.reason}" if route.warn else ""))
    if fast and route.host_sampling:  # the processors on the host: one logits row back per step (the copy targets)
        notes.append(f"host sampling: {route.host_sampling}")
    refused = host_read_note(hf_tpu.sim.host_reads()[reads:])
    if fast and refused:
        notes.append(refused)
    second = runs[1][1]
    h2d, d2h = _per_step(second, short, new_tokens - 2)
    row.update(
        status="fast path" if fast else "upstream loop",
        reason="; ".join(notes) if fast else (route.reason if not route.fast else "no graph compiled"),
        identical=identical,
        compiles_2nd=second.compiles,
        signatures_2nd=second.shape_signatures,
        h2d_per_step=round(h2d, 2),
        d2h_per_step=round(d2h, 2),
        host_reads=len(hf_tpu.sim.host_reads()) - reads,
    )
    return row


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:200]


# ---- the sweep: workers, each architecture isolated ------------------------------------------------------------


def _worker(archs: list[str], new_tokens: int, measure_one: Any = None) -> None:
    """Measure ``archs`` in turn (with ``measure_one``, default :func:`measure`: another sweep's), printing
    ``START name`` before and ``ROW {json}`` after each one."""
    for arch in archs:
        print(f"START {arch}", flush=True)
        try:
            row = (measure_one or measure)(arch, new_tokens)
        except Exception as e:  # noqa: BLE001
            row = {"arch": arch, "status": "error", "reason": f"{type(e).__name__}: {_line(e)}"}
        print("ROW " + json.dumps(row), flush=True)


def _record(rows: dict, row: dict, log: Any, rows_file: str | None) -> None:
    rows[row["arch"]] = row
    print(_one_line(row), file=log, flush=True)
    if rows_file:
        with open(rows_file, "a") as f:
            f.write(json.dumps(row) + "\n")


def _supervise(
    archs: list[str], new_tokens: int, timeout: float, rows: dict, log: Any, rows_file: str | None = None,
    module: str = __name__,
) -> None:
    """Run ``archs`` in worker processes (``python -m module --worker``); a worker that dies or hangs on one is
    replaced for the rest."""
    todo = list(archs)
    while todo:
        cmd = [sys.executable, "-m", module, "--worker", str(new_tokens), *todo]
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        err: list[str] = []
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        current, started, seen = None, time.monotonic(), 0
        while True:
            time.sleep(0.2)
            while seen < len(lines):
                line = lines[seen].rstrip("\n")
                seen += 1
                if line.startswith("START "):
                    current, started = line[6:], time.monotonic()
                elif line.startswith("ROW "):
                    row = json.loads(line[4:])
                    todo.remove(row["arch"])
                    _record(rows, row, log, rows_file)
                    current = None
            if current is not None and time.monotonic() - started > timeout:
                proc.kill()
                proc.wait()
                todo.remove(current)
                timed_out = {"arch": current, "status": "timeout", "reason": f"over {timeout:.0f} s"}
                _record(rows, timed_out, log, rows_file)
                break
            if proc.poll() is not None and not reader.is_alive():
                if current is not None and current in todo:
                    tail = "".join(err).strip().splitlines()
                    todo.remove(current)
                    reason = f"worker exited with {proc.returncode}: {(tail[-1] if tail else '')[:200]}"
                    _record(rows, {"arch": current, "status": "crash", "reason": reason}, log, rows_file)
                break


def sweep(
    archs: list[str],
    new_tokens: int = 20,
    jobs: int = 1,
    timeout: float = 600,
    log: Any = None,
    rows_file: str | None = None,
    module: str = __name__,
) -> list[dict]:
    """Rows for ``archs``, measured in ``jobs`` worker processes at once, in ``archs``' order (each row also
    appended to ``rows_file`` as a JSON line as soon as it is measured). ``module``: the sweep whose ``--worker``
    measures them (another sweep reuses these workers: :mod:`hf_tpu.benchmarks.vlm_sweep`)."""
    rows: dict[str, dict] = {}
    log = log or sys.stderr
    shares = [archs[i::jobs] for i in range(max(1, jobs))]
    threads = [
        threading.Thread(target=_supervise, args=(share, new_tokens, timeout, rows, log, rows_file, module))
        for share in shares
        if share
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [rows[a] for a in archs]


# ---- benchmark interface -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--archs", nargs="+", help="model types to run (default: every causal-LM architecture)")
    parser.add_argument("--new-tokens", type=int, default=20, help="greedy tokens per generation")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at once")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one architecture may take")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table to {DOCS_PAGE.name} in docs/")
    parser.add_argument("--rows", metavar="PATH", help="append each row to PATH as a JSON line when measured")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="with --rows: measure only the architectures that have no row in PATH yet (a stopped run goes on); "
        "the table holds PATH's rows and the new ones",
    )
    parser.add_argument(
        "--from-rows",
        metavar="PATH",
        nargs="+",
        help="measure nothing: take the rows of earlier runs' --rows files (the first row of an architecture wins; "
        "one not in them is 'not measured'); the word 'docs' stands for the rows of the table docs/architectures.md "
        "holds now (so 'NEW.jsonl docs' adds new rows to the page and keeps every other row as it is)",
    )


def run(args: argparse.Namespace) -> dict:
    """Sweep; returns ``{"rows": [...], "summary": {...}, "command": str}`` (and writes the docs page if asked)."""
    archs = args.archs or architectures()
    unknown = sorted(set(archs) - set(architectures()))
    if unknown:
        raise SystemExit(f"unknown causal-LM architectures {unknown}; see transformers' MODEL_FOR_CAUSAL_LM_MAPPING")
    if args.resume and not args.rows:
        raise SystemExit("--resume goes with --rows PATH (the rows file of the run to go on with)")
    start = time.monotonic()
    if args.from_rows:
        saved = _saved_rows(args.from_rows)
        missing = {"status": "not measured", "reason": "not reached by the run that made this table"}
        rows = [saved.get(a) or {"arch": a, **missing} for a in archs]
    else:
        saved = _saved_rows([args.rows]) if args.resume and Path(args.rows).exists() else {}
        todo = [a for a in archs if a not in saved]
        fresh = {r["arch"]: r for r in sweep(todo, args.new_tokens, args.jobs, args.timeout, rows_file=args.rows)}
        rows = [saved.get(a) or fresh[a] for a in archs]
    summary = summarize(rows)
    figures = {"rows": rows, "summary": summary, "seconds": round(time.monotonic() - start)}
    figures["targets_met"] = summary["meets_targets"] >= TARGET_SHARE * summary["buildable"]
    figures["command"] = "python benchmarks/arch_sweep.py " + " ".join(
        ([f"--archs {' '.join(archs)}"] if args.archs else [])
        + ([f"--new-tokens {args.new_tokens}"] if args.new_tokens != 20 else [])
        + ["--write-docs"]
    )
    if args.write_docs:  # (the image-text-to-text sweep's section after the table stays: vlm_sweep.py writes it)
        kept = DOCS_PAGE.read_text().partition(VLM_SECTION)[1:] if DOCS_PAGE.exists() else ("", "")
        DOCS_PAGE.write_text(markdown(figures) + ("\n" + "".join(kept) if kept[0] else ""))
        print(f"wrote {DOCS_PAGE}")
    return figures


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def rows_from_docs(path: Path | str = DOCS_PAGE) -> dict[str, dict]:
    """The rows the page's table holds (what :func:`markdown` wrote from them), by architecture: an earlier sweep's
    rows, when its rows files are gone. Writing them back with :func:`markdown` gives the same table rows."""
    import re

    rows: dict[str, dict] = {}
    # (the page above the image-text-to-text sweep's section: its table has as many columns)
    for line in Path(path).read_text().partition(VLM_SECTION)[0].splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) not in (8, 9) or cells[0] in ("architecture", "") or set(cells[0]) <= {"-"}:
            continue
        arch, kind, status, identical, compiles, signatures, copies, reason = cells[:8]
        row: dict = {"arch": arch, "kind": kind, "status": status}
        if identical:
            row["identical"] = identical == "yes"
        if compiles:
            row["compiles_2nd"] = _number(compiles)
        if signatures:
            row["signatures_2nd"] = _number(signatures)
        if copies:
            row["h2d_per_step"], row["d2h_per_step"] = _copies_per_step(copies)
        if reason:
            row["reason"] = reason.replace("\\|", "|")
        rows[arch] = row
    return rows


def _saved_rows(paths: list[str]) -> dict[str, dict]:
    """Architecture -> its row in the ``--rows`` files ``paths`` (the first row of an architecture wins; the path
    ``docs`` is the table docs/architectures.md holds, :func:`rows_from_docs`)."""
    saved: dict[str, dict] = {}
    for path in paths:
        if path == "docs":
            for arch, row in rows_from_docs().items():
                saved.setdefault(arch, row)
            continue
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                saved.setdefault(row["arch"], row)
    return saved


TARGET_SHARE = 0.9  # of the buildable architectures, meeting every target
_UNBUILT = ("not buildable", "not loadable", "fails on CPU", "not measured")


def host_read_note(sites: list[str]) -> str:
    """The reason a row gives for compiled graphs that read a device value on the host (``hf_tpu.sim.host_reads``
    over its calls): torch_tpu refuses to lower them, so on a TPU they do not compile; empty when there are none."""
    if not sites:
        return ""
    where = re.match(r'File "(?:.*/)?([^/"]+)", line (\d+), in (\S+)', sites[0])
    first = f"{where[1]}:{where[2]} in {where[3]}" if where else sites[0]
    return f"{HOST_READ_WORDS} ({len(sites)} graphs; first: {first})"


# The words that start a row's reason when its compiled graphs read a device value on the host: how a row read back
# from the docs table (which keeps no count) is known to miss that target.
HOST_READ_WORDS = "torch_tpu refuses graphs that read a device value on the host"


def misses(row: dict) -> list[str]:
    """The targets a measured, buildable row misses (empty: it meets every one)."""
    if row["status"] != "fast path":
        return [row["status"]]
    missed = [] if row.get("identical") else ["not identical"]
    if row.get("host_reads") or HOST_READ_WORDS in (row.get("reason") or ""):
        missed.append("host reads in compiled graphs")
    if row.get("compiles_2nd") != 0:
        missed.append("compiles")
    if row.get("signatures_2nd", 99) > 4:
        missed.append("> 4 new signatures")
    if max(row.get("h2d_per_step", 9), row.get("d2h_per_step", 9)) > 1:
        missed.append("> 1 copy each way")
    return missed


def summarize(rows: list[dict]) -> dict:
    buildable = [r for r in rows if r["status"] not in _UNBUILT]
    good = [r for r in buildable if not misses(r)]
    return {
        "architectures": len(rows),
        "measured": sum(r["status"] != "not measured" for r in rows),
        "buildable": len(buildable),
        "fast_path": sum(r["status"] == "fast path" for r in rows),
        "meets_targets": len(good),
        "crashes": sum(r["status"] in ("crash", "error", "timeout") for r in rows),
        "not_measured": sum(r["status"] == "not measured" for r in rows),
        "identical": sum(bool(r.get("identical")) for r in rows),
    }


def _copies_per_step(cell: str) -> tuple:
    """The table's copies cell, ``"h2d + d2h"`` (host->device and device->host copies per decode step), as numbers."""
    h2d, _, d2h = cell.partition("+")
    return _number(h2d.strip()), _number(d2h.strip())


def _one_line(row: dict) -> str:
    extra = row.get("reason") or ""
    if "identical" in row:
        copies = f"copies/step={row['h2d_per_step']}+{row['d2h_per_step']} " if "h2d_per_step" in row else ""
        extra = (
            f"identical={row['identical']} compiles={row['compiles_2nd']} sigs={row['signatures_2nd']} {copies}{extra}"
        )
    return f"{row['arch']:<28} {row['status']:<14} {extra}"


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return ""
    if key == "identical":
        return "yes" if value else "**no**"
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown(figures: dict) -> str:
    rows, s = figures["rows"], figures["summary"]
    lines = [
        "# Architectures on the simulated TPU",
        "",
        f"Generated by `{figures['command']}` (hf_tpu/benchmarks/arch_sweep.py; do not edit by hand). Each causal-LM",
        "architecture of the installed transformers, as a tiny random model built from its config class (defaults",
        "shrunk: hidden 64, 4 layers with each layer kind of the default pattern, 2+2 for encoder-decoders, 4",
        "experts, a sliding window of 16 where it has one, as many KV heads as heads for MLA, sub-configs (vision and",
        "audio towers, BLT's models) and per-layer overrides shrunk alike; the rules are in",
        "hf_tpu/benchmarks/_tiny_configs.py), loaded with",
        f"`device_map=\"tpu\"` after `hf_tpu.enable()` on the simulator; greedy `generate` of {_new_tokens(figures)}",
        f"tokens for prompt lengths {LENGTHS[0]} and {LENGTHS[1]} (one bucket), against",
        "the same model on the CPU. *compiles* and *new signatures* (new eager op shapes, each an op compile on",
        "torch_tpu) are those of the second prompt length; *copies/step* are host->device + device->host copies per",
        "decode step. Targets: fast path, identical, 0 compiles, <= 4 new signatures, <= 1 copy each way. A fast-path",
        "row's reason says how it runs when it is not the cached loop: \"no cache\" (hf_tpu's loop without a cache,",
        "docs/generation.md; after the colon, why the cached loop cannot serve it) or \"host sampling\".",
        "",
        f"{s['architectures']} architectures; of the {s['measured']} measured, {s['buildable']} buildable (built, "
        f"loaded and run on the CPU); {s['fast_path']} on hf_tpu's fast path, "
        f"{s['meets_targets']} meeting every target; {s['identical']} token-identical; {s['crashes']} errors, "
        "crashes or timeouts" + (
            f"; {s['not_measured']} not measured (the run stopped before reaching them: regenerate with the command "
            "above)."
            if s.get("not_measured")
            else "."
        ),
        "",
        _target_line(s),
        "",
        *_groups(rows),
        arch_compile.COMPILE_NOTE,
        "",
        "| architecture | kind | status | identical | compiles | new signatures | copies/step | reason "
        f"| {arch_compile.COLUMN} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    compiled = arch_compile.load_rows()
    for r in rows:
        copies = f"{_cell(r, 'h2d_per_step')} + {_cell(r, 'd2h_per_step')}" if "h2d_per_step" in r else ""
        reason = (r.get("reason") or "").replace("|", "\\|")
        lines.append(
            f"| {r['arch']} | {r.get('kind', '')} | {r['status']} | {_cell(r, 'identical')} | "
            f"{_cell(r, 'compiles_2nd')} | {_cell(r, 'signatures_2nd')} | {copies} | {reason} | "
            f"{arch_compile.cell(compiled.get(r['arch'])) if r['status'] == 'fast path' else ''} |"
        )
    return "\n".join(lines) + "\n"


def _target_line(s: dict) -> str:
    share = s["meets_targets"] / s["buildable"] if s["buildable"] else 0.0
    verdict = "met" if share >= TARGET_SHARE else "**missed**"
    return (
        f"Target: at least {TARGET_SHARE:.0%} of the buildable architectures meet every target: "
        f"{s['meets_targets']} of {s['buildable']} measured ({share:.1%}), {verdict}."
        + (f" ({s['not_measured']} not measured are in neither figure.)" if s.get("not_measured") else "")
    )


def _groups(rows: list[dict]) -> list[str]:
    """Bullets: the architectures that miss a target (or were not measured), grouped by why."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        missed = misses(r)
        if not missed:
            continue
        why = ", ".join(missed)
        reason = r.get("reason") or "" if r["status"] not in ("fast path", "not measured") else ""
        if r["status"] == "upstream loop":
            reason = reason.partition(" ")[2]  # without the model class that starts it
        key = f"{why}: {reason.split(' (')[0][:140]}" if reason else why
        groups.setdefault(key, []).append(r["arch"])
    if not groups:
        return []
    lines = ["Architectures that miss a target, by reason:", ""]
    for key, archs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"- {key.replace('|', '/')} ({len(archs)}): {', '.join(archs)}")
    return [*lines, ""]


def _new_tokens(figures: dict) -> int:
    command = figures["command"].split()
    return int(command[command.index("--new-tokens") + 1]) if "--new-tokens" in command else 20


def print_table(figures: dict) -> None:
    for row in figures["rows"]:
        print(_one_line(row))
    s = figures["summary"]
    print(
        f"\n{s['architectures']} architectures, {s['buildable']} buildable, {s['fast_path']} on the fast path, "
        f"{s['meets_targets']} meeting every target, {s['crashes']} errors/crashes/timeouts "
        f"({figures['seconds']} s)"
    )
    print(_target_line(s).replace("**", ""))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[3:], int(sys.argv[2]))
    else:
        from hf_tpu.benchmarks.__main__ import main

        sys.exit(main(["arch_sweep", *sys.argv[1:]]))
