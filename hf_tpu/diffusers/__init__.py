"""Diffusers on TPU: placement checks, a compiled denoiser, warm-up of resolution buckets.

``pipe.to("tpu")`` is upstream diffusers' own and moves every model component; with ``hf_tpu.enable()`` it also
refuses what it cannot place (no TPU, offloaded or meta components) instead of leaving them on the host.
:func:`compile_pipeline` compiles the denoiser with ``backend="tpu", fullgraph=True, dynamic=False`` and
:func:`warmup` compiles the resolutions you will serve ahead of time.

Example:
    >>> import torch, hf_tpu
    >>> from diffusers import StableDiffusion3Pipeline
    >>> from hf_tpu.diffusers import compile_pipeline, warmup
    >>> pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=torch.bfloat16).to("tpu")  # doctest: +SKIP
    >>> compile_pipeline(pipe); warmup(pipe, resolutions=[1024])                                # doctest: +SKIP
    >>> image = pipe("a cat", generator=torch.Generator("cpu").manual_seed(0)).images[0]        # doctest: +SKIP
"""

from __future__ import annotations

from hf_tpu.diffusers._av_checks import audio_latent_count, check_audio_latents, valid_frame_counts
from hf_tpu.diffusers._call_checks import has_call_checks, install_call_checks, remove_call_checks
from hf_tpu.diffusers._checks import (
    check_components_on,
    check_frames,
    check_generator,
    check_resolution,
    denoiser,
    denoisers,
    frame_multiple,
    resolution_limits,
)
from hf_tpu.diffusers.compile import WarmupResult, compile_pipeline, compiled_modules, uncompile_pipeline, warmup

__all__ = [
    "WarmupResult",
    "audio_latent_count",
    "check_audio_latents",
    "check_components_on",
    "check_frames",
    "check_generator",
    "check_resolution",
    "compile_pipeline",
    "compiled_modules",
    "denoiser",
    "denoisers",
    "frame_multiple",
    "has_call_checks",
    "install_call_checks",
    "remove_call_checks",
    "resolution_limits",
    "uncompile_pipeline",
    "valid_frame_counts",
    "warmup",
]
