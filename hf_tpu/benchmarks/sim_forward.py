"""Tiny-Llama forward on the simulated tpu over the same forward on the CPU, measured side by side.

    hf-tpu bench sim_forward                          # three sizes: hidden/seq 32/16 (the tests'), 64/32, 256/128
    hf-tpu bench sim_forward --hidden 128 --seq 64 --layers 2 --batch 2 --iters 30
    python benchmarks/sim_forward.py [same options]   # from a checkout

Prints both medians and their ratio per size, then one line per size with "ok" or "missed" against the
simulator's target (at most 2x the CPU: :data:`TARGET_RATIO`); a missed size is listed in the figures'
``timing_missed``, without failing the run (a time ratio is a timing target: ``hf-tpu bench`` reports "missed").
Both runs use the same weights, inputs and thread count, alternating so that machine load hits both alike, and time
the process's CPU time (``time.process_time``), so that other processes on a shared machine do not skew the ratio.
The simulator adds a roughly fixed cost per op, so the ratio is worst on the tiniest model and falls as ops get
bigger; the figures say whether the simulator's native core ran the ops (``native``: "on") or its Python fallback
did (``HF_TPU_SIM_NATIVE=0``, or no C++ compiler: about 5x the per-op cost, see docs/simulator.md). The forward is
timed at the float32 matmul precision in force (the simulator's default, ``'medium'``, emulates a chip's bfloat16
pass in Python kernels: its cost is part of the ratio; ``HF_TPU_SIM_MATMUL_PRECISION=highest`` times float32) and
checked equal to the CPU's at ``'highest'`` first, where the simulator computes float32 as the CPU does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

__all__ = ["QUICK", "TARGET_RATIO", "add_arguments", "build", "print_table", "run"]

#: The simulator's target: its forward at most this many times the CPU forward's time.
TARGET_RATIO = 2.0

# --quick: one small size, few iterations.
QUICK = {"hidden": 64, "seq": 32, "iters": 5}
# The default sizes, (hidden, seq): the tests' tiny models (hidden 32), and two larger ones.
SIZES = ((32, 16), (64, 32), (256, 128))


def build(hidden: int, layers: int, vocab: int = 1000):
    from hf_tpu.testing import tiny_model

    heads = {"num_attention_heads": max(hidden // 16, 1), "num_key_value_heads": max(hidden // 32, 1)}
    return tiny_model(
        "llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
        max_position_embeddings=512, **heads,
    )  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    p.add_argument("--hidden", type=int, default=None, help="default: hidden/seq 32/16, 64/32 and 256/128")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)


def run(a: argparse.Namespace) -> dict:
    """Measure every size.

    Returns ``{"sizes": [{hidden, layers, batch, seq, threads, iters, cpu_ms, tpu_ms, device_ops,
    overhead_us_per_op, ratio, met}, ...], "target": 2.0, "native": str, "precision": str, "timing_missed": [str,
    ...]}`` where ``native`` is the simulator's native-core status (``hf_tpu.sim.native_status()``), ``precision``
    the float32 matmul precision the forwards were timed at (``torch.get_float32_matmul_precision()``), ``ratio`` is
    ``tpu_ms / cpu_ms`` (medians of the process CPU time), ``met`` is ``ratio <= target`` and ``timing_missed``
    names each size whose ratio is above :data:`TARGET_RATIO`.

    Example:
        >>> run(argparse.Namespace(hidden=64, layers=2, seq=32, batch=2, iters=5, threads=1))  # doctest: +SKIP
    """
    import hf_tpu.sim

    hf_tpu.sim.enable()
    torch.set_num_threads(a.threads)
    if a.hidden is None:
        sizes = [(h, a.seq or n) for h, n in SIZES]
    else:
        sizes = [(a.hidden, a.seq or 32)]
    rows = [_measure(argparse.Namespace(**{**vars(a), "hidden": h, "seq": n})) for h, n in sizes]
    missed = [
        f"hidden {r['hidden']}: ratio sim/cpu {r['ratio']:.2f}x, target <= {TARGET_RATIO:g}x"
        for r in rows
        if not r["met"]
    ]
    import hf_tpu.sim

    return {"sizes": rows, "target": TARGET_RATIO, "native": hf_tpu.sim.native_status(),
            "precision": torch.get_float32_matmul_precision(), "timing_missed": missed}  # fmt: skip


def _measure(a: argparse.Namespace) -> dict:
    import hf_tpu.sim

    cpu = build(a.hidden, a.layers)
    tpu = build(a.hidden, a.layers)
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    ids = torch.randint(0, 1000, (a.batch, a.seq))
    mask = torch.ones_like(ids)
    ids_t, mask_t = ids.to("tpu"), mask.to("tpu")

    def run_cpu():
        return cpu(input_ids=ids, attention_mask=mask).logits

    def run_tpu():
        return tpu(input_ids=ids_t, attention_mask=mask_t).logits

    with torch.no_grad():
        with torch.tpu.precision(torch.tpu.Precision.HIGHEST):  # the same forward as the CPU's, float32
            torch.testing.assert_close(run_tpu().cpu(), run_cpu())
        for _ in range(3):  # warm-up both
            run_cpu(), run_tpu()
        t_cpu, t_tpu = [], []
        for _ in range(a.iters):
            t0 = time.process_time()
            run_cpu()
            t1 = time.process_time()
            run_tpu()
            t2 = time.process_time()
            t_cpu.append(t1 - t0)
            t_tpu.append(t2 - t1)
        with hf_tpu.sim.stats() as s:
            run_tpu()
    mc, mt = statistics.median(t_cpu), statistics.median(t_tpu)
    return {
        "hidden": a.hidden, "layers": a.layers, "batch": a.batch, "seq": a.seq, "threads": a.threads,
        "iters": a.iters, "cpu_ms": mc * 1e3, "tpu_ms": mt * 1e3, "device_ops": s.ops,
        "overhead_us_per_op": (mt - mc) / max(s.ops, 1) * 1e6, "ratio": mt / mc, "met": mt / mc <= TARGET_RATIO,
    }  # fmt: skip


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned, one block per size."""
    for r in figures["sizes"]:
        print(
            f"tiny Llama forward (hidden {r['hidden']}, {r['layers']} layers, batch {r['batch']}, seq {r['seq']}, "
            f"{r['threads']} thread(s)), median of {r['iters']}:"
        )
        print(f"  cpu              {r['cpu_ms']:8.2f} ms")
        print(
            f"  simulated tpu    {r['tpu_ms']:8.2f} ms   ({r['device_ops']} device ops, "
            f"{r['overhead_us_per_op']:.1f} us overhead per op)"
        )
        verdict = "met" if r["met"] else "missed"
        print(f"  ratio sim/cpu    {r['ratio']:8.2f}x   (target <= {TARGET_RATIO:g}x: {verdict})")
    print(
        f"simulated tpu / cpu forward time (target <= {TARGET_RATIO:g}x; simulator native core: {figures['native']}; "
        f"float32 matmul precision: {figures.get('precision', 'medium')}):"
    )
    for r in figures["sizes"]:
        verdict = "ok" if r["met"] else "missed"
        print(f"  hidden {r['hidden']:>4}, seq {r['seq']:>4}: {r['ratio']:5.2f}x  {verdict}")
