"""Every pipeline family on the simulated ``tpu`` device against the CPU (``hf_tpu.benchmarks.diffusers_sweep``).

For each family a tiny pipeline is built locally (random components from small configs, nothing downloaded) and
called with the same CPU generator: once on the CPU (the reference), then after ``pipe.to("tpu")`` eagerly, then
after :func:`hf_tpu.diffusers.compile_pipeline` twice (the second call must compile nothing). A row records
whether the eager and compiled outputs equal the CPU's (max abs difference), the modules compiled, the graphs the
first compiled call compiled and the second one, and, for a failure, where it was raised (hf_tpu's code or
upstream's) with the message.

The CPU reference runs upstream's code; the device stages run with hf_tpu's diffusers integration enabled, as after
``hf_tpu.enable()`` (placement checks, Qwen-Image 2.1's host-side sequence layout).

Families: text-to-image (SD, SD3, Flux, Qwen-Image 2.1), image-to-image and inpainting (SD, SD3), ControlNet (SD),
video (Wan 2.1, Wan 2.2 with two experts) and Modular Diffusers (the SD3 blocks; MiniMax-H3's joint video + audio
blocks). Target: no family fails inside hf_tpu, and at least 90% of them equal the CPU eagerly and compiled, a second
call compiling nothing.

Run: ``hf-tpu bench diffusers_sweep`` (``--families sd wan22`` for some), or ``python benchmarks/diffusers_sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

__all__ = ["FAMILIES", "QUICK", "add_arguments", "print_table", "run"]

ATOL = 1e-4  # float32 on both sides; images and frames are in [0, 1]
PROMPT = "a watercolor fox"
QUICK = {"families": ["sd3", "wan22", "sd3_modular"]}  # --quick: a classic, a two-expert video and a modular one

# its targets compare float32 results with the CPU's exactly: run at float32 matmul precision 'highest'
EXACT_FLOAT32 = True


def _image(seed: int = 1, size: int = 32) -> torch.Tensor:
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _sd(kind: str) -> tuple[Any, dict]:
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    from hf_tpu.diffusers.testing import tiny_sd_pipeline

    base = tiny_sd_pipeline()
    if kind == "t2i":
        return base, {"height": 32, "width": 32}
    components = dict(base.components)
    if kind == "img2img":
        return StableDiffusionImg2ImgPipeline(**components), {"image": _image(), "strength": 0.75}
    mask = (torch.rand(1, 1, 32, 32, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    return StableDiffusionInpaintPipeline(**components), {"image": _image(), "mask_image": mask, "height": 32,
                                                          "width": 32}


def _sd3(kind: str) -> tuple[Any, dict]:
    from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline

    from hf_tpu.diffusers.testing import tiny_sd3_pipeline

    base = tiny_sd3_pipeline(latent_channels=16 if kind == "inpaint" else 4)
    if kind == "t2i":
        return base, {"height": 32, "width": 32}
    components = dict(base.components)
    if kind == "img2img":
        return StableDiffusion3Img2ImgPipeline(**components), {"image": _image(), "strength": 0.75}
    mask = (torch.rand(1, 1, 32, 32, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    return StableDiffusion3InpaintPipeline(**components), {"image": _image(), "mask_image": mask, "height": 32,
                                                           "width": 32}


def _flux() -> tuple[Any, dict]:
    from hf_tpu.diffusers.testing import tiny_flux_pipeline

    return tiny_flux_pipeline(), {"height": 32, "width": 32, "max_sequence_length": 16}


def _controlnet() -> tuple[Any, dict]:
    from hf_tpu.diffusers.testing import tiny_sd_controlnet_pipeline

    return tiny_sd_controlnet_pipeline(), {"image": _image(), "height": 32, "width": 32}


def _wan(two_experts: bool) -> tuple[Any, dict]:
    from hf_tpu.diffusers.testing import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=two_experts)
    return pipe, {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": 16}


def _qwen_image() -> tuple[Any, dict]:
    from hf_tpu.diffusers.testing import tiny_qwen_image_pipeline

    return tiny_qwen_image_pipeline(), {"height": 32, "width": 64}


def _sd3_modular() -> tuple[Any, dict]:
    from diffusers.modular_pipelines import ComponentsManager, StableDiffusion3AutoBlocks

    from hf_tpu.diffusers.testing import tiny_sd3_pipeline

    classic = tiny_sd3_pipeline()
    pipe = StableDiffusion3AutoBlocks().init_pipeline(components_manager=ComponentsManager())
    pipe.update_components(**{k: v for k, v in classic.components.items() if k in pipe.component_names and v})
    pipe.set_progress_bar_config(disable=True)
    return pipe, {"height": 32, "width": 32, "output": "images"}


def _minimax_h3_modular() -> tuple[Any, dict]:
    """MiniMax-H3 (video + audio, modular only): the sweep compares the 124 video frames; the soundtrack is compared
    in tests/diffusers/test_minimax_h3.py."""
    from hf_tpu.diffusers.testing import tiny_minimax_h3_pipeline

    return tiny_minimax_h3_pipeline(), {"height": 16, "width": 16, "num_frames": 124, "output": "videos"}


# name: (category, builder returning (pipeline, call arguments))
FAMILIES: dict[str, tuple[str, Callable[[], tuple[Any, dict]]]] = {
    "sd": ("text-to-image", lambda: _sd("t2i")),
    "sd3": ("text-to-image", lambda: _sd3("t2i")),
    "flux": ("text-to-image", _flux),
    "qwen_image21": ("text-to-image", _qwen_image),
    "sd_img2img": ("image-to-image", lambda: _sd("img2img")),
    "sd3_img2img": ("image-to-image", lambda: _sd3("img2img")),
    "sd_inpaint": ("inpainting", lambda: _sd("inpaint")),
    "sd3_inpaint": ("inpainting", lambda: _sd3("inpaint")),
    "sd_controlnet": ("ControlNet", _controlnet),
    "wan21": ("video", lambda: _wan(False)),
    "wan22": ("video (two experts)", lambda: _wan(True)),
    "sd3_modular": ("modular", _sd3_modular),
    "minimax_h3_modular": ("video + audio (modular)", _minimax_h3_modular),
}


def _call(pipe: Any, kwargs: dict, steps: int) -> np.ndarray:
    gen = torch.Generator("cpu").manual_seed(0)
    out = pipe(prompt=PROMPT, num_inference_steps=steps, generator=gen, output_type="np", **kwargs)
    out = getattr(out, "images", None) if hasattr(out, "images") else getattr(out, "frames", out)
    return np.asarray(out, dtype=np.float32)


def _where(err: BaseException) -> str:
    """``hf_tpu`` when the innermost frame of the error that is not torch's or Python's is in hf_tpu, else
    ``upstream`` (diffusers, transformers) or ``torch``."""
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        if "/hf_tpu/" in path and "/hf_tpu/sim/" not in path:
            return "hf_tpu"
        if "/diffusers/" in path or "/transformers/" in path:
            return "upstream"
    return "torch"


def _family(name: str, steps: int) -> dict:
    import hf_tpu
    import hf_tpu.sim
    from hf_tpu.diffusers import compile_pipeline, compiled_modules

    category, build = FAMILIES[name]
    row: dict[str, Any] = {"family": name, "category": category}
    stage = "build"
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        pipe, kwargs = build()
        pipe.set_progress_bar_config(disable=True)
        row["pipeline"] = type(pipe).__name__
        stage = "cpu"
        reference = _call(pipe, kwargs, steps)
        stage = "to(tpu)"
        # The device stages run as a user's would, after hf_tpu.enable() (the reference above is upstream's code).
        hf_tpu.enable("diffusers")
        pipe.to("tpu")
        stage = "eager"
        row["eager_diff"] = float(np.abs(_call(pipe, kwargs, steps) - reference).max())
        stage = "compile"
        torch._dynamo.reset()
        compile_pipeline(pipe)
        row["compiled_modules"] = compiled_modules(pipe)
        with hf_tpu.sim.stats() as first:
            out = _call(pipe, kwargs, steps)
        row["compiled_diff"] = float(np.abs(out - reference).max())
        stage = "second call"
        with hf_tpu.sim.stats() as again:
            _call(pipe, kwargs, steps)
        row["compiles"], row["compiles_again"] = first.compiles, again.compiles
    except Exception as err:  # recorded per family: one failing family must not hide the others
        row["error"] = f"{stage}: {type(err).__name__}: {' '.join(str(err).split())[:240]}"
        row["error_in"] = _where(err)
    finally:
        hf_tpu.disable("diffusers")
    row["equal"] = (
        "error" not in row
        and row["eager_diff"] <= ATOL
        and row["compiled_diff"] <= ATOL
        and row["compiles_again"] == 0
    )
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                        help="families to build (default: all)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per call")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def run(args: argparse.Namespace) -> dict:
    """Build and compare every family in ``args.families``; returns ``{"rows": [...], "equal", "built",
    "hf_tpu_errors", "targets_met"}``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)  # doctest: +SKIP
        >>> run(p.parse_args(["--families", "sd"]))["rows"][0]["equal"]  # doctest: +SKIP
        True
    """
    import hf_tpu.sim

    torch.set_num_threads(args.threads)
    hf_tpu.sim.enable()
    rows = [_family(name, args.steps) for name in args.families]
    equal = sum(r["equal"] for r in rows)
    in_hf_tpu = [r["family"] for r in rows if r.get("error_in") == "hf_tpu"]
    return {
        "rows": rows,
        "steps": args.steps,
        "equal": equal,
        "built": len(rows),
        "hf_tpu_errors": in_hf_tpu,
        "targets_met": not in_hf_tpu and equal >= 0.9 * len(rows),
    }


def print_table(figures: dict) -> None:
    """Print the sweep's table (markdown, as docs/diffusers.md holds it), a summary line and a JSON line."""
    print("| family | category | pipeline | eager vs CPU | compiled vs CPU | compiled modules | compiles (1st, 2nd) "
          "| equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in figures["rows"]:
        if "error" in r:
            print(f"| {r['family']} | {r['category']} | {r.get('pipeline', '-')} | error ({r['error_in']}): "
                  f"{r['error']} | | | | no |")
            continue
        print(f"| {r['family']} | {r['category']} | {r['pipeline']} | {r['eager_diff']:.1e} | "
              f"{r['compiled_diff']:.1e} | {', '.join(r['compiled_modules'])} | {r['compiles']}, "
              f"{r['compiles_again']} | {'yes' if r['equal'] else 'no'} |")
    share = figures["equal"] / max(figures["built"], 1)
    print(f"{figures['equal']} of {figures['built']} families equal the CPU eagerly and compiled, a second call "
          f"compiling nothing ({share:.0%}; target 90%); failures inside hf_tpu: "
          f"{', '.join(figures['hf_tpu_errors']) or 'none'}")
    print("status: " + ("ok" if figures["targets_met"] else "targets missed"))
    print(json.dumps({k: v for k, v in figures.items() if k != "rows"}))
