"""Qwen-Image 2.1 (QwenImage21Pipeline, a tiny local build) on the simulated tpu device: equal to upstream's CPU run
eagerly and compiled, and compiled without a graph break: hf_tpu's layout patch reads ``img_mask`` on the host once
per call, so each step is one graph (the KV-cache prefill step and the cached steps: two graphs per size)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from _reference import without_hf_tpu

from hf_tpu.diffusers import compile_pipeline, compiled_modules

ATOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    torch._dynamo.reset()  # dynamo shares graphs between instances of one model class: count this test's own
    yield
    torch._dynamo.reset()


def _image(pipe, seed: int = 0, steps: int = 2, **kwargs):
    return pipe(
        "a red fox",
        height=32,
        width=64,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        **kwargs,
    ).images


@pytest.fixture
def diffusers_integration():
    import hf_tpu

    with hf_tpu.enabled("diffusers"):
        yield


def test_qwen_image_21_matches_cpu_compiled_as_one_graph_per_step(sim, diffusers_integration):
    from hf_tpu.diffusers.testing import tiny_qwen_image_pipeline

    pipe = tiny_qwen_image_pipeline()
    with without_hf_tpu():  # upstream's forward, with its data-dependent layout, on the CPU
        reference = _image(pipe)
        reference_3 = _image(pipe, steps=3)
    pipe.to("tpu")
    np.testing.assert_allclose(_image(pipe), reference, atol=ATOL)
    # strict=True: a graph break would be an error, not a warning and a slower graph.
    compile_pipeline(pipe, strict=True)
    assert compiled_modules(pipe) == ["transformer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiled with graph breaks" warning either
        with sim.stats() as first:
            out = _image(pipe)
    np.testing.assert_allclose(out, reference, atol=ATOL)
    assert first.compiles == 2  # step 1 prefills the KV cache ("extract"), step 2 reads it ("cached")
    with sim.stats() as two_steps:
        _image(pipe, seed=1)
    assert two_steps.compiles == 0
    # A third step adds no host round trip: the layout is read once per call, not per step.
    with sim.stats() as three_steps:
        out = _image(pipe, steps=3)
    np.testing.assert_allclose(out, reference_3, atol=ATOL)
    assert three_steps.compiles == 0
    assert three_steps.host_syncs == two_steps.host_syncs


def test_layout_patch_equals_upstream_with_condition_image_and_padding():
    """Two prompts of different lengths (a padded text mask) and a condition image (image slots inside the prompt):
    the host-computed layout gives upstream's image, without the KV cache and with it."""
    import hf_tpu
    from hf_tpu import _patch
    from hf_tpu.diffusers.testing import tiny_qwen_image_pipeline

    was_enabled = _patch.is_enabled("diffusers")
    pipe = tiny_qwen_image_pipeline()
    condition = np.random.RandomState(0).randint(0, 255, (32, 32, 3), dtype=np.uint8)
    kwargs = {"image": condition, "output_resolution": 32}
    prompts = ["a red fox", "a fox in the snow at night"]
    with without_hf_tpu():
        reference = [_image_of(pipe, prompts, kv, **kwargs) for kv in (False, True)]
    with hf_tpu.enabled("diffusers"):
        from diffusers import QwenImage21Transformer2DModel

        from hf_tpu.diffusers import qwen_image_layout

        assert getattr(QwenImage21Transformer2DModel.forward, "__hf_tpu_layout__", False)
        calls = []
        upstream = qwen_image_layout.joint_layout
        qwen_image_layout.joint_layout = lambda *a, **k: calls.append(1) or upstream(*a, **k)
        try:
            patched = [_image_of(pipe, prompts, kv, **kwargs) for kv in (False, True)]
        finally:
            qwen_image_layout.joint_layout = upstream
    assert len(calls) == 2  # once per pipeline call, 2 steps each
    for got, want in zip(patched, reference):
        np.testing.assert_allclose(got, want, atol=ATOL)
    if not was_enabled:  # hf_tpu.enabled() reverted the patches: upstream's forward and nn.Module.__call__ again
        assert "__call__" not in QwenImage21Transformer2DModel.__dict__
        assert not getattr(QwenImage21Transformer2DModel.forward, "__hf_tpu_layout__", False)


def _image_of(pipe, prompts, use_kv_cache: bool, **kwargs):
    return pipe(
        prompts,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        use_kv_cache=use_kv_cache,
        **kwargs,
    ).images
