"""Tiny SD3 and SD pipelines on the simulated tpu device, eager and compiled, against the CPU run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_tpu.diffusers import compile_pipeline, compiled_modules, uncompile_pipeline, warmup

ATOL = 1e-4  # float32 on both sides; the images are in [0, 1]


@pytest.fixture(scope="module")
def cpu_reference(model_dirs):
    from diffusers_helpers import load, run

    refs = {}
    for kind in ("sd3", "sd"):
        pipe = load(model_dirs, kind)
        refs[kind] = {32: run(pipe, 32), (32, 48): run(pipe, (32, 48))}
    return refs


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Each test counts its own compiles: dynamo shares compiled code between instances of the same model class
    (parameters are graph inputs), so a graph compiled by an earlier test would otherwise be reused."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _on_tpu(pipe) -> set[str]:
    return {
        str(t.device)
        for c in pipe.components.values()
        if isinstance(c, torch.nn.Module)
        for t in (*c.parameters(), *c.buffers())
    }


@pytest.mark.parametrize("kind", ["sd3", "sd"])
def test_eager_matches_cpu(sim, load_pipe, images, cpu_reference, kind):
    """Upstream pipe.to("tpu") (no hf_tpu integration) moves every component; the image equals the CPU one."""
    pipe = load_pipe(kind).to("tpu")
    assert _on_tpu(pipe) == {"tpu:0"}
    assert pipe.device.type == "tpu" and pipe._execution_device.type == "tpu"
    with sim.stats() as s:
        out = images(pipe, 32)
    np.testing.assert_allclose(out, cpu_reference[kind][32], atol=ATOL)
    assert s.compiles == 0
    # The CPU generator drew the latents on the host: one tensor crossed for them, not one per step.
    assert s.h2d_copies >= 1


def test_compiled_unet_matches_cpu_and_compiles_once_per_size(sim, load_pipe, images, cpu_reference):
    pipe = load_pipe("sd").to("tpu")
    compile_pipeline(pipe)
    assert compiled_modules(pipe) == ["unet"]
    with sim.stats() as first:
        out = images(pipe, 32)
    np.testing.assert_allclose(out, cpu_reference["sd"][32], atol=ATOL)
    assert first.compiles == 1  # the UNet, whole (fullgraph), reused by both steps

    with sim.stats() as again:
        images(pipe, 32, prompt="another prompt of another length")
    assert again.compiles == 0
    assert again.shape_signatures == 0  # nothing new for the eager parts either

    with sim.stats() as new_size:
        out = images(pipe, (32, 48))
    np.testing.assert_allclose(out, cpu_reference["sd"][(32, 48)], atol=ATOL)
    assert new_size.compiles == 1

    compile_pipeline(pipe)  # same options: keeps the compiled graphs
    with sim.stats() as s:
        images(pipe, 32)
    assert s.compiles == 0
    uncompile_pipeline(pipe)
    assert compiled_modules(pipe) == []
    with sim.stats() as s:
        out = images(pipe, 32)
    assert s.compiles == 0
    np.testing.assert_allclose(out, cpu_reference["sd"][32], atol=ATOL)


def test_compiled_vae_decoder_matches_cpu(sim, load_pipe, images, cpu_reference):
    """The SD VAE's mid-block (GroupNorm after the attention's channels-last residual) compiles with the tpu backend:
    compile_pipeline adds hf_tpu._group_norm's decomposition, without which torch_tpu 0.2.0's lowering and the
    simulator refuse it (tests/diffusers/test_group_norm_layout.py)."""
    pipe = load_pipe("sd").to("tpu")
    compile_pipeline(pipe, vae=True)
    assert sorted(compiled_modules(pipe)) == ["unet", "vae.decoder"]
    with sim.stats() as s:
        out = images(pipe, 32)
    np.testing.assert_allclose(out, cpu_reference["sd"][32], atol=ATOL)
    assert s.compiles == 2  # the UNet and the decoder
    with sim.stats() as s:
        images(pipe, 32)
    assert s.compiles == 0


def test_warmup_then_compiled_sd3_matches_cpu(sim, load_pipe, images, cpu_reference, capsys):
    pipe = load_pipe("sd3").to("tpu")
    compile_pipeline(pipe)
    assert compiled_modules(pipe) == ["transformer"]
    with sim.stats() as s:
        results = warmup(pipe, resolutions=[32, (32, 48)], num_inference_steps=2, guidance_scale=7.0)
    assert s.compiles == 2
    assert [(r.height, r.width, r.graphs) for r in results] == [(32, 32, 1), (32, 48, 1)]
    assert "hf_tpu warm-up" in capsys.readouterr().err  # the progress bar
    with sim.stats() as s:
        small = images(pipe, 32, guidance_scale=7.0)
        large = images(pipe, (32, 48), guidance_scale=7.0)
    assert s.compiles == 0 and s.shape_signatures == 0  # nothing at all is new after the warm-up
    with sim.stats() as s:
        images(pipe, 32, guidance_scale=7.0, num_inference_steps=3, prompt="more steps, another prompt")
    assert s.compiles == 0  # the step count only changes the scheduler's small eager ops
    np.testing.assert_allclose(small, cpu_reference["sd3"][32], atol=ATOL)
    np.testing.assert_allclose(large, cpu_reference["sd3"][(32, 48)], atol=ATOL)


def test_compile_needs_the_pipeline_on_tpu(sim, load_pipe):
    pipe = load_pipe("sd")
    with pytest.raises(ValueError, match=r"unet on the TPU, but it is on cpu: call pipe.to\('tpu'\) first"):
        compile_pipeline(pipe)


def test_warmup_refuses_bad_sizes_before_compiling(sim, load_pipe):
    pipe = load_pipe("sd3").to("tpu")
    compile_pipeline(pipe)
    with sim.stats() as s, pytest.raises(ValueError, match=r"32x30 \(width x height\) image"):
        warmup(pipe, resolutions=[32, (30, 32)], progress=False)
    assert s.compiles == 0


def test_compiled_call_checks_size_before_tracing(sim, load_pipe, images):
    """SD3's positional table bounds the size: upstream raises inside the model, which a compiled model turns
    into dynamo's 'Observed exception'; the per-call check raises first, naming the limit."""
    pipe = load_pipe("sd3").to("tpu")
    compile_pipeline(pipe)
    with sim.stats() as s, pytest.raises(ValueError, match="above the largest side, 384"):
        images(pipe, (392, 32))
    assert s.compiles == 0
