"""Training steps on the simulated tpu: eager vs compiled, bucketed vs pad-to-longest, CPU alongside.

    hf-tpu bench training [--steps 12] [--warmup 2] [--hidden 64] [--layers 2] [--batch 4]
    python benchmarks/training.py [same options]   # from a checkout

Every variant trains a copy of the same tiny Llama with AdamW on the same variable-length batches, interleaved step by
step so that machine load hits all alike. Per variant it prints warm steps/s and, after warm-up, compiles and new
eager shape signatures per step (each is a compile on a TPU), and the ratios to the CPU eager step. "pad to longest"
pads each batch to its own longest example (a new shape for each new length); "buckets" pads to (32, 64) with
``hf_tpu.training.BucketingCollator``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

import hf_tpu.sim
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.training import BucketingCollator

__all__ = ["QUICK", "add_arguments", "print_table", "run"]

# --quick: a few steps of a smaller batch (the first two see both buckets and are left out).
QUICK = {"steps": 4, "batch": 2}


def build(hidden: int, layers: int, vocab: int = 512):
    from hf_tpu.testing import tiny_model

    heads = {"num_attention_heads": max(hidden // 16, 1), "num_key_value_heads": max(hidden // 32, 1)}
    return tiny_model(
        "llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
        max_position_embeddings=128, use_cache=False, **heads,
    ).train()  # fmt: skip


def data(steps: int, batch: int, vocab: int = 512) -> list[list[dict]]:
    """Batches alternately of short (8-32 tokens) and long (33-64 tokens) examples."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        low, high = (8, 33) if step % 2 == 0 else (33, 65)
        lengths = torch.randint(low, high, (batch,), generator=g).tolist()
        out.append([{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lengths])
    return out


class Variant:
    def __init__(self, name: str, model, device: str, collate, compiled: bool) -> None:
        self.name, self.device, self.collate = name, device, collate
        self.model = model.to(device)
        self.forward = torch.compile(self.model, backend="tpu", dynamic=False) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.counts: list[dict] = []
        self.losses: list[float] = []

    def step(self, rows: list[dict]) -> None:
        batch = {k: v.to(self.device) for k, v in self.collate(rows).items()}
        t0 = time.perf_counter()
        with hf_tpu.sim.stats() as s:
            loss = self.forward(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad()
            self.losses.append(float(loss.detach().cpu()))
        self.times.append(time.perf_counter() - t0)
        self.counts.append(s.as_dict())


def pad_to_longest(rows: list[dict]) -> dict:
    return BucketingCollator(buckets=(max(len(r["input_ids"]) for r in rows),), return_attention_mask=False)(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the figures (2 see both buckets)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)


def run(a: argparse.Namespace) -> dict:
    """Train every variant on the same batches, interleaved step by step.

    Returns ``{"steps", "batch", "hidden", "layers", "warmup", "variants": [{name, steps_per_s, x_cpu_time,
    compiles_per_step, new_shapes_per_step, warmup_compiles, median_step_s}, ...], "max_loss_difference":
    {name: float}}``; ``x_cpu_time`` is ``median_step_s`` over the CPU variant's (the first one).

    Example:
        >>> run(argparse.Namespace(steps=4, warmup=2, hidden=64, layers=2, batch=2, threads=1))  # doctest: +SKIP
    """
    if a.steps <= a.warmup:
        raise InvalidArgumentError(
            f"--steps ({a.steps}) must be larger than --warmup ({a.warmup}): no step left to measure"
        )
    hf_tpu.sim.enable()
    torch.set_num_threads(a.threads)

    buckets = BucketingCollator(buckets=(32, 64), batch_size=a.batch, return_attention_mask=False)
    batches = data(a.steps, a.batch)  # the first two steps see both buckets

    base = build(a.hidden, a.layers)
    state = {k: v.clone() for k, v in base.state_dict().items()}

    def fresh():
        m = build(a.hidden, a.layers)
        m.load_state_dict(state)
        return m

    variants = [
        Variant("cpu eager, buckets", fresh(), "cpu", buckets, compiled=False),
        Variant("tpu eager, pad to longest", fresh(), "tpu", pad_to_longest, compiled=False),
        Variant("tpu eager, buckets", fresh(), "tpu", buckets, compiled=False),
        Variant("tpu compiled, buckets", fresh(), "tpu", buckets, compiled=True),
    ]
    for rows in batches:
        for v in variants:
            v.step(rows)

    cpu_med = statistics.median(variants[0].times[a.warmup :])
    rows = []
    for v in variants:
        med = statistics.median(v.times[a.warmup :])
        warm = v.counts[a.warmup :]
        rows.append(
            {
                "name": v.name,
                "median_step_s": med,
                "steps_per_s": 1 / med,
                "x_cpu_time": med / cpu_med,
                "compiles_per_step": sum(c["compiles"] for c in warm) / len(warm),
                "new_shapes_per_step": sum(c["shape_signatures"] for c in warm) / len(warm),
                "warmup_compiles": sum(c["compiles"] for c in v.counts[: a.warmup]),
            }
        )
    ref = variants[2].losses
    diffs = {v.name: max(abs(x - y) for x, y in zip(v.losses, ref, strict=True)) for v in variants[3:]}
    return {"steps": len(batches), "batch": a.batch, "hidden": a.hidden, "layers": a.layers, "warmup": a.warmup,
            "variants": rows, "max_loss_difference": diffs}  # fmt: skip


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned."""
    f = figures
    print(f"{f['steps']} steps, batch {f['batch']}, lengths 8-64, hidden {f['hidden']}, {f['layers']} layers; "
          f"figures over the {f['steps'] - f['warmup']} steps after {f['warmup']} warm-up steps")  # fmt: skip
    print(f"{'variant':28s} {'steps/s':>8s} {'x cpu time':>10s} {'compiles/step':>14s} {'new shapes/step':>16s} "
          f"{'warm-up compiles':>17s}")  # fmt: skip
    for r in f["variants"]:
        print(f"{r['name']:28s} {r['steps_per_s']:8.2f} {r['x_cpu_time']:10.2f} {r['compiles_per_step']:14.2f} "
              f"{r['new_shapes_per_step']:16.2f} {r['warmup_compiles']:17d}")  # fmt: skip
    print("(new eager shapes are counted per process: a shape one variant made is not new for the next)")
    for name, diff in f["max_loss_difference"].items():
        print(f"max loss difference {name!r} vs 'tpu eager, buckets': {diff:.2e}")
