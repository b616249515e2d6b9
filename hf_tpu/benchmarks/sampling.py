"""Benchmark: sampling on the device against sampling on the host, per decode step, side by side in one run.

A tiny model body (one layer, hidden 32) with Qwen3's vocabulary (151,936 tokens), so that the last logits row is
as large as a real chat model's. For batch 1, 16 and 64 it measures, per decode step (a long and a short
generation differenced, divided by the extra steps):

- greedy search (the argmax in the graph, as before);
- sampling with Qwen3's defaults (``do_sample``, temperature 0.6, top-p 0.95, top-k 20) on the *host path*
  (``configure(model, device_sampling=False)``: the last logits row comes back, upstream's warpers, softmax and
  ``multinomial`` run on the CPU; what hf_tpu did before) and on the *device path* (the warpers and the sampler in
  the compiled decode graph);

with the simulated device's counters: host<->device copies and bytes, and the host time spent choosing the tokens
(the loop's ``_select``: the copy back plus, on the host path, the processors and the sampler). Target: the device
path moves at most 1 copy each way and 64 bytes per sequence back per step. Run::

    hf-tpu bench sampling                       # batches 1, 16, 64; 12 decode steps measured
    hf-tpu bench sampling --quick               # batches 1, 16; 4 steps
    python benchmarks/sampling.py [same options]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__all__ = ["QUICK", "add_arguments", "print_table", "run"]

QUICK = {"batches": [1, 16], "steps": 4}
QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
VOCAB = 151_936


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=12, help="decode steps measured (long run minus short run)")
    parser.add_argument("--prompt", type=int, default=12, help="prompt length")
    parser.add_argument("--vocab", type=int, default=VOCAB)


def _per_step(model, ids, kwargs, steps: int) -> dict:
    import torch

    import hf_tpu.sim
    from hf_tpu.transformers.generation import timed_host_steps

    short, long = 2, 2 + steps
    for n in (short, long):  # compile what these need first
        torch.manual_seed(0)
        model.generate(ids, max_new_tokens=n, eos_token_id=None, **kwargs)
    runs = []
    for n in (short, long):
        torch.manual_seed(0)
        with hf_tpu.sim.stats() as s, timed_host_steps() as host:
            model.generate(ids, max_new_tokens=n, eos_token_id=None, **kwargs)
        runs.append((s, host[0]))
    (a, ta), (b, tb) = runs
    return {
        "h2d": (b.h2d_copies - a.h2d_copies) / steps,
        "d2h": (b.d2h_copies - a.d2h_copies) / steps,
        "d2h_bytes_per_seq": (b.d2h_bytes - a.d2h_bytes) / steps / ids.shape[0],
        "host_ms": 1000 * (tb - ta) / steps,
        "compiles": b.compiles,
    }


def run(args: argparse.Namespace) -> dict:
    """Measure greedy, host-path sampling and device-path sampling for each batch size.

    Returns ``{"vocab", "steps", "rows": [{"batch", "greedy" | "host" | "device": {h2d, d2h, d2h_bytes_per_seq,
    host_ms, compiles}}], "targets_met"}``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)  # doctest: +SKIP
        >>> run(p.parse_args(["--batches", "1", "--steps", "2"]))["rows"][0]["device"]["d2h"]  # doctest: +SKIP
        1.0
    """
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    import hf_tpu
    import hf_tpu.sim
    from hf_tpu.testing import tiny_config
    from hf_tpu.transformers import configure

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    hf_tpu.sim.enable()
    hf_tpu.enable("generation")
    torch.manual_seed(0)
    config = tiny_config("qwen3", vocab_size=args.vocab, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_config(config).eval().to("tpu")
    rows = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, args.vocab, (batch, args.prompt), generator=g)
        row = {"batch": batch}
        print(f"batch {batch}: greedy ...", flush=True)
        row["greedy"] = _per_step(model, ids, {"do_sample": False}, args.steps)
        print(f"batch {batch}: sampling, host path ...", flush=True)
        configure(model, device_sampling=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the host-path warning, expected here
            row["host"] = _per_step(model, ids, QWEN3, args.steps)
        configure(model, device_sampling=True)
        print(f"batch {batch}: sampling, device path ...", flush=True)
        row["device"] = _per_step(model, ids, QWEN3, args.steps)
        rows.append(row)
    ok = all(r["device"]["h2d"] <= 1 and r["device"]["d2h"] <= 1 and r["device"]["d2h_bytes_per_seq"] <= 64
             for r in rows)  # fmt: skip
    return {"vocab": args.vocab, "steps": args.steps, "rows": rows, "targets_met": ok}


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned."""
    print(
        f"\nper decode step, tiny Qwen3 body with a {figures['vocab']:,}-token vocabulary, {figures['steps']} steps "
        "measured; sampling with Qwen3's defaults (temperature 0.6, top-p 0.95, top-k 20)\n"
    )
    print(
        "| batch | mode | host->device copies | device->host copies | bytes back per sequence | host ms choosing "
        "tokens | host / device |\n|---|---|---|---|---|---|---|"
    )
    for r in figures["rows"]:
        for mode, label in (("greedy", "greedy"), ("host", "sampling, host path (before)"),
                            ("device", "sampling, device path")):  # fmt: skip
            m = r[mode]
            ratio = ""
            if mode == "host":
                d = r["device"]
                ratio = f"{m['d2h_bytes_per_seq'] / max(d['d2h_bytes_per_seq'], 1):,.0f}x bytes, " + (
                    f"{m['host_ms'] / d['host_ms']:.1f}x time" if d["host_ms"] > 0 else "-"
                )
            print(
                f"| {r['batch']} | {label} | {m['h2d']:.2f} | {m['d2h']:.2f} | {m['d2h_bytes_per_seq']:,.0f} | "
                f"{m['host_ms']:.2f} | {ratio} |"
            )
    status = "ok" if figures["targets_met"] else "missed"
    print(f"\ntarget (device path: <= 1 copy each way, <= 64 bytes back per sequence per step): {status}")
    print(
        "note: on the simulator the device's work runs on the same CPU, so only the host-side figures (copies, "
        "bytes, the time spent choosing tokens on the host) carry over to a TPU; there each host-path step is also a "
        "PCIe round trip of the bytes above."
    )
