"""Diffusion on the simulated ``tpu`` device: eager vs ``compile_pipeline``, compiles and wall time per call.

The same tiny pipeline (SD3 by default, ``--pipeline sd`` for the UNet one) makes 3 images at one size and then 1
at another, first eagerly and then with the denoiser compiled (``backend="tpu", fullgraph=True,
dynamic=False``). For every call it records the compiles and new eager shape signatures the simulator counted
(each one is an XLA compile on a real TPU) and the wall time. A third mode warms both sizes up first
(:func:`hf_tpu.diffusers.warmup`) and then makes the same 4 images: they should compile nothing.

Each mode starts cold (compiled graphs and seen eager shapes forgotten, as in a new process). Wall time on the
simulator is CPU time plus bookkeeping, so read the compile counts as the TPU-relevant numbers
and the times only as "where the compile cost lands".

Run: ``hf-tpu bench diffusion`` (``--help`` for options), or ``python benchmarks/diffusion.py`` from a checkout.
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

__all__ = ["QUICK", "add_arguments", "print_table", "run"]

# --quick: two denoising steps (the sizes are already tiny).
QUICK = {"steps": 2}


def _pipeline(path: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to("tpu")


def _fresh_process() -> None:
    """Forget compiled graphs and seen eager shapes, as a new process would, so each mode starts cold."""
    import hf_tpu.sim

    torch._dynamo.reset()
    hf_tpu.sim.forget_shapes()


def _calls(args) -> list[tuple[int, int]]:
    return [tuple(args.size)] * 3 + [tuple(args.other_size)]


def _run(pipe, sizes, steps: int) -> list[dict]:
    import hf_tpu.sim

    rows = []
    for height, width in sizes:
        with hf_tpu.sim.stats() as s:
            start = time.perf_counter()
            pipe(
                "a watercolor fox",
                height=height,
                width=width,
                num_inference_steps=steps,
                generator=torch.Generator("cpu").manual_seed(0),
                output_type="np",
            )
            seconds = time.perf_counter() - start
        rows.append(
            {
                "size": f"{height}x{width}",
                "compiles": s.compiles,
                "shape_signatures": s.shape_signatures,
                "host_syncs": s.host_syncs,
                "seconds": round(seconds, 3),
            }
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--pipeline", choices=("sd3", "sd"), default="sd3")
    parser.add_argument("--size", type=int, nargs=2, default=(32, 32), metavar=("H", "W"))
    parser.add_argument("--other-size", type=int, nargs=2, default=(32, 48), metavar=("H", "W"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def run(args: argparse.Namespace) -> dict:
    """Run the three modes on a tiny pipeline.

    Returns ``{"pipeline", "steps", "results": {"eager" | "compiled" | "warmed": [{size, compiles,
    shape_signatures, host_syncs, seconds} per call]}, "warmup_seconds", "warmup_sizes", "warmup_graphs"}``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)  # doctest: +SKIP
        >>> run(p.parse_args(["--steps", "2"]))["results"]["warmed"][0]["compiles"]  # doctest: +SKIP
        0
    """
    torch.set_num_threads(args.threads)

    import tempfile

    import hf_tpu.sim
    from hf_tpu.diffusers import compile_pipeline, warmup
    from hf_tpu.diffusers.testing import tiny_sd3_pipeline, tiny_sd_pipeline

    hf_tpu.sim.enable()
    sizes = _calls(args)
    build = tiny_sd3_pipeline if args.pipeline == "sd3" else tiny_sd_pipeline
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(os.path.join(tmp, args.pipeline))

        warm, warm_seconds = [], 0.0
        for mode in ("eager", "compiled", "warmed"):
            _fresh_process()
            pipe = _pipeline(path)
            if mode != "eager":
                compile_pipeline(pipe)
            if mode == "warmed":
                start = time.perf_counter()
                warm = warmup(pipe, [sizes[0], sizes[-1]], num_inference_steps=args.steps, progress=False)
                warm_seconds = time.perf_counter() - start
            results[mode] = _run(pipe, sizes, args.steps)
    return {
        "pipeline": args.pipeline,
        "steps": args.steps,
        "results": results,
        "warmup_seconds": round(warm_seconds, 3),
        "warmup_sizes": len(warm),
        "warmup_graphs": sum(w.graphs for w in warm),
    }


def print_table(figures: dict) -> None:
    """Print what :func:`run` returned: the table, a summary, then the main figures as one JSON line."""
    results = figures["results"]
    print(
        f"{figures['pipeline']}: {len(results['eager'])} calls ({figures['steps']} steps), "
        f"sizes {' '.join(r['size'] for r in results['eager'])}"
    )
    print(f"{'mode':<9} {'call':<5} {'size':<7} {'compiles':>8} {'new eager shapes':>17} {'syncs':>6} {'seconds':>8}")
    print("(on a TPU, each graph compile and each new eager shape is an XLA compile)")
    for mode, rows in results.items():
        for i, row in enumerate(rows, 1):
            print(
                f"{mode:<9} {i:<5} {row['size']:<7} {row['compiles']:>8} {row['shape_signatures']:>17} "
                f"{row['host_syncs']:>6} {row['seconds']:>8.3f}"
            )
    total = {mode: sum(r["seconds"] for r in rows) for mode, rows in results.items()}
    steady = {mode: sum(r["seconds"] for r in rows[1:3]) / 2 for mode, rows in results.items()}
    print(
        f"warm-up of {figures['warmup_sizes']} sizes: {figures['warmup_graphs']} graphs, "
        f"{figures['warmup_seconds']:.2f}s\n"
        f"total seconds: eager {total['eager']:.2f}, compiled {total['compiled']:.2f}, warmed {total['warmed']:.2f}\n"
        f"repeat call (calls 2-3) compiled/eager: {steady['compiled'] / steady['eager']:.2f}x; "
        f"graph compiles: eager {sum(r['compiles'] for r in results['eager'])}, "
        f"compiled {sum(r['compiles'] for r in results['compiled'])} (one per size), "
        f"after warm-up {sum(r['compiles'] for r in results['warmed'])}\n"
        f"new eager shapes: eager {sum(r['shape_signatures'] for r in results['eager'])}, "
        f"compiled {sum(r['shape_signatures'] for r in results['compiled'])}, "
        f"after warm-up {sum(r['shape_signatures'] for r in results['warmed'])}"
    )
    print(
        json.dumps({"pipeline": figures["pipeline"], "results": results, "warmup_seconds": figures["warmup_seconds"]})
    )
