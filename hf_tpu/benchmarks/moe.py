"""MoE experts layer: the ragged-dot kernel vs transformers' eager loop vs grouped_mm, measured side by side.

For each batch size (tokens), on one experts layer (default 64 experts, top-8, like Qwen3-30B-A3B's routing):

- on hf_tpu's simulated ``tpu`` device: new eager shape signatures over ``--routings`` random routings after one
  warm-up call (each one is a compile for TorchTPU's eager mode), device ops and host syncs per call;
- on the CPU: wall time per call (median; interleaved in rotating order and back-to-back), relative to grouped_mm
  (interleaved: the median of the per-round ratios, so that slow drifts of the machine cancel out).

Run: ``hf-tpu bench moe`` (``--help`` for sizes), or ``python benchmarks/moe.py`` from a checkout. Prints a table
and a JSON line. Needs jax (``pip install 'hf-tpu[kernels]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

__all__ = ["QUICK", "add_arguments", "print_table", "run"]

# --quick: fewer experts, two batch sizes, few routings and repeats.
QUICK = {"experts": 16, "top_k": 4, "hidden": 64, "intermediate": 64, "batches": [1, 8], "routings": 8, "repeats": 5}


def _experts(num_experts: int, hidden: int, intermediate: int, implementation: str, device: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts)
    config._experts_implementation = implementation
    module = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) / hidden**0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) / intermediate**0.5)
    return module.eval().to(device)


def _routing(tokens: int, num_experts: int, top_k: int, g: torch.Generator):
    scores = torch.rand(tokens, num_experts, generator=g)
    weights, index = scores.topk(top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def simulated(impls, args) -> dict:
    import hf_tpu.sim

    hf_tpu.sim.enable()
    results = {}
    for tokens in args.batches:
        for name, impl in impls.items():
            module = _experts(args.experts, args.hidden, args.intermediate, impl, "tpu")
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, args.hidden, generator=g).to("tpu")
            try:
                with torch.no_grad():
                    index, weights = _routing(tokens, args.experts, args.top_k, g)
                    module(x, index.to("tpu"), weights.to("tpu"))  # warm-up
                    routings = [_routing(tokens, args.experts, args.top_k, g) for _ in range(args.routings)]
                    routings = [(i.to("tpu"), w.to("tpu")) for i, w in routings]
                    with hf_tpu.sim.stats() as s:
                        for index, weights in routings:
                            module(x, index, weights)
                results[(tokens, name)] = {
                    "new_signatures": s.shape_signatures,
                    "ops_per_call": s.ops / args.routings,
                    "host_syncs_per_call": s.host_syncs / args.routings,
                }
            except (NotImplementedError, RuntimeError) as exc:  # reported in the table, not hidden
                results[(tokens, name)] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
    return results


def cpu_times(impls, args) -> tuple[dict, dict, dict]:
    """CPU time per call, measured two ways.

    - interleaved: round after round, one call of each implementation in a rotating order (machine noise hits all
      alike; JAX's worker threads go idle between its calls and the other implementations' weights pass through
      the caches, as between the layers of a model). Per implementation the median time, and per round its time
      over grouped_mm's in the same round: the median of those paired ratios.
    - back-to-back: each implementation's calls in a row; the median time.
    """
    interleaved, paired, back_to_back = {}, {}, {}
    names = list(impls)
    for tokens in args.batches:
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, args.hidden, generator=g)
        routings = [_routing(tokens, args.experts, args.top_k, g) for _ in range(args.repeats)]
        modules = {
            name: _experts(args.experts, args.hidden, args.intermediate, impl, "cpu") for name, impl in impls.items()
        }
        mixed = {name: [] for name in impls}
        with torch.no_grad():
            for module in modules.values():  # warm-up (JAX compiles its programs here)
                module(x, *routings[0])
            for i, (index, weights) in enumerate(routings):
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    start = time.perf_counter()
                    modules[name](x, index, weights)
                    mixed[name].append(time.perf_counter() - start)
            for name, module in modules.items():
                row = []
                for index, weights in routings:
                    start = time.perf_counter()
                    module(x, index, weights)
                    row.append(time.perf_counter() - start)
                back_to_back[(tokens, name)] = statistics.median(row) * 1e6
        for name in impls:
            interleaved[(tokens, name)] = statistics.median(mixed[name]) * 1e6
            paired[(tokens, name)] = statistics.median(
                a / b for a, b in zip(mixed[name], mixed["grouped_mm"], strict=True)
            )
    return interleaved, paired, back_to_back


IMPLEMENTATIONS = ("ragged_dot kernel", "eager loop", "grouped_mm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--routings", type=int, default=100, help="random routings on the simulated device")
    parser.add_argument("--repeats", type=int, default=60, help="timed calls per implementation on the CPU")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def run(args: argparse.Namespace) -> dict:
    """Measure every implementation at every batch size.

    Returns ``{"simulated": {"<tokens>/<implementation>": {new_signatures, ops_per_call, host_syncs_per_call} or
    {error}}, "cpu_us_interleaved": {...: us}, "cpu_paired_ratio_to_grouped_mm": {...: ratio},
    "cpu_us_back_to_back": {...: us}, "config": {options}}``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)  # doctest: +SKIP
        >>> run(p.parse_args(["--batches", "1", "--routings", "4"]))["simulated"]["1/eager loop"]  # doctest: +SKIP
    """
    torch.set_num_threads(args.threads)

    from hf_tpu.kernels import use_ragged_dot_experts

    impls = dict(zip(IMPLEMENTATIONS, (use_ragged_dot_experts(), "eager", "grouped_mm"), strict=True))
    # CPU first: the simulated runs leave many Python objects behind, and the garbage collector's pauses then land
    # on whichever implementation allocates Python objects per call (JAX's dispatch does, torch's C++ ops do not).
    cpu, cpu_paired, cpu_b2b = cpu_times(impls, args)
    sim = simulated(impls, args)
    return {
        "simulated": {f"{t}/{n}": v for (t, n), v in sim.items()},
        "cpu_us_interleaved": {f"{t}/{n}": round(v, 1) for (t, n), v in cpu.items()},
        "cpu_paired_ratio_to_grouped_mm": {f"{t}/{n}": round(v, 3) for (t, n), v in cpu_paired.items()},
        "cpu_us_back_to_back": {f"{t}/{n}": round(v, 1) for (t, n), v in cpu_b2b.items()},
        "config": vars(args),
    }


def print_table(record: dict) -> None:
    """Print what :func:`run` returned: the table, then the record as one JSON line."""
    args = argparse.Namespace(**record["config"])
    cpu, cpu_b2b = record["cpu_us_interleaved"], record["cpu_us_back_to_back"]
    paired = record["cpu_paired_ratio_to_grouped_mm"]
    print(
        f"experts layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
        f"moe_intermediate {args.intermediate}; simulated device over {args.routings} random routings"
    )
    header = (
        f"{'tokens':>6}  {'implementation':<18} {'new signatures':>14} {'ops/call':>9} {'syncs/call':>10} "
        f"{'CPU us (mixed)':>14} {'vs gmm':>7} {'CPU us (row)':>12} {'vs gmm':>7}"
    )
    print(header)
    print("-" * len(header))
    for tokens in args.batches:
        for name in IMPLEMENTATIONS:
            key = f"{tokens}/{name}"
            s = record["simulated"][key]
            t, t2 = cpu[key], cpu_b2b[key]
            ratio, ratio2 = paired[key], t2 / cpu_b2b[f"{tokens}/grouped_mm"]
            if "error" in s:
                sim_cols = f"{s['error'][:35]:>35}"
            else:
                sim_cols = f"{s['new_signatures']:>14} {s['ops_per_call']:>9.1f} {s['host_syncs_per_call']:>10.1f}"
            print(f"{tokens:>6}  {name:<18} {sim_cols} {t:>14.0f} {ratio:>6.2f}x {t2:>12.0f} {ratio2:>6.2f}x")
    print(json.dumps(record))
