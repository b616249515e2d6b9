"""Resolution and generator checks, on CPU pipelines (no device needed)."""

from __future__ import annotations

import pytest
import torch

from hf_tpu.diffusers import check_generator, check_resolution, denoiser, resolution_limits


def test_denoiser_and_limits(load_pipe):
    sd3, sd = load_pipe("sd3"), load_pipe("sd")
    assert denoiser(sd3)[0] == "transformer" and denoiser(sd)[0] == "unet"
    # SD3: VAE scale 2 x patch 2; the positional table (96 patches) bounds the side. SD: VAE scale 8, no bound.
    assert resolution_limits(sd3) == (4, 96 * 4)
    assert resolution_limits(sd) == (8, None)


@pytest.mark.parametrize(
    ("kind", "size", "message"),
    [
        ("sd3", (30, 32), "height=30 is not a multiple of 4"),
        ("sd3", (30, 30), "nearest valid sizes (width x height): 28x28, 28x32, 32x28, 32x32"),
        ("sd3", (2, 32), "height=2 is below the smallest side, 4"),
        ("sd3", (32, 400), "width=400 is above the largest side, 384"),
        ("sd", (36, 64), "height=36 is not a multiple of 8"),
    ],
)
def test_check_resolution_rejects(load_pipe, kind, size, message):
    pipe = load_pipe(kind)
    with pytest.raises(ValueError, match="cannot make") as err:
        check_resolution(pipe, *size)
    assert message in str(err.value)


def test_check_resolution_accepts(load_pipe):
    check_resolution(load_pipe("sd3"), 32, 48)
    check_resolution(load_pipe("sd"), 32, 64)


def test_check_resolution_agrees_with_upstream(load_pipe, images):
    """A size hf_tpu accepts runs upstream; one the pipeline refuses, hf_tpu refuses too."""
    run = images
    pipe = load_pipe("sd3")
    assert run(pipe, (28, 36), num_inference_steps=1).shape == (1, 28, 36, 3)
    with pytest.raises(ValueError):
        run(pipe, (30, 32), num_inference_steps=1)
    with pytest.raises(ValueError):
        check_resolution(pipe, 30, 32)


def test_check_generator(load_pipe):
    pipe = load_pipe("sd")
    check_generator(pipe, torch.Generator("cpu").manual_seed(0))
    check_generator(pipe, [torch.Generator("cpu"), torch.Generator("cpu")], batch_size=2)
    check_generator(pipe, None)
    with pytest.raises(TypeError, match="torch.Generator"):
        check_generator(pipe, 0)
    with pytest.raises(ValueError, match="3 generators for a batch of 2"):
        check_generator(pipe, [torch.Generator("cpu")] * 3, batch_size=2)
