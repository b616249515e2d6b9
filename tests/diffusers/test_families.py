"""Pipeline families beyond SD/SD3 on the simulated tpu device, compiled, against the CPU run: Wan 2.1 (a 3-D patch,
a video VAE), Wan 2.2 (two experts, both compiled), a ControlNet pipeline, a Modular Diffusers pipeline, and a
denoiser with a graph break (compiled with breaks and a warning, or refused with strict=True)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from hf_tpu.diffusers import check_frames, check_resolution, compile_pipeline, compiled_modules, warmup

ATOL = 1e-4


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    torch._dynamo.reset()  # dynamo shares graphs between instances of one model class: count this test's own
    yield
    torch._dynamo.reset()


def _video(pipe, seed: int = 0):
    return pipe(
        "a cat",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        max_sequence_length=16,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).frames


def _count_calls(module, calls: dict, name: str) -> None:
    inner = module._compiled_call_impl

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return inner(*args, **kwargs)

    module._compiled_call_impl = counted


@pytest.mark.parametrize("two_experts", [False, True], ids=["wan2.1", "wan2.2"])
def test_wan_compiled_matches_cpu(sim, two_experts):
    from hf_tpu.diffusers.testing import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=two_experts)
    reference = _video(pipe)
    pipe.to("tpu")
    compile_pipeline(pipe)
    experts = ["transformer", "transformer_2"] if two_experts else ["transformer"]
    assert compiled_modules(pipe) == experts
    calls: dict[str, int] = {}
    for name in experts:
        _count_calls(getattr(pipe, name), calls, name)
    with sim.stats() as first:
        out = _video(pipe)
    np.testing.assert_allclose(out, reference, atol=ATOL)
    # Step 1 (t=1000) runs the high-noise expert, step 2 (t=3, below the 0.5 boundary) the low-noise one; each
    # call runs the compiled graph (the two experts share one: same class, same shapes, parameters as inputs).
    assert calls == ({"transformer": 2, "transformer_2": 2} if two_experts else {"transformer": 4})
    assert first.compiles == 1
    with sim.stats() as again:
        _video(pipe, seed=1)
    assert again.compiles == 0
    # The call checks know the (1, 2, 2) patch and the video VAE (sides / 8, time / 4).
    with pytest.raises(ValueError, match=r"multiples of 16.*nearest valid sizes \(width x height\): 32x32, 48x32"):
        check_resolution(pipe, 32, 40)
    with pytest.raises(ValueError, match="a clip has k\\*4 \\+ 1 frames; nearest valid counts: 9, 13"):
        check_frames(pipe, 10)


def test_sd35_announcement_snippet_matches_cpu(sim, load_pipe, images):
    """The TorchTPU announcement's Stable Diffusion 3.5 lines, word for word, on a tiny SD3 pipeline."""
    pipe = load_pipe("sd3")
    reference = images(pipe, 32)
    pipe.to("tpu")
    pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)
    with sim.stats() as first:
        out = images(pipe, 32)
    np.testing.assert_allclose(out, reference, atol=ATOL)
    assert first.compiles == 1
    with sim.stats() as again:
        images(pipe, 32, prompt="a second call at the same size")
    assert again.compiles == 0


def test_controlnet_compiled_matches_cpu(sim):
    from hf_tpu.diffusers.testing import tiny_sd_controlnet_pipeline

    pipe = tiny_sd_controlnet_pipeline()
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def run(p):
        gen = torch.Generator("cpu").manual_seed(0)
        return p("a cat", image=control, height=32, width=32, num_inference_steps=2, generator=gen, output_type="np")

    reference = run(pipe).images
    pipe.to("tpu")
    compile_pipeline(pipe)
    assert compiled_modules(pipe) == ["unet", "controlnet"]
    with sim.stats() as first:
        out = run(pipe).images
    np.testing.assert_allclose(out, reference, atol=ATOL)
    assert first.compiles == 2  # the UNet and the ControlNet
    with sim.stats() as again:
        run(pipe)
    assert again.compiles == 0


def test_modular_pipeline_with_components_manager(sim, load_pipe):
    """Modular Diffusers: the SD3 blocks over the tiny SD3 components, held by a ComponentsManager."""
    from diffusers.modular_pipelines import ComponentsManager, StableDiffusion3AutoBlocks

    classic = load_pipe("sd3")
    manager = ComponentsManager()
    pipe = StableDiffusion3AutoBlocks().init_pipeline(components_manager=manager)
    pipe.update_components(**{k: v for k, v in classic.components.items() if k in pipe.component_names and v})
    pipe.set_progress_bar_config(disable=True)

    def run(p, prompt="a photo of a squirrel eating a burger"):
        gen = torch.Generator("cpu").manual_seed(0)
        return p(prompt=prompt, height=32, width=32, num_inference_steps=2, generator=gen, output="images",
                 output_type="np")

    reference = run(pipe)
    pipe.to("tpu")
    assert pipe.device.type == "tpu"
    held = [c for c in manager.components.values() if isinstance(c, torch.nn.Module)]
    assert len(held) == 5 and {str(p.device) for c in held for p in c.parameters()} == {"tpu:0"}
    compile_pipeline(pipe)
    assert compiled_modules(pipe) == ["transformer"]
    with sim.stats() as s:
        results = warmup(pipe, resolutions=[32], num_inference_steps=2, progress=False)
    assert [(r.height, r.width, r.graphs) for r in results] == [(32, 32, 1)] and s.compiles == 1
    with sim.stats() as s:
        out = run(pipe)
        run(pipe, prompt="another prompt")
    assert s.compiles == 0
    np.testing.assert_allclose(out, reference, atol=ATOL)


def _host_sync(module, args):  # data-dependent code: a value the host reads from the device on every call
    if float(args[0].abs().amax()) < 0:
        raise AssertionError


def test_graph_break_compiles_with_a_warning_or_fails_strict(sim, load_pipe, images):
    pipe = load_pipe("sd")
    pipe.unet.register_forward_pre_hook(_host_sync)
    reference = images(pipe, 32)
    pipe.to("tpu")
    compile_pipeline(pipe, strict=True)
    with pytest.raises(RuntimeError, match=r"strict=True\): StableDiffusionPipeline.unet .* cannot be compiled as"):
        images(pipe, 32)
    compile_pipeline(pipe)
    with pytest.warns(UserWarning, match=r"unet .*compiled with \d+ graph break.*host round trip per step") as rec:
        out = images(pipe, 32)
    assert len([w for w in rec if "graph break" in str(w.message)]) == 1
    np.testing.assert_allclose(out, reference, atol=ATOL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next call is quiet
        again = images(pipe, 32)
    np.testing.assert_allclose(again, reference, atol=ATOL)
