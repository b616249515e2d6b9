"""Tiny models of the chip tier (hf_tpu.testing's, nothing downloaded), with weights that keep greedy tokens off ties.

A random tiny model's next-token logits are nearly flat, so a float32 rounding can swap two greedy tokens; scaling
every weight up (as scripts/chip_torch_tpu.py's ``_tiny_model`` does) spreads the logits, so that the tokens are a
property of the weights and the comparison with the CPU can be exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SCALE = 4.0


def sharpened(model: Any, scale: float = SCALE) -> Any:
    """``model`` with every parameter multiplied by ``scale`` (in place)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def saved_decoder(family: str, path: Path, scale: float = SCALE, **overrides: Any) -> Path:
    """hf_tpu.testing's tiny ``family`` model, sharpened, saved to ``path`` (once)."""
    from hf_tpu.testing import tiny_model

    if not (path / "config.json").is_file():
        sharpened(tiny_model(family, **overrides), scale).save_pretrained(path)
    return path


def prompts(batch: int, lengths: list[int] | None = None, *, vocab: int = 96, seed: int = 0):
    """A left-padded batch of random prompts (``lengths``, default 12 down by 3 per row): (input_ids, attention_mask)."""
    from hf_tpu.testing import left_padded_prompts

    return left_padded_prompts(lengths or [max(12 - 3 * row, 4) for row in range(batch)], vocab=vocab, seed=seed)
