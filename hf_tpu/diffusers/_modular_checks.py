"""hf_tpu's per-call checks for a Modular Diffusers pipeline, as one block at the head of its own blocks.

A ``ModularPipeline`` has no ``check_inputs`` or ``prepare_latents`` to wrap (see :mod:`._call_checks`); it runs its
``blocks`` in order, and inserting a block is Modular Diffusers' own way to extend a pipeline. :func:`install` puts
one ``HfTpuCallChecks`` block first in *this pipeline's* blocks (``init_pipeline`` gave it its own copy; nothing on
the class changes). It reads the call's ``height``/``width`` (:func:`check_resolution`, when a denoiser is loaded),
``generator`` (:func:`check_generator`), and for a chunked video VAE with a soundtrack (MiniMax-H3) ``num_frames``
and ``audio_latents`` (:func:`check_chunked_frames` with ``strict=False``, :func:`check_audio_latents`), before any
block runs. It declares the same input parameters the pipeline's blocks already declare (same defaults, never
required), so it changes no default and no workflow selection. :func:`remove` takes it out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_tpu.diffusers._av_checks import check_audio_latents, check_chunked_frames, chunked_frames
from hf_tpu.diffusers._checks import DENOISERS, check_generator, check_resolution

__all__ = ["has_checks", "install", "is_modular", "remove"]

BLOCK_NAME = "hf_tpu_call_checks"
_READS = ("height", "width", "num_frames", "generator", "audio_latents")


def _sub_blocks(pipe: Any) -> Any:
    return getattr(getattr(pipe, "_blocks", None), "sub_blocks", None)


def is_modular(pipe: Any) -> bool:
    """Whether ``pipe`` is a Modular Diffusers pipeline whose top blocks run in sequence (a block can go first).

    A pipeline whose top blocks choose one branch (``ConditionalPipelineBlocks``) or loop is left alone: a block
    inserted there would be a branch or a loop step."""
    blocks = getattr(pipe, "_blocks", None)
    if blocks is None or not hasattr(_sub_blocks(pipe), "insert"):
        return False
    from diffusers.modular_pipelines import LoopSequentialPipelineBlocks, SequentialPipelineBlocks

    return isinstance(blocks, SequentialPipelineBlocks) and not isinstance(blocks, LoopSequentialPipelineBlocks)


def has_checks(pipe: Any) -> bool:
    return is_modular(pipe) and BLOCK_NAME in _sub_blocks(pipe)


def _block(inputs: list) -> Any:
    from diffusers.modular_pipelines import ModularPipelineBlocks

    class HfTpuCallChecks(ModularPipelineBlocks):
        """hf_tpu: refuse a size, frame count, soundtrack or generator the TPU run cannot take, before any work."""

        model_name = "hf_tpu"

        @property
        def description(self) -> str:
            return "hf_tpu's per-call checks: image size, frame count, audio latents, generator."

        @property
        def inputs(self) -> list:
            return inputs

        def __call__(self, components: Any, state: Any) -> tuple[Any, Any]:
            block = self.get_block_state(state)
            values = {name: getattr(block, name, None) for name in _READS}
            height, width = values["height"], values["width"]
            if isinstance(height, int) and isinstance(width, int) and _has_denoiser(components):
                check_resolution(components, height, width)
            if chunked_frames(components) is not None:
                if values["num_frames"] is not None:  # None: the workflow's default count
                    check_chunked_frames(components, values["num_frames"], strict=False)
                    check_audio_latents(components, values["audio_latents"], values["num_frames"])
            if values["generator"] is not None:
                check_generator(components, values["generator"])
            return components, state

    return HfTpuCallChecks()


def _has_denoiser(pipe: Any) -> bool:
    import torch

    return any(isinstance(getattr(pipe, name, None), torch.nn.Module) for name in DENOISERS)


def install(pipe: Any) -> Any:
    """Put the check block first in ``pipe``'s own blocks (idempotent). Returns ``pipe``."""
    if not is_modular(pipe) or has_checks(pipe):
        return pipe
    declared = {p.name: p for p in pipe._blocks.inputs if getattr(p, "name", None) in _READS}
    inputs = [dataclasses.replace(p, required=False) for p in declared.values()]
    _sub_blocks(pipe).insert(BLOCK_NAME, _block(inputs), 0)
    return pipe


def remove(pipe: Any) -> Any:
    """Take the check block out of ``pipe``'s blocks. Returns ``pipe``."""
    if has_checks(pipe):
        del _sub_blocks(pipe)[BLOCK_NAME]
    return pipe
