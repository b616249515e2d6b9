"""Validate a pipeline call's size and generator before any work reaches the TPU.

A compiled denoiser turns a size error raised inside the model (SD3's "cannot be larger than pos_embed_max_size")
into dynamo's "Observed exception" after paying for the trace, and a generator on the wrong device fails inside
``torch.randn`` with no word about the pipeline. Every diffusers pipeline calls ``self.check_inputs(...)`` with
the height and width first, and ``self.prepare_latents(...)`` with the generator before the first step; this
module wraps those two methods *on one pipeline instance* (never on the class) with :func:`check_resolution`,
:func:`check_frames` and :func:`check_generator`. :func:`compile_pipeline` and, with ``hf_tpu.enable("diffusers")``,
``pipe.to("tpu")`` install them; :func:`remove_call_checks` takes them off. A Modular Diffusers pipeline has
neither method: it gets the same checks (and MiniMax-H3's frame count and audio latents) as one block at the head of
its own blocks (:mod:`._modular_checks`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hf_tpu.diffusers import _modular_checks
from hf_tpu.diffusers._checks import check_frames, check_generator, check_resolution

__all__ = ["has_call_checks", "install_call_checks", "remove_call_checks"]

_METHODS = ("check_inputs", "prepare_latents")
_FLAG = "__hf_tpu_call_check__"


def _bind(method: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    try:
        return dict(inspect.signature(method).bind_partial(*args, **kwargs).arguments)
    except TypeError:  # let the upstream method raise its own error for a bad call
        return {}


def _checked_inputs(pipe: Any, method: Any) -> Any:
    @functools.wraps(method)
    def check_inputs(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(method, args, kwargs)
        height, width = bound.get("height"), bound.get("width")
        if isinstance(height, int) and isinstance(width, int):
            check_resolution(pipe, height, width)
        # Only the LTX pipelines pass num_frames to check_inputs and floor a count their VAE cannot encode; Allegro
        # passes it too but its VAE takes any count (ceil(n / t) latent frames).
        frames, ltx = bound.get("num_frames"), getattr(pipe, "vae_temporal_compression_ratio", None)
        if isinstance(frames, int) and isinstance(ltx, int):
            check_frames(pipe, frames)
        return method(*args, **kwargs)

    setattr(check_inputs, _FLAG, True)
    return check_inputs


def _checked_latents(pipe: Any, method: Any) -> Any:
    @functools.wraps(method)
    def prepare_latents(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(method, args, kwargs)
        if bound.get("latents") is None and bound.get("generator") is not None:
            batch = bound.get("batch_size")
            check_generator(pipe, bound["generator"], batch if isinstance(batch, int) else None)
        return method(*args, **kwargs)

    setattr(prepare_latents, _FLAG, True)
    return prepare_latents


def has_call_checks(pipe: Any) -> bool:
    """Whether :func:`install_call_checks` is in force on ``pipe``.

    Args:
        pipe: a ``DiffusionPipeline`` or ``ModularPipeline``.

    Returns:
        True when this instance's checks are installed.
    """
    if _modular_checks.is_modular(pipe):
        return _modular_checks.has_checks(pipe)
    return any(getattr(pipe.__dict__.get(name), _FLAG, False) for name in _METHODS)


def install_call_checks(pipe: Any) -> Any:
    """Wrap ``pipe.check_inputs`` and ``pipe.prepare_latents`` of this instance (idempotent). Returns ``pipe``.

    A modular pipeline gets the check block at the head of its blocks instead.

    Args:
        pipe: a ``DiffusionPipeline`` (its instance, never its class, is changed) or ``ModularPipeline``.

    Returns:
        ``pipe``, whose later calls check their size, frame count and generator first (:func:`check_resolution`,
        :func:`check_frames`, :func:`check_generator`: each raises ``ValueError`` naming the fix).
    """
    if _modular_checks.is_modular(pipe):
        return _modular_checks.install(pipe)
    wrappers = {"check_inputs": _checked_inputs, "prepare_latents": _checked_latents}
    for name, wrap in wrappers.items():
        if getattr(pipe.__dict__.get(name), _FLAG, False):
            continue
        method = getattr(pipe, name, None)
        if method is None:
            continue
        pipe.__dict__[name] = wrap(pipe, method)
    return pipe


def remove_call_checks(pipe: Any) -> Any:
    """Undo :func:`install_call_checks` on ``pipe``. Returns ``pipe``.

    Args:
        pipe: a pipeline with or without the checks.

    Returns:
        ``pipe``, its call checks removed.
    """
    if _modular_checks.is_modular(pipe):
        return _modular_checks.remove(pipe)
    for name in _METHODS:
        if getattr(pipe.__dict__.get(name), _FLAG, False):
            del pipe.__dict__[name]
    return pipe
