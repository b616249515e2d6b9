"""What the tiny pipelines of :mod:`hf_tpu.diffusers.testing` share (its own and those of ``_tiny_qwen_image`` and
``_tiny_minimax_h3``, which it re-exports): the byte-level BPE alphabet of their tokenizers, and the last step of
every builder."""

from __future__ import annotations

import os
from typing import Any

__all__: list[str] = []


def byte_chars() -> list[str]:
    """The 256 printable stand-ins that byte-level BPE uses for the bytes 0..255 (the GPT-2 table)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def finish_pipeline(pipe: Any, path: str | os.PathLike | None) -> Any:
    import torch

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()  # built from configs they start in training mode, with dropout on
    pipe.set_progress_bar_config(disable=True)
    if path is None:
        return pipe
    pipe.save_pretrained(path)
    return os.fspath(path)
