"""Stable Diffusion 3 on a TPU: pipe.to("tpu"), a compiled transformer, warm-up, and the CPU image reproduced.

Runs on a TPU VM (torch-tpu installed) with a real checkpoint, or anywhere on the simulated TPU with a tiny SD3
pipeline built from configs (nothing is downloaded):

    HF_TPU_SIMULATE=1 python examples/diffusers_sd3.py                       # tiny pipeline, simulated tpu
    python examples/diffusers_sd3.py --model ./stable-diffusion-3-medium --size 1024 --steps 28 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from diffusers import StableDiffusion3Pipeline

import hf_tpu
from hf_tpu import runtime
from hf_tpu.diffusers import compile_pipeline, warmup
from hf_tpu.diffusers.testing import tiny_sd3_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a saved StableDiffusion3Pipeline (default: a tiny one built here)")
    parser.add_argument("--size", type=int, default=32, help="image side (default 32, the tiny pipeline's)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default="out/sd3_tpu.png", help="the image (default out/sd3_tpu.png)")
    args = parser.parse_args()

    info = runtime.require_tpu("examples/diffusers_sd3.py")
    print(f"TPU: {info.mode}, {info.device_count} device(s)")
    hf_tpu.enable("diffusers")  # pipe.to("tpu") then refuses what it cannot place, instead of leaving it behind

    path = args.model
    if path is None:
        tmp = tempfile.mkdtemp(prefix="hf_tpu_sd3_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the tiny pipeline is removed at exit
        path = tiny_sd3_pipeline(tmp)
    dtype = getattr(torch, args.dtype)
    pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    prompt = "a watercolor fox"

    def make(p, size: int):
        # A CPU generator: the latents are drawn on the host, so the image equals the CPU run with this seed.
        g = torch.Generator("cpu").manual_seed(0)
        return p(prompt, height=size, width=size, num_inference_steps=args.steps, generator=g, output_type="np")

    reference = None
    if args.model is None:  # the tiny pipeline is cheap enough to run on the CPU for comparison
        reference = make(pipe, args.size).images[0]

    pipe.to("tpu")
    compile_pipeline(pipe)  # the transformer: backend="tpu", fullgraph=True, dynamic=False
    sizes = [args.size, (args.size // 2, args.size)]  # the sizes you will serve; each compiles once, here
    for r in warmup(pipe, resolutions=sizes, num_inference_steps=args.steps):
        print(f"warmed up {r.height}x{r.width}: {r.graphs} graph(s), {r.seconds:.1f}s")

    start = time.perf_counter()
    image = make(pipe, args.size).images[0]
    print(f"{args.size}x{args.size}, {args.steps} steps on {pipe.device}: {time.perf_counter() - start:.2f}s")
    if reference is not None:
        print(f"largest difference to the CPU image: {np.abs(image - reference).max():.2e}")

    from PIL import Image

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Image.fromarray((image * 255).round().astype("uint8")).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
