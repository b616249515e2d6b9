"""``hf-tpu diffuse``: make one image with a diffusers pipeline saved on disk, on the tpu device.

Loads ``MODEL_DIR`` with ``DiffusionPipeline.from_pretrained`` (any pipeline diffusers knows: SD3, SD, SDXL, ...),
moves it with ``pipe.to("tpu")``, compiles the denoiser (unless ``--eager``), draws the latents from a CPU
generator (so the image equals the CPU run with the same seed) and writes the image. Nothing is downloaded.

Without ``MODEL_DIR`` (or ``--model``) it runs hf_tpu's tiny SD3 pipeline, built in-process from a fixed seed
(:func:`hf_tpu.diffusers.testing.tiny_sd3_pipeline`): random weights, so the 32x32 image is coloured noise, but
every component of a real SD3 pipeline runs, on a fresh install with no download.

Example:
    $ hf-tpu diffuse --simulate --prompt "a lighthouse at dusk" --out img.png       # the tiny built-in pipeline
    $ hf-tpu diffuse ./sd3-medium --prompt "a watercolor fox" --out fox.png --height 1024 --width 1024
    $ hf-tpu diffuse ./tiny-sd3 --prompt "a cat" --out cat.png --steps 2 --height 32 --width 32 --simulate
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from hf_tpu.errors import MissingFileError, UserError

__all__ = ["register", "run"]

_DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "diffuse",
        help="run a diffusers pipeline on the tpu device",
        description="Make one image with a diffusers pipeline from a local directory, on the tpu device.",
    )
    parser.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        nargs="?",
        default=None,
        help="a directory saved by DiffusionPipeline.save_pretrained (default: hf_tpu's tiny random SD3 pipeline)",
    )
    parser.add_argument(
        "--model", dest="model_opt", metavar="MODEL_DIR", default=None, help="the same as the positional MODEL_DIR"
    )
    parser.add_argument("--prompt", required=True, help="the text prompt")
    parser.add_argument("--negative-prompt", default=None, help="what the image should not show")
    parser.add_argument("--out", required=True, help="where to write the image (PNG, JPEG, ... by extension)")
    parser.add_argument("--height", type=int, default=None, help="image height (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="image width (default: the model's)")
    parser.add_argument(
        "--steps", type=int, default=None, help="denoising steps (default 28; 4 for the tiny built-in pipeline)"
    )
    parser.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance scale")
    parser.add_argument("--seed", type=int, default=0, help="seed of the CPU generator for the latents (default 0)")
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="weights dtype (default bfloat16; float32 for the tiny built-in pipeline)",
    )
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


def _load(model_dir: str | None, dtype_name: str) -> Any:
    import os

    import torch

    if model_dir is None:
        from hf_tpu.diffusers.testing import tiny_sd3_pipeline

        print(
            "hf-tpu diffuse: no MODEL_DIR given: using hf_tpu's tiny SD3 pipeline (random weights, seed 0: the image "
            "is noise; pass MODEL_DIR for a real model)",
            file=sys.stderr,
        )
        pipe = tiny_sd3_pipeline(seed=0)
        return pipe if dtype_name == "float32" else pipe.to(dtype=getattr(torch, dtype_name))
    from diffusers import DiffusionPipeline

    if not os.path.exists(model_dir):
        raise UserError(
            f"{model_dir}: no such directory. Pass a directory that DiffusionPipeline.save_pretrained wrote."
        )
    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        raise MissingFileError(
            f"{model_dir!r} is not a saved diffusers pipeline (no model_index.json there): pass the directory that "
            f"DiffusionPipeline.save_pretrained wrote, or download one with `hf download <repo> --local-dir DIR`."
        )
    try:
        return DiffusionPipeline.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    except Exception as err:
        from hf_tpu.device_map.files import bad_safetensors_files, checkpoint_error

        for sub in [model_dir, *sorted(p.path for p in os.scandir(model_dir) if p.is_dir())]:
            if bad_safetensors_files(sub):  # a truncated weights file in one component: name it
                raise (checkpoint_error(sub, err) or err) from err
        raise


def run(args: argparse.Namespace) -> int:
    import hf_tpu
    from hf_tpu.runtime import require_tpu

    if getattr(args, "simulate", False):
        import hf_tpu.sim

        hf_tpu.sim.enable()
    require_tpu("hf-tpu diffuse")
    from hf_tpu.cli._model_path import check_output_file

    check_output_file(args.out, "--out")
    model_opt = getattr(args, "model_opt", None)
    if model_opt and args.model_dir and model_opt != args.model_dir:
        raise UserError(f"two models given ({args.model_dir} and --model {model_opt}): give one")
    args.model_dir = model_opt or args.model_dir
    with hf_tpu.enabled("diffusers"), _quiet_libraries(args.model_dir is None):
        return _diffuse(args)


@contextlib.contextmanager
def _quiet_libraries(quiet: bool) -> Iterator[None]:
    """The tiny built-in pipeline's tokenizers hold 16 tokens and its processors lack torchvision: transformers and
    diffusers warn about that, which is about the demo, not the user's set-up. Errors still show."""
    if not quiet:
        yield
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    before = transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(before[0])
        diffusers_logging.set_verbosity(before[1])


def _diffuse(args: argparse.Namespace) -> int:
    import torch

    from hf_tpu.diffusers import check_resolution, compile_pipeline

    builtin = args.model_dir is None
    args.steps = args.steps if args.steps is not None else (4 if builtin else 28)
    args.dtype = args.dtype or ("float32" if builtin else "bfloat16")
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
            f"wrote {args.out}: {type(pipe).__name__} {width}x{height} (width x height), {args.steps} steps, "
            f"seed {args.seed}, {summary['seconds']}s on {summary['device']} "
            f"({summary['graphs_compiled']} graph(s) compiled)"
        )
    return 0


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
