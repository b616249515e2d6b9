"""``hf-tpu diffuse``: make one image with a diffusers pipeline saved on disk, on the tpu device.

Loads ``MODEL_DIR`` with ``DiffusionPipeline.from_pretrained`` (any pipeline diffusers knows: SD3, SD, SDXL, ...),
moves it with ``pipe.to("tpu")``, compiles the denoiser (unless ``--eager``), draws the latents from a CPU
generator (so the image equals the CPU run with the same seed) and writes the image. Nothing is downloaded.

Example:
    $ hf-tpu diffuse ./sd3-medium --prompt "a watercolor fox" --out fox.png --height 1024 --width 1024
    $ hf-tpu diffuse ./tiny-sd3 --prompt "a cat" --out cat.png --steps 2 --height 32 --width 32 --simulate
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["register", "run"]

_DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "diffuse",
        help="run a diffusers pipeline on the tpu device",
        description="Make one image with a diffusers pipeline from a local directory, on the tpu device.",
    )
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="a directory saved by DiffusionPipeline.save_pretrained"
    )
    parser.add_argument("--prompt", required=True, help="the text prompt")
    parser.add_argument("--negative-prompt", default=None, help="what the image should not show")
    parser.add_argument("--out", required=True, help="where to write the image (PNG, JPEG, ... by extension)")
    parser.add_argument("--height", type=int, default=None, help="image height (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="image width (default: the model's)")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps (default 28)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance scale")
    parser.add_argument("--seed", type=int, default=0, help="seed of the CPU generator for the latents (default 0)")
    parser.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="weights dtype (default bfloat16)")
    parser.add_argument("--eager", action="store_true", help="do not compile the denoiser")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    return parser


def _default_size(pipe: Any) -> tuple[int, int]:
    from hf_tpu.diffusers import denoiser

    scale = int(getattr(pipe, "vae_scale_factor", 8) or 8)
    sample = getattr(pipe, "default_sample_size", None)
    if sample is None:
        _, module = denoiser(pipe)
        sample = getattr(module.config, "sample_size", 64)
    if isinstance(sample, (tuple, list)):
        return int(sample[0]) * scale, int(sample[1]) * scale
    return int(sample) * scale, int(sample) * scale


def _load(model_dir: str, dtype_name: str) -> Any:
    import os

    import torch
    from diffusers import DiffusionPipeline

    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        raise FileNotFoundError(
            f"{model_dir!r} is not a saved diffusers pipeline (no model_index.json there): pass the directory that "
            f"DiffusionPipeline.save_pretrained wrote, or download one with `hf download <repo> --local-dir DIR`."
        )
    return DiffusionPipeline.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))


def run(args: argparse.Namespace) -> int:
    import hf_tpu
    from hf_tpu.runtime import require_tpu

    if getattr(args, "simulate", False):
        import hf_tpu.sim

        hf_tpu.sim.enable()
    require_tpu("hf-tpu diffuse")
    with hf_tpu.enabled("diffusers"):
        return _diffuse(args)


def _diffuse(args: argparse.Namespace) -> int:
    import torch

    from hf_tpu.diffusers import check_resolution, compile_pipeline

    try:
        pipe = _load(args.model_dir, args.dtype)
        height, width = _default_size(pipe)
        height, width = args.height or height, args.width or width
        check_resolution(pipe, height, width)
        pipe.to("tpu")
        if not args.eager:
            compile_pipeline(pipe)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"hf-tpu diffuse: {err}", file=sys.stderr)
        return 2
    call: dict[str, Any] = {
        "prompt": args.prompt,
        "height": height,
        "width": width,
        "num_inference_steps": args.steps,
        "generator": torch.Generator("cpu").manual_seed(args.seed),
    }
    if args.negative_prompt is not None:
        call["negative_prompt"] = args.negative_prompt
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale
    graphs_before = _graphs()
    start = time.perf_counter()
    image = pipe(**call).images[0]
    seconds = time.perf_counter() - start
    image.save(args.out)
    summary = {
        "out": args.out,
        "pipeline": type(pipe).__name__,
        "height": height,
        "width": width,
        "steps": args.steps,
        "seed": args.seed,
        "compiled": not args.eager,
        "graphs_compiled": _graphs() - graphs_before,
        "seconds": round(seconds, 3),
        "device": str(pipe.device),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {args.out}: {type(pipe).__name__} {width}x{height}, {args.steps} steps, seed {args.seed}, "
            f"{summary['seconds']}s on {summary['device']} ({summary['graphs_compiled']} graph(s) compiled)"
        )
    return 0


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
