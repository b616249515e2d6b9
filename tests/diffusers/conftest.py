"""Tiny SD3 and SD pipelines saved once per session and loaded back through ``from_pretrained`` by each test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_tpu.diffusers.testing import tiny_sd3_pipeline, tiny_sd_pipeline

PROMPT = "a photo of a squirrel eating a burger"


@pytest.fixture(scope="session")
def sim():
    import hf_tpu.sim

    hf_tpu.sim.enable()
    return hf_tpu.sim


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {"sd3": tiny_sd3_pipeline(root / "sd3"), "sd": tiny_sd_pipeline(root / "sd")}


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


@pytest.fixture
def load_pipe(model_dirs):
    return lambda kind: load(model_dirs, kind)


@pytest.fixture
def images():
    return run
