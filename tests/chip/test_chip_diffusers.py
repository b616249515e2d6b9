"""Diffusers on the chip: a tiny Stable Diffusion pipeline (hf_tpu.diffusers.testing, saved and loaded back) draws a
32x32 image on the device, eager and with hf_tpu's compiled UNet, from the CPU generator's seed: the CPU's image
within the default precision's tolerance."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.chip

# Text encoder, UNet blocks and VAE decoder: the matmul and convolution layers an image goes through, counted coarsely.
LAYERS = 8
_PIPES: dict[str, object] = {}


def _draw(pipe):
    import numpy as np
    import torch

    out = pipe("a squirrel", height=32, width=32, num_inference_steps=2,
               generator=torch.Generator("cpu").manual_seed(0), output_type="np")  # fmt: skip
    return torch.from_numpy(np.asarray(out.images)).float()


def _pipes(tmp_path_factory):
    if not _PIPES:
        from diffusers import DiffusionPipeline

        from hf_tpu.diffusers.testing import tiny_sd_pipeline

        path = tmp_path_factory.getbasetemp() / "chip-tiny-sd"
        tiny_sd_pipeline(path)
        cpu = DiffusionPipeline.from_pretrained(path)
        cpu.set_progress_bar_config(disable=True)
        _PIPES["expected"] = _draw(cpu)
        pipe = DiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPES["tpu"] = pipe.to("tpu")
    return _PIPES


def test_tiny_sd_image_equals_cpu(tpu, chip, needs, tmp_path_factory):
    needs("diffusers")
    pipes = _pipes(tmp_path_factory)
    chip.close(_draw(pipes["tpu"]), pipes["expected"], layers=LAYERS, what="the eager image")


def test_tiny_sd_compiled_unet_image_equals_cpu(tpu, chip, needs, tmp_path_factory):
    needs("diffusers")
    from hf_tpu.diffusers.compile import compile_pipeline

    pipes = _pipes(tmp_path_factory)
    compile_pipeline(pipes["tpu"])
    for label in ("cold", "warm"):
        chip.close(_draw(pipes["tpu"]), pipes["expected"], layers=LAYERS, what=f"the compiled ({label}) image")
