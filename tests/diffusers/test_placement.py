"""pipe.to("tpu") with the hf_tpu diffusers integration: what upstream leaves half-done now fails clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_tpu
from hf_tpu.diffusers import check_components_on, has_call_checks
from hf_tpu.runtime import RuntimeInfo, TPUNotAvailableError


@pytest.fixture
def integration():
    with hf_tpu.enabled("diffusers"):
        yield


class _CudaLooking(torch.Generator):
    """A CPU generator that reports another device (this host has only CPU generators)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_enable_is_reversible():
    from diffusers import DiffusionPipeline

    upstream = DiffusionPipeline.to
    with hf_tpu.enabled("diffusers"):
        assert DiffusionPipeline.to is not upstream
    assert DiffusionPipeline.to is upstream


def test_to_tpu_with_integration_matches_cpu(sim, integration, load_pipe, images):
    cpu = images(load_pipe("sd"), 32)
    pipe = load_pipe("sd").to("tpu")
    assert has_call_checks(pipe)
    np.testing.assert_allclose(images(pipe, 32), cpu, atol=1e-4)
    pipe.to("cpu")  # other targets go straight to upstream
    check_components_on(pipe, "cpu")


def test_no_tpu_says_how_to_get_one(integration, load_pipe, monkeypatch):
    none = RuntimeInfo("none", 0, 0, 0, None, None, None, "no TPU chips and no torch-tpu")
    monkeypatch.setattr(hf_tpu.runtime, "detect", lambda: none)
    with pytest.raises(TPUNotAvailableError, match=r"StableDiffusionPipeline.to\('tpu'\).*HF_TPU_SIMULATE=1"):
        load_pipe("sd").to("tpu")


def test_group_offloaded_component(sim, load_pipe):
    pipe = load_pipe("sd3")
    pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    pipe.to("tpu")  # upstream: a log warning, and the transformer stays on the host
    assert pipe.transformer.pos_embed.proj.weight.device.type == "cpu"

    pipe = load_pipe("sd3")
    pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    with hf_tpu.enabled("diffusers"), pytest.raises(ValueError, match="transformer .* is group-offloaded"):
        pipe.to("tpu")


def test_meta_component(sim, load_pipe):
    def broken():
        pipe = load_pipe("sd")
        conv = pipe.vae.decoder.conv_out
        conv.weight = torch.nn.Parameter(torch.empty_like(conv.weight, device="meta"))
        return pipe

    with pytest.raises(NotImplementedError, match="meta tensor"):  # upstream: names no component
        broken().to("tpu")
    with (
        hf_tpu.enabled("diffusers"),
        pytest.raises(ValueError, match=r"vae \(AutoencoderKL\) has tensors on the meta"),
    ):
        broken().to("tpu")


def test_component_that_does_not_move(sim, integration, load_pipe):
    pipe = load_pipe("sd")
    pipe.text_encoder.to = lambda *args, **kwargs: pipe.text_encoder  # e.g. a wrapper whose .to is a no-op
    with pytest.raises(RuntimeError, match=r"left tensors off tpu.*text_encoder \(CLIPTextModel\)"):
        pipe.to("tpu")


def test_generator_on_wrong_device(sim, load_pipe, images):
    pipe = load_pipe("sd").to("tpu")
    # upstream already refuses a cuda generator, in its own words
    with pytest.raises(ValueError, match="Cannot generate a tpu:0 tensor from a generator of type cuda"):
        pipe("a cat", height=32, width=32, num_inference_steps=1, generator=_CudaLooking())
    with hf_tpu.enabled("diffusers"):
        pipe = load_pipe("sd").to("tpu")
        with pytest.raises(ValueError, match=r"runs on tpu:0 but got a generator on cuda:0.*torch.Generator\('cpu'\)"):
            pipe("a cat", height=32, width=32, num_inference_steps=1, generator=_CudaLooking())
        with pytest.raises(ValueError, match="2 generators for a batch of 1"):
            pipe("a cat", height=32, width=32, num_inference_steps=1, generator=[torch.Generator()] * 2)


def test_sequentially_offloaded_pipeline(sim, load_pipe):
    pipe = load_pipe("sd")
    pipe.enable_sequential_cpu_offload(device="tpu")
    with pytest.raises(NotImplementedError, match="meta tensor"):  # upstream refuses only for cuda/xpu
        pipe.to("tpu")
    with hf_tpu.enabled("diffusers"), pytest.raises(ValueError, match=r"unet .* is sequentially offloaded"):
        pipe.to("tpu")


def test_modular_pipeline_to_tpu_is_checked_too(sim, load_pipe):
    """ModularPipeline.to is wrapped like DiffusionPipeline.to: a meta component is named, and reverted on exit."""
    from diffusers.modular_pipelines import ModularPipeline, StableDiffusion3AutoBlocks

    upstream = ModularPipeline.to
    classic = load_pipe("sd3")
    conv = classic.vae.decoder.conv_out
    conv.weight = torch.nn.Parameter(torch.empty_like(conv.weight, device="meta"))
    pipe = StableDiffusion3AutoBlocks().init_pipeline()
    pipe.update_components(**{k: v for k, v in classic.components.items() if k in pipe.component_names and v})
    with (
        hf_tpu.enabled("diffusers"),
        pytest.raises(ValueError, match=r"StableDiffusion3ModularPipeline.to\('tpu'\) .* vae \(AutoencoderKL\) has"),
    ):
        assert ModularPipeline.to is not upstream
        pipe.to("tpu")
    assert ModularPipeline.to is upstream
