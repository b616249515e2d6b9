"""Quantized generate on the simulated tpu: bf16 vs int8 vs int4 (torchao configs) vs compressed-tensors w8a16 and
w4a16 checkpoints, side by side in one run.

One Llama checkpoint (``--shape``: ``tiny``, ``default``, or ``realistic``: Llama-3's proportions with 16 layers, where
the peak during generate is measured as a real model has it), loaded on the simulated ``tpu`` device with
``device_map="tpu"``: in bf16, with ``TorchAoConfig(Int8WeightOnlyConfig())`` and with
``TorchAoConfig(Int4WeightOnlyConfig(group_size=...))``; and
the same weights saved as compressed-tensors checkpoints (``ct-w8a16``: 8-bit per output channel, ``ct-w4a16``:
4-bit in groups of 128; made with :mod:`hf_tpu.quantization.ct_checkpoint`), loaded with no ``quantization_config``.
Each is warmed up with ``hf_tpu.warmup`` and then measured:

- weight bytes on the device (the simulator's live-memory counter across the load) and their ratio to bf16
  (targets: int8 <= 55%, int4 <= 35%);
- the static cache's bytes (live after warm-up minus the weights) and the peak device memory during a warmed-up
  ``generate``, as the excess over weights + cache (target: <= 10% of weights + cache; the simulator runs a
  compiled graph op by op, so each Linear's dequantized weight is a temporary there, 3 bytes per weight of one
  matrix: a large fraction of all the weights in the tiny shape, not at ``realistic``; on a chip XLA fuses it);
- compiles during the measured generates (expected 0 after warm-up), and whether greedy tokens equal bf16's;
- decode time per step on the simulator: (time of ``new`` tokens - time of 1 token) / (new - 1), medians.

Run: ``hf-tpu bench quant`` (``--help`` for sizes), or ``python benchmarks/quant.py`` from a checkout. Needs torchao
and compressed-tensors (``pip install 'hf-tpu[quant]'``). Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

__all__ = [
    "KINDS", "QUICK", "SHAPES", "TARGET_PEAK", "TARGET_WEIGHTS", "add_arguments", "print_table", "resolve", "run",
]

KINDS = ("bf16", "int8", "int4", "ct-w8a16", "ct-w4a16")
TARGET_WEIGHTS = {"int8": 0.55, "int4": 0.35, "ct-w8a16": 0.55, "ct-w4a16": 0.35}
TARGET_PEAK = 0.10  # peak during generate at most 10% above weights + cache
# Model geometries (--shape) with the run sizes that suit them. 'realistic' keeps Llama-3-8B's proportions
# (intermediate 3.5x hidden, head_dim 128, 4 query heads per key/value head) at hidden 512 and half its 32 layers,
# with a small vocabulary, so the bf16 embedding table and lm_head (which stay bf16 in every kind) take a smaller
# share of the weights than in a real model (the harder case for the peak): 0.12 GB of bf16 weights.
SHAPES = {
    "tiny": dict(hidden=128, intermediate=512, heads=4, kv_heads=2, layers=2, vocab=128, prompt=8, new_tokens=4,
                 repeats=1),
    "default": dict(hidden=256, intermediate=1024, heads=4, kv_heads=2, layers=8, vocab=256, prompt=16,
                    new_tokens=16, repeats=3),
    "realistic": dict(hidden=512, intermediate=1792, heads=4, kv_heads=1, layers=16, vocab=4096, prompt=16,
                      new_tokens=4, repeats=1),
}
QUICK = {"shape": "tiny"}

# its targets compare float32 results with the CPU's exactly: run at float32 matmul precision 'highest'
EXACT_FLOAT32 = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="default",
        help="model geometry: 'tiny' (--quick's), 'default', or 'realistic' (Llama-3's proportions, 16 layers: the "
        "peak over weights + cache as a real model has it); --hidden etc. override single fields",
    )
    parser.add_argument("--hidden", type=int, help="hidden size (a multiple of --group-size)")
    parser.add_argument("--intermediate", type=int, help="MLP size (a multiple of --group-size)")
    parser.add_argument("--heads", type=int, help="attention heads (head_dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size")
    parser.add_argument("--prompt", type=int, help="prompt length")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeats", type=int, help="timed generates per measure (median)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every field left unset taken from its ``--shape`` preset (explicit options win)."""
    preset = SHAPES[args.shape]
    return argparse.Namespace(**{k: preset[k] if v is None and k in preset else v for k, v in vars(args).items()})


def _config(kind: str, group_size: int):
    if kind == "bf16" or kind.startswith("ct-"):  # compressed-tensors: the checkpoint carries its config
        return None
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    if kind == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    return TorchAoConfig(Int4WeightOnlyConfig(group_size=group_size))


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(kind: str, path: str, args: argparse.Namespace, ids: torch.Tensor) -> dict:
    from transformers import AutoModelForCausalLM

    import hf_tpu
    import hf_tpu.sim

    gc.collect()
    before = hf_tpu.sim.memory_allocated()
    config = _config(kind, args.group_size)  # an explicit None would drop a checkpoint's own quantization_config
    load = {} if config is None else {"quantization_config": config}
    model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", dtype=torch.bfloat16, **load).eval()
    weights = hf_tpu.sim.memory_allocated() - before
    hf_tpu.warmup(model, max_prompt_len=args.prompt, batch_sizes=[1], max_new_tokens=args.new_tokens, progress=False)
    tokens = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)  # the cache stays allocated
    live = hf_tpu.sim.memory_allocated()
    with hf_tpu.sim.stats() as s:
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        full = _median_time(lambda: model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False), args.repeats)
        one = _median_time(lambda: model.generate(ids, max_new_tokens=1, do_sample=False), args.repeats)
    cache = live - before - weights
    figures = {
        "weight_bytes": weights,
        "cache_bytes": cache,
        "peak_excess_bytes": s.peak_bytes - live,
        "peak_excess_ratio": round((s.peak_bytes - live) / (weights + cache), 4),
        "compiles_after_warmup": s.compiles,
        "decode_ms_per_step": round(1000 * (full - one) / max(args.new_tokens - 1, 1), 3),
        "tokens": tokens[0, ids.shape[1] :].tolist(),
    }
    del model
    gc.collect()
    return figures


def run(args: argparse.Namespace) -> dict:
    import hf_tpu
    import hf_tpu.sim
    from hf_tpu.testing import tiny_model

    vars(args).update(vars(resolve(args)))  # the sizes run, also in what `hf-tpu bench --json` records
    hf_tpu.sim.enable()
    hf_tpu.enable("device_map", "generation", "quantization")
    geometry = dict(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, num_hidden_layers=args.layers,
        vocab_size=args.vocab, initializer_range=0.3,
    )
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="hf-tpu-bench-quant-") as path:
        from hf_tpu.quantization.ct_checkpoint import save_compressed

        tiny_model("llama", path, **geometry)
        paths = {kind: path for kind in KINDS}
        for kind in KINDS:
            if kind.startswith("ct-"):
                paths[kind] = os.path.join(path, kind)
                save_compressed(path, paths[kind], kind[len("ct-") :])
        kinds = {kind: _measure(kind, paths[kind], args, ids) for kind in KINDS}
    bf16 = kinds["bf16"]
    missed = []
    for kind, figures in kinds.items():
        figures["weights_vs_bf16"] = round(figures["weight_bytes"] / bf16["weight_bytes"], 4)
        figures["tokens_equal_bf16"] = figures["tokens"] == bf16["tokens"]
        if kind in TARGET_WEIGHTS and figures["weights_vs_bf16"] > TARGET_WEIGHTS[kind]:
            ratio, target = figures["weights_vs_bf16"], TARGET_WEIGHTS[kind]
            missed.append(f"{kind} weights {ratio:.1%} of bf16 (target <= {target:.0%})")
        if figures["peak_excess_ratio"] > TARGET_PEAK:
            missed.append(
                f"{kind} peak during generate {figures['peak_excess_ratio']:.1%} above weights + cache "
                f"(target <= {TARGET_PEAK:.0%})"
            )
        if figures["compiles_after_warmup"]:
            missed.append(f"{kind}: {figures['compiles_after_warmup']} compiles after warm-up")
    return {"kinds": kinds, "missed": missed, "targets_met": not missed, "config": vars(args)}


def print_table(record: dict) -> None:
    """Print what :func:`run` returned: the table, then the record as one JSON line."""
    args = argparse.Namespace(**record["config"])
    print(
        f"Llama ({args.shape}): hidden {args.hidden}, intermediate {args.intermediate}, {args.heads}/{args.kv_heads} "
        f"heads, {args.layers} layers, vocab {args.vocab}; prompt {args.prompt}, "
        f"{args.new_tokens} new tokens; int4 group size {args.group_size}; simulated tpu"
    )
    header = (
        f"{'kind':<8} {'weights':>10} {'vs bf16':>8} {'cache':>9} {'peak over w+c':>14} {'compiles':>8} "
        f"{'ms/step':>8} {'vs bf16':>8} {'tokens = bf16':>13}"
    )
    print(header)
    print("-" * len(header))
    bf16_ms = record["kinds"]["bf16"]["decode_ms_per_step"]
    for kind, f in record["kinds"].items():
        speed = f["decode_ms_per_step"] / bf16_ms if bf16_ms > 0 else float("nan")
        print(
            f"{kind:<8} {f['weight_bytes']:>10} {f['weights_vs_bf16']:>8.1%} {f['cache_bytes']:>9} "
            f"{f['peak_excess_ratio']:>14.1%} {f['compiles_after_warmup']:>8} {f['decode_ms_per_step']:>8.2f} "
            f"{speed:>7.2f}x {str(f['tokens_equal_bf16']):>13}"
        )
    print("targets met" if record["targets_met"] else "missed: " + "; ".join(record["missed"]))
    print(json.dumps(record))
