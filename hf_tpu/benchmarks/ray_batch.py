"""Benchmark: batch inference on Ray (:class:`hf_tpu.ray.HfTpuGenerate`) over 1 and 2 simulated TPU VMs.

One local Ray cluster of 2 simulated VMs (:func:`hf_tpu.ray.local.simulated_cluster`, one ``"TPU"`` and one CPU
each), the model shipped with hf_tpu, prompts from its held-out text, one shared compile-cache directory:

1. the job with one actor (an actor pool of 1: one VM works, the other idles), the cache empty: rows/s, and the
   actor's start cost *without* the compile cache (load + warm-up that compiles);
2. the same job with two actors (one per VM), the cache filled by run 1: rows/s, and each actor's start cost *with*
   the compile cache (load + warm-up that loads).

Rows/s are measured from the first row back to the last (the job starts once its actors are up:
``DataContext.wait_for_min_actors_s``), so they compare generation, not start-up. Printed as ratios: rows/s of 2 VMs
over 1 VM, and a warm start over a cold one. Targets (printed as "missed" when not met): every row back once, without
an error, in both runs; 0 graphs compiled by a warm actor; a warm start under half a cold one; 2 VMs at least 1.5x
the rows/s of 1 (a timing target: on a 2-core host both simulated VMs and the driver share the cores). Run::

    hf-tpu bench ray_batch                     # 128 prompts
    hf-tpu bench ray_batch --quick             # 32 prompts, 4 new tokens
    python benchmarks/ray_batch.py [options]   # from a checkout
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__all__ = ["QUICK", "TARGETS", "add_arguments", "print_table", "run"]

QUICK = {"prompts": 32, "max_new_tokens": 4}
TARGETS = {"scaling": 1.5, "warm_start_ratio": 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--prompts", type=int, default=128, help="prompts per job (default: 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per generate call (default: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per row (default: 8)")


def _job(prompts: list[str], actors: int, args: argparse.Namespace, cache_dir: Path, reports: Path) -> dict:
    """One job through ``actors`` actors: rows/s from the first row to the last, rows back, the actors' starts."""
    import ray

    from hf_tpu.assets import default_model_path
    from hf_tpu.ray import HfTpuGenerate

    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    kwargs = {"model": str(default_model_path()), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
              "max_prompt_len": 16, "cache_dir": str(cache_dir), "start_reports": str(reports)}  # fmt: skip
    out = ds.map_batches(HfTpuGenerate, fn_constructor_kwargs=kwargs, batch_size=args.batch_size, num_cpus=0,
                         resources={"TPU": 1}, compute=ray.data.ActorPoolStrategy(size=actors))  # fmt: skip
    rows, first, last = [], None, None
    for row in out.iter_rows():
        last = time.perf_counter()
        first = first or last
        rows.append(row)
    starts = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    return {
        "actors": actors,
        "rows": len(rows),
        "distinct_ids": len({r["id"] for r in rows}),
        "errors": sum(r["error"] is not None for r in rows),
        "rows_per_s": (len(rows) - 1) / (last - first) if len(rows) > 1 and last > first else None,
        "starts": [{k: s[k] for k in ("load_s", "warmup_s", "lock_wait_s", "new_compiles", "from_cache", "graphs")}
                   for s in sorted(starts, key=lambda s: s["lock_wait_s"])],  # fmt: skip
    }


def run(args: argparse.Namespace) -> dict:
    """Run the job on 1 then 2 simulated VMs of one local cluster. Returns the figures as plain data."""
    import ray

    from hf_tpu.ray.local import heldout_prompts, simulated_cluster

    prompts = heldout_prompts(args.prompts)
    with tempfile.TemporaryDirectory(prefix="hf-tpu-bench-ray-") as tmp:
        cache = Path(tmp) / "compile-cache"
        with simulated_cluster(nodes=2):
            ray.data.DataContext.get_current().wait_for_min_actors_s = 1800
            print(f"{len(prompts)} prompts, 1 actor (1 simulated VM), compile cache empty ...", flush=True)
            one = _job(prompts, 1, args, cache, Path(tmp) / "reports-1")
            print(f"{len(prompts)} prompts, 2 actors (2 simulated VMs), compile cache filled ...", flush=True)
            two = _job(prompts, 2, args, cache, Path(tmp) / "reports-2")

    def start_s(s: dict) -> float:
        return s["load_s"] + s["warmup_s"] - s["lock_wait_s"]

    cold = one["starts"][0] if one["starts"] else None
    warm = two["starts"]
    missed, timing_missed = [], []
    for job in (one, two):
        if not (job["rows"] == job["distinct_ids"] == len(prompts)) or job["errors"]:
            missed.append(f"rows of the {job['actors']}-actor job: {job['rows']} back, {job['distinct_ids']} "
                          f"distinct, {job['errors']} with an error, of {len(prompts)}")  # fmt: skip
    if cold is None or len(warm) != 2 or any(s["new_compiles"] for s in warm):
        missed.append("a warm actor compiled (or an actor did not report)")
    scaling = two["rows_per_s"] / one["rows_per_s"] if one["rows_per_s"] and two["rows_per_s"] else None
    warm_ratio = max(start_s(s) for s in warm) / start_s(cold) if cold and warm else None
    if scaling is None or scaling < TARGETS["scaling"]:
        timing_missed.append(f"2 VMs under {TARGETS['scaling']}x the rows/s of 1")
    if warm_ratio is None or warm_ratio >= TARGETS["warm_start_ratio"]:
        timing_missed.append("a warm start not under half a cold one")
    return {
        "prompts": len(prompts),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "one_vm": one,
        "two_vms": two,
        "scaling": scaling,
        "cold_start_s": None if cold is None else start_s(cold),
        "warm_start_s": [start_s(s) for s in warm],
        "warm_start_ratio": warm_ratio,
        "missed": missed + timing_missed,
        "timing_missed": timing_missed,
        "targets_met": not missed,
    }


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned, with "missed" next to every target not met."""

    def flag(ok: bool) -> str:
        return "" if ok else "  missed"

    one, two = figures["one_vm"], figures["two_vms"]
    print(f"\nRay Data batch inference, {figures['prompts']} prompts, batch {figures['batch_size']}, "
          f"{figures['max_new_tokens']} new tokens, simulated TPU VMs")  # fmt: skip
    for job in (one, two):
        ok = job["rows"] == job["distinct_ids"] == figures["prompts"] and not job["errors"]
        print(f"  {job['actors']} actor(s): {job['rows']} rows back ({job['distinct_ids']} distinct, "
              f"{job['errors']} errors){flag(ok)}")  # fmt: skip
    scaling = figures["scaling"]
    shown = "n/a" if scaling is None else f"{scaling:.2f}x"
    met = scaling is not None and scaling >= TARGETS["scaling"]
    print(f"  rows/s, 2 VMs / 1 VM: {shown} (target >= {TARGETS['scaling']}x){flag(met)}")
    for s in one["starts"][:1]:
        print(f"  actor start without the compile cache: {s['new_compiles']} graphs compiled")
    for i, s in enumerate(two["starts"]):
        print(f"  actor start with the compile cache ({i + 1}): {s['new_compiles']} graphs compiled, "
              f"{s['from_cache']} loaded{flag(s['new_compiles'] == 0)}")  # fmt: skip
    ratio = figures["warm_start_ratio"]
    shown = "n/a" if ratio is None else f"{ratio:.2f}"
    print(f"  start with the cache / without (load + warm-up): {shown} (target < {TARGETS['warm_start_ratio']})"
          f"{flag(ratio is not None and ratio < TARGETS['warm_start_ratio'])}")  # fmt: skip
    hard = [m for m in figures["missed"] if m not in figures["timing_missed"]]
    if hard:
        print("targets missed: " + "; ".join(hard))
    elif figures["timing_missed"]:
        print("count targets met; missed (a timing target, which follows the host's load): "
              + "; ".join(figures["timing_missed"]))  # fmt: skip
    else:
        print("targets met")
