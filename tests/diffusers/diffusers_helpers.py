"""Helpers shared by the diffusers tests: load a saved tiny pipeline, run it at a size with a seeded CPU generator."""

from __future__ import annotations

import numpy as np
import torch

PROMPT = "a photo of a squirrel eating a burger"


def load(model_dirs, kind: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dirs[kind])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, size: int | tuple[int, int] = 32, seed: int = 0, **kwargs) -> np.ndarray:
    height, width = (size, size) if isinstance(size, int) else size
    kwargs.setdefault("prompt", PROMPT)
    kwargs.setdefault("num_inference_steps", 2)
    return pipe(
        height=height,
        width=width,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        **kwargs,
    ).images
