"""MiniMax-H3 (joint video + audio, Modular Diffusers only) on the simulated tpu device: the tiny pipeline compiled
equals its CPU run, a second call at the same size compiles nothing, and frame counts and audio latents the VAEs
cannot take get hf_tpu's error naming valid ones, before any block runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_tpu.diffusers import (
    audio_latent_count,
    check_audio_latents,
    check_frames,
    compile_pipeline,
    compiled_modules,
    install_call_checks,
    valid_frame_counts,
)
from hf_tpu.diffusers.testing import tiny_minimax_h3_pipeline

ATOL = 1e-4


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(pipe, prompt: str = "a cat", **kwargs):
    kwargs.setdefault("num_frames", 124)
    out = pipe(
        prompt=prompt,
        height=16,
        width=16,
        num_inference_steps=3,  # MiniMax-H3's schedule ends at sigma 0: 3 sigmas, 2 transformer steps
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        output=["videos", "audio"],
        **kwargs,
    )
    return out["videos"], out["audio"].cpu().numpy()


def test_minimax_h3_modular_compiled_matches_cpu(sim):
    pipe = tiny_minimax_h3_pipeline()
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    video_ref, audio_ref = _run(pipe)
    assert video_ref.shape == (1, 124, 16, 16, 3) and audio_ref.shape == (1, 2, 207 * 4)
    pipe.to("tpu")
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    placed = {n: {str(p.device) for p in m.parameters()} for n, m in modules.items()}
    assert placed == dict.fromkeys(["text_encoder", "vae", "audio_vae", "transformer"], {"tpu:0"})
    compile_pipeline(pipe)
    assert compiled_modules(pipe) == ["transformer"]
    calls = []
    compiled = pipe.transformer._compiled_call_impl
    pipe.transformer._compiled_call_impl = lambda *a, **k: (calls.append(1), compiled(*a, **k))[1]
    with sim.stats() as first:
        video, audio = _run(pipe)
    np.testing.assert_allclose(video, video_ref, atol=ATOL)
    np.testing.assert_allclose(audio, audio_ref, atol=ATOL)
    assert len(calls) == 2, "two denoising steps, each through the compiled transformer"
    # Two graphs: the first step's rows share one noise level (t = 1 for video and audio), the second step's two (the
    # video and audio schedules shift differently), so the transformer's `timestep` input is (1,) and then (2,).
    assert first.compiles == 2
    # The text rows are part of MiniMax-H3's packed sequence: a prompt of another token count is another shape.
    # "a dog" is 5 byte tokens, as "a cat" is.
    with sim.stats() as again:
        _run(pipe, prompt="a dog")
    assert again.compiles == 0


def test_minimax_h3_frame_counts_and_audio_latents_are_checked():
    pipe = tiny_minimax_h3_pipeline()
    counts = valid_frame_counts(pipe)  # 17n + 5 frames, 5 to 15 seconds at 24 fps
    assert counts[:3] == [124, 141, 158] and counts[-1] == 345 and all(c % 17 == 5 for c in counts)
    for good in (124, 345):
        check_frames(pipe, good)
    with pytest.raises(ValueError, match=r"cannot make 130 frames: .*17\*n \+ 5.*nearest valid counts: 124, 141"):
        check_frames(pipe, 130)
    with pytest.raises(ValueError, match=r"cannot make 400 frames: .*outside the 5 to 15 seconds.*valid counts: 345"):
        check_frames(pipe, 400)
    assert audio_latent_count(pipe, 124) == 207 and audio_latent_count(pipe, 130) == audio_latent_count(pipe, 141)
    check_audio_latents(pipe, torch.zeros(2, 4, 207), 124)
    with pytest.raises(ValueError, match=r"audio_latents of shape \(2, 4, 200\) for 124 frames: .*\(2, 4, 207\)"):
        check_audio_latents(pipe, torch.zeros(2, 4, 200), 124)
    with pytest.raises(ValueError, match=r"pass noise of shape \(2, 4, 207\).*fits num_frames=141"):
        check_audio_latents(pipe, torch.zeros(2, 4, 235), 124)

    # Per call, as one block at the head of the pipeline's own blocks: refused before the conditioner runs.
    install_call_checks(pipe)
    encoder_calls = []
    pipe.text_encoder.model.register_forward_pre_hook(lambda *_: encoder_calls.append(1))
    with pytest.raises(ValueError, match=r"cannot make 400 frames: .*nearest valid counts: 345"):
        _run(pipe, num_frames=400)
    with pytest.raises(ValueError, match=r"audio_latents of shape \(2, 4, 200\) for 124 frames"):
        _run(pipe, audio_latents=torch.zeros(2, 4, 200))
    with pytest.raises(ValueError, match=r"cannot make a 16x12 \(width x height\) .*multiples of 8"):
        pipe(prompt="a cat", height=12, width=16, num_inference_steps=1)
    assert encoder_calls == []
    # A count upstream snaps up itself (with its own warning) and noise of the right length pass.
    video, audio = _run(pipe, num_frames=130, audio_latents=torch.zeros(2, 4, 235))
    assert video.shape[1] == 141 and audio.shape == (1, 2, 235 * 4) and len(encoder_calls) == 1


def test_minimax_h3_ref2va_partition_is_a_denoiser():
    """``ref2va`` loads the ``transformer_ref`` partition alone: compile_pipeline finds it as the denoiser."""
    from hf_tpu.diffusers import denoisers

    pipe = tiny_minimax_h3_pipeline()
    transformer = pipe.transformer
    pipe.update_components(transformer_ref=transformer, transformer=None)
    assert [(name, module) for name, module in denoisers(pipe)] == [("transformer_ref", transformer)]
