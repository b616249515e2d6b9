"""Frame counts and audio lengths of joint video + audio pipelines (MiniMax-H3), checked before any work is done.

MiniMax-H3's video VAE encodes clips of ``frames_per_chunk * n + latents_per_chunk`` frames (17n + 5 for the
released one: ``5n + 2`` latent frames) and the model generates ``min_duration`` to ``max_duration`` seconds at its
fixed ``fps`` (5 to 15 s at 24 fps: 124 to 345 frames). Its soundtrack is one audio latent per 1/40 s of the video,
per stereo channel. Upstream snaps a frame count up to the next valid one with a warning and refuses a duration out
of range, but takes pre-generated ``audio_latents`` (or ``latents``) of any length: the mismatch then surfaces inside
the transformer's packed sequence (inside a compiled graph, as dynamo's error). The pipeline is recognised by the
properties it declares (``vae_frames_per_chunk``, ``vae_latents_per_chunk``, ``audio_latent_channels``), not by name.

Example:
    >>> from hf_tpu.diffusers import check_audio_latents, valid_frame_counts
    >>> valid_frame_counts(minimax_pipe)[:3]  # doctest: +SKIP
    [124, 141, 158]
    >>> check_audio_latents(minimax_pipe, torch.randn(2, 4, 200), num_frames=124)  # doctest: +SKIP
    ValueError: MiniMaxH3ModularPipeline cannot take audio_latents of shape (2, 4, 200) for 124 frames: ...
"""

from __future__ import annotations

from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = ["audio_latent_count", "check_audio_latents", "check_chunked_frames", "chunked_frames", "valid_frame_counts"]


def _get(pipe: Any, name: str) -> Any:
    try:
        return getattr(pipe, name, None)
    except Exception:  # a modular pipeline's property needing a component that is not loaded
        return None


def chunked_frames(pipe: Any) -> tuple[int, int] | None:
    """``(frames_per_chunk, latents_per_chunk)`` of a chunked video VAE (MiniMax-H3: ``(17, 5)``), else None."""
    per_chunk, latents = _get(pipe, "vae_frames_per_chunk"), _get(pipe, "vae_latents_per_chunk")
    if isinstance(per_chunk, int) and isinstance(latents, int) and per_chunk > latents > 0:
        return per_chunk, latents
    return None


def valid_frame_counts(pipe: Any) -> list[int]:
    """Every frame count the pipeline generates: the VAE's chunked counts whose duration is in the model's range.

    Args:
        pipe: a pipeline; only a chunked-VAE video pipeline (MiniMax-H3) has counts to list.

    Returns:
        The valid counts (``per_chunk * n + latents``) in increasing order; [] for a pipeline without a chunked VAE.
    """
    chunks = chunked_frames(pipe)
    if chunks is None:
        return []
    per_chunk, latents = chunks
    fps, low, high = _get(pipe, "fps"), _get(pipe, "min_duration"), _get(pipe, "max_duration")
    counts = []
    n = 0
    while (frames := per_chunk * n + latents) <= (high * fps if fps and high else per_chunk * 64):
        if not (fps and low) or frames >= low * fps:
            counts.append(frames)
        n += 1
    return counts


def _nearest(counts: list[int], value: Any) -> str:
    if not counts:
        return "none"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{counts[0]}"
    below = [c for c in counts if c <= value]
    above = [c for c in counts if c >= value]
    picks = sorted({*(below[-1:] or []), *(above[:1] or [])})
    return ", ".join(str(c) for c in picks)


def _frame_problem(pipe: Any, num_frames: Any, strict: bool) -> str | None:
    counts = valid_frame_counts(pipe)
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
        return f"num_frames={num_frames!r} is not a positive int"
    if not counts:
        return None
    per_chunk, latents = chunked_frames(pipe)
    aligned = num_frames + (latents - num_frames) % per_chunk  # what upstream snaps it up to
    if not counts[0] <= aligned <= counts[-1]:
        fps = _get(pipe, "fps")
        return (
            f"num_frames={num_frames} (snapped to {aligned}, {aligned / fps:g} s at {fps} fps) is outside the "
            f"{_get(pipe, 'min_duration'):g} to {_get(pipe, 'max_duration'):g} seconds the model generates"
        )
    if strict and aligned != num_frames:
        return f"num_frames={num_frames} is not of the form {per_chunk}*n + {latents}"
    return None


def check_chunked_frames(pipe: Any, num_frames: Any, *, strict: bool = True) -> None:
    """Raise ``ValueError`` if a chunked-VAE video pipeline (MiniMax-H3) cannot make ``num_frames`` frames.

    ``strict=False`` accepts a count upstream snaps up to the next valid one itself (with its own warning) and refuses
    only what it cannot make at all: a count outside the model's duration range, or not a positive int.
    """
    problem = _frame_problem(pipe, num_frames, strict)
    if problem is None:
        return
    per_chunk, latents = chunked_frames(pipe)
    counts = valid_frame_counts(pipe)
    raise InvalidArgumentError(
        f"{type(pipe).__name__} cannot make {num_frames!r} frames: {problem}. Its video VAE encodes "
        f"{per_chunk}*n + {latents} frames and it generates {counts[0]} to {counts[-1]} frames; nearest valid counts: "
        f"{_nearest(counts, num_frames)}."
    )


def audio_latent_count(pipe: Any, num_frames: int) -> int:
    """Audio latents per channel that cover ``num_frames`` frames (after upstream's snapping): 40 per second.

    Args:
        pipe: a MiniMax-H3 pipeline (its ``fps`` and chunked VAE decide the snapping; 24 fps when it has none).
        num_frames: the clip's frame count as asked.

    Returns:
        The length ``n`` of the audio latents' last dimension for that clip.
    """
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_LATENTS_PER_SECOND,
        audio_latent_num_frames,
    )

    chunks = chunked_frames(pipe)
    if chunks is not None:
        per_chunk, latents = chunks
        num_frames += (latents - num_frames) % per_chunk
    return audio_latent_num_frames(num_frames, _get(pipe, "fps") or 24, MINIMAX_H3_AUDIO_LATENTS_PER_SECOND)


def check_audio_latents(pipe: Any, audio_latents: Any, num_frames: Any) -> None:
    """Raise ``ValueError`` if pre-generated ``audio_latents`` do not fit a clip of ``num_frames`` frames.

    MiniMax-H3 packs its soundtrack as ``(channels, audio_latent_channels, n)`` noise, ``n`` = one latent per 1/40 s
    of the (snapped) clip: 207 for 124 frames. The error names the shape this clip needs and the frame count that a
    tensor of this length would fit, if any.

    Args:
        pipe: the pipeline (a pipeline without a chunked VAE passes unchecked).
        audio_latents: the tensor the call passes, or None (nothing to check).
        num_frames: the clip's frame count (a non-int passes unchecked: :func:`check_frames` names it).

    Raises:
        ValueError (InvalidArgumentError): ``audio_latents`` is not a tensor of shape ``(audio_channels,
            audio_latent_channels, n)`` for this clip.
    """
    import torch

    if audio_latents is None or not isinstance(num_frames, int) or chunked_frames(pipe) is None:
        return
    channels, width = _get(pipe, "audio_channels"), _get(pipe, "audio_latent_channels")
    want = (channels, width, audio_latent_count(pipe, num_frames))
    got = tuple(audio_latents.shape) if isinstance(audio_latents, torch.Tensor) else None
    if got == want:
        return
    fits = [f for f in valid_frame_counts(pipe) if got and len(got) == 3 and audio_latent_count(pipe, f) == got[-1]]
    hint = f"; a tensor of {got[-1]} latents fits num_frames={fits[0]}" if fits else ""
    described = f"shape {got}" if got is not None else f"a {type(audio_latents).__name__}"
    raise InvalidArgumentError(
        f"{type(pipe).__name__} cannot take audio_latents of {described} for {num_frames} frames: the soundtrack of "
        f"{num_frames} frames is {want[2]} audio latents per channel (40 per second at {_get(pipe, 'fps')} fps), so "
        f"pass noise of shape {want} ({channels} channels x {width} latent channels x {want[2]}){hint}."
    )
