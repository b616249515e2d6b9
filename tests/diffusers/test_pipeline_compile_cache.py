"""Resolution-bucket warm-up with the persistent compile cache: a new pipeline loads its graphs, compiles none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_tpu.diffusers import compile_pipeline, warmup

ATOL = 1e-4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_second_pipeline_warms_up_from_the_cache(sim, load_pipe, images, tmp_path):
    expected = images(load_pipe("sd3"), 32, guidance_scale=7.0)
    cache = tmp_path / "cache"

    first = load_pipe("sd3").to("tpu")
    compile_pipeline(first, cache_dir=cache)
    with sim.stats() as s:
        (cold,) = warmup(first, resolutions=[32], num_inference_steps=2, guidance_scale=7.0, progress=False)
    assert s.compiles == 1 and s.compile_cache_hits == 0 and cold.from_cache == 0
    assert list(cache.rglob("*.bin"))

    torch._dynamo.reset()
    second = load_pipe("sd3").to("tpu")
    compile_pipeline(second)
    with sim.stats() as s:
        (warm,) = warmup(
            second, resolutions=[32], num_inference_steps=2, guidance_scale=7.0, progress=False, cache_dir=cache
        )
        got = images(second, 32, guidance_scale=7.0)
    assert s.compiles == 0 and s.compile_cache_hits == 1 and warm.from_cache == 1
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_warmup_with_a_cache_needs_a_compiled_denoiser(sim, load_pipe, tmp_path):
    pipe = load_pipe("sd").to("tpu")
    with pytest.raises(ValueError, match=r"call hf_tpu.diffusers.compile_pipeline\(pipe\) first"):
        warmup(pipe, resolutions=[32], cache_dir=tmp_path, progress=False)
