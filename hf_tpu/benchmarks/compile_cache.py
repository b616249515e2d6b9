"""Benchmark: compile once, ever. The persistent compile cache and the ladders, side by side in one run.

1. *warm-up, cold vs from the cache*: two fresh processes run ``hf_tpu.warmup(model, max_prompt_len=...,
   cache_dir=...)`` on the same tiny Llama and cache directory, then one ``generate`` compared with CPU: graphs
   compiled, graphs loaded from the cache, seconds;
2. *ladders*: for prompts uniform in [1, 2048] and ``max_new_tokens`` 16, 128 and 512, through ``plan_shapes``:
   the share of prefill tokens that are padding, the share of static-cache slots no token occupies, and the graphs
   one batch size needs; the earlier ladder (powers of two for prompts and caches) against the default one;
3. *decode cost per step*: one decode step run eagerly on the simulated device for the cache lengths those
   ladders give sampled prompts: device ops and device bytes touched (inputs plus outputs of every op).

Targets (printed as "missed" when not met): 0 compiles in the warm-up from the cache, in well under half the cold
time, 0 compiles in the ``generate`` after it, equal to CPU; padding at most 12%, unused cache slots at most 25%,
at most 32 graphs. Run::

    hf-tpu bench compile_cache                       # warm-up up to 512 (12 graphs)
    hf-tpu bench compile_cache --quick               # warm-up up to 64
    python benchmarks/compile_cache.py [options]     # from a checkout
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from hf_tpu.errors import HfTpuRuntimeError

__all__ = ["QUICK", "add_arguments", "print_table", "run", "verdict"]

QUICK = {"max_prompt": 64, "samples": 4}
TARGETS = {"padding": 0.12, "unused_cache": 0.25, "graphs": 32, "warm_ratio": 0.5}
NEW_TOKENS = (16, 128, 512)

# its targets compare float32 results with the CPU's exactly: run at float32 matmul precision 'highest'
EXACT_FLOAT32 = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--max-prompt", type=int, default=512, help="warm-up max_prompt_len (default: 512)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="warm-up max_new_tokens (default: 16)")
    parser.add_argument("--samples", type=int, default=8, help="prompt lengths sampled for the decode cost")
    parser.add_argument("--seed", type=int, default=0)


def _child(model_dir: str, cache_dir: str, max_prompt: int, new_tokens: int) -> dict:
    """One fresh process: warm-up with the cache, then one generate compared with CPU (printed as JSON)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    import hf_tpu
    import hf_tpu.sim

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    hf_tpu.sim.enable()
    hf_tpu.enable("generation")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval().to("tpu")
    start = time.perf_counter()
    with hf_tpu.sim.stats() as warm:
        report = hf_tpu.warmup(
            model, max_prompt_len=max_prompt, batch_sizes=[1], max_new_tokens=new_tokens, cache_dir=cache_dir
        )
    seconds = time.perf_counter() - start
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, max(1, max_prompt - 3)), generator=g)
    with hf_tpu.sim.stats() as gen:
        got = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=None)
    cpu = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = cpu.generate(ids, max_new_tokens=new_tokens, eos_token_id=None)
    return {
        "graphs": len(report.graphs), "compiles": warm.compiles, "from_cache": warm.compile_cache_hits,
        "seconds": seconds, "generate_compiles": gen.compiles, "equal_cpu": bool(torch.equal(got, expected)),
        "problems": report.cache_problems,
    }  # fmt: skip


def _spawn(model_dir: Path, cache_dir: Path, args: argparse.Namespace) -> dict:
    code = (
        "import json, sys; from hf_tpu.benchmarks.compile_cache import _child; "
        "print(json.dumps(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_COMPILE_CACHE"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", code, str(model_dir), str(cache_dir), str(args.max_prompt), str(args.max_new_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise HfTpuRuntimeError(f"the warm-up process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _byte_counter():
    """A dispatch mode that counts aten ops and the bytes of their tensor inputs and outputs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
            return out

    return Count()


def _decode_cost(model, cache_len: int) -> dict:
    """Ops and bytes touched by one eager decode step (batch 1) over a static cache of ``cache_len`` slots."""

    from hf_tpu.transformers.generation import eager_decode_step

    step = eager_decode_step(model, cache_len)
    step()  # meet every op once
    counter = _byte_counter()
    with counter:
        step()
    return {"ops": counter.ops, "bytes": counter.bytes}


def run(args: argparse.Namespace) -> dict:
    """Measure the cache (two fresh processes) and both ladders. Returns the figures as plain data."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_tpu.sim
    from hf_tpu.testing import tiny_model
    from hf_tpu.transformers import configure
    from hf_tpu.transformers.buckets import BucketLadder
    from hf_tpu.transformers.generation import ladder_figures, plan_shapes

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    hf_tpu.sim.enable()
    with tempfile.TemporaryDirectory(prefix="hf-tpu-bench-cache-") as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        sizes = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128}
        tiny_model("llama", model_dir, max_position_embeddings=4096, **sizes)
        print(f"warm-up (max_prompt_len={args.max_prompt}) in a fresh process, empty cache ...", flush=True)
        cold = _spawn(model_dir, Path(tmp) / "cache", args)
        print("warm-up in a second fresh process, same cache ...", flush=True)
        warm = _spawn(model_dir, Path(tmp) / "cache", args)

        ladders = {}
        cost = {}
        samples = random.Random(args.seed).sample(range(1, 2049), args.samples)
        for name in ("old", "new"):
            model = AutoModelForCausalLM.from_pretrained(model_dir).eval().to("tpu")
            if name == "old":
                configure(model, buckets=BucketLadder.powers_of_two(16, 4096), cache_multiple=None)
            ladders[name] = {n: ladder_figures(model, range(1, 2049), n) for n in NEW_TOKENS}
            lengths = [plan_shapes(model, 1, p, 128).cache_bucket for p in samples]
            per_len = {c: _decode_cost(model, c) for c in sorted(set(lengths))}
            cost[name] = {
                "cache_lengths": lengths,
                "ops": sum(per_len[c]["ops"] for c in lengths) / len(lengths),
                "bytes": sum(per_len[c]["bytes"] for c in lengths) / len(lengths),
            }
            del model

    missed = []
    if warm["compiles"] != 0:
        missed.append("compiles in the warm-up from the cache")
    # A time ratio depends on the machine's load: a timing target, reported as "missed" without failing the run.
    timing_missed = []
    if not cold["seconds"] or warm["seconds"] / cold["seconds"] >= TARGETS["warm_ratio"]:
        timing_missed.append("warm-up from the cache not under half the cold time")
    if warm["generate_compiles"] != 0 or not (warm["equal_cpu"] and cold["equal_cpu"]):
        missed.append("generate after the cached warm-up compiled or differed from CPU")
    for n, f in ladders["new"].items():
        for key in ("padding", "unused_cache", "graphs"):
            if f[key] > TARGETS[key]:
                missed.append(f"{key} with max_new_tokens={n}")
    return {
        "max_prompt": args.max_prompt,
        "max_new_tokens": args.max_new_tokens,
        "cold": cold,
        "warm": warm,
        "ladders": {name: {str(n): f for n, f in figs.items()} for name, figs in ladders.items()},
        "decode_cost": cost,
        "decode_samples": samples,
        "missed": missed + timing_missed,
        "timing_missed": timing_missed,
        "targets_met": not missed,
    }


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned, with "missed" next to every target not met."""
    cold, warm = figures["cold"], figures["warm"]

    def mark(ok: bool) -> str:
        return "" if ok else "  missed"

    print(f"\nwarm-up, max_prompt_len={figures['max_prompt']}, max_new_tokens={figures['max_new_tokens']}, batch 1:\n")
    print("| | cold (empty cache) | from the cache | cache / cold |\n|---|---|---|---|")
    ratio = warm["seconds"] / cold["seconds"] if cold["seconds"] else float("inf")
    print(f"| graphs compiled | {cold['compiles']} | {warm['compiles']} |{mark(warm['compiles'] == 0)} |")
    print(f"| graphs loaded from the cache | {cold['from_cache']} | {warm['from_cache']} | |")
    print(f"| seconds | {cold['seconds']:.1f} | {warm['seconds']:.1f} | {ratio:.2f}{mark(ratio < 0.5)} |")
    gen_ok = warm["generate_compiles"] == 0 and warm["equal_cpu"] and cold["equal_cpu"]
    print(
        f"| generate afterwards: compiles, equal to CPU | {cold['generate_compiles']}, {cold['equal_cpu']} | "
        f"{warm['generate_compiles']}, {warm['equal_cpu']} |{mark(gen_ok)} |"
    )
    for problem in warm["problems"] + cold["problems"]:
        print(f"cache problem reported: {problem}")

    print("\nladders, prompts uniform in [1, 2048], batch 1 (through plan_shapes):\n")
    print("| max_new_tokens | ladder | padding (target <= 12%) | unused cache slots (<= 25%) | graphs (<= 32) |")
    print("|---|---|---|---|---|")
    for n in NEW_TOKENS:
        for name, label in (("old", "powers of two"), ("new", "default")):
            f = figures["ladders"][name][str(n)]
            flags = ""
            if name == "new":
                flags = mark(f["padding"] <= 0.12) + mark(f["unused_cache"] <= 0.25) + mark(f["graphs"] <= 32)
            print(
                f"| {n} | {label} | {100 * f['padding']:.1f}% | {100 * f['unused_cache']:.1f}% | "
                f"{f['graphs']} |{flags}"
            )
    old, new = figures["decode_cost"]["old"], figures["decode_cost"]["new"]
    print(f"\ndecode cost per step, max_new_tokens=128, {len(old['cache_lengths'])} sampled prompt lengths:\n")
    print("| | powers of two | default | default / old |\n|---|---|---|---|")
    print(f"| mean cache length | {sum(old['cache_lengths']) / len(old['cache_lengths']):.0f} | "
          f"{sum(new['cache_lengths']) / len(new['cache_lengths']):.0f} | |")  # fmt: skip
    print(f"| device ops | {old['ops']:.0f} | {new['ops']:.0f} | {new['ops'] / old['ops']:.2f} |")
    print(f"| device bytes touched | {old['bytes']:.0f} | {new['bytes']:.0f} | {new['bytes'] / old['bytes']:.2f} |")
    print("\n" + verdict(figures))


def verdict(figures: dict) -> str:
    """The closing line, in the words of ``hf-tpu bench``'s summary: ``targets met`` only when every target, timing
    included, is met (the summary says ``ok``); a timing target alone missed is ``missed`` too (the summary's
    ``missed``, exit status 0), a count target ``targets missed`` (exit status 1)."""
    timing = figures["timing_missed"]
    counts = [m for m in figures["missed"] if m not in timing]
    if counts:
        return "targets missed: " + "; ".join(figures["missed"])
    if timing:
        return "count targets met; missed (a timing target, which follows the host's load): " + "; ".join(timing)
    return "targets met"
