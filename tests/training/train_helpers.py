"""Shared by the training tests and the data-parallel ranks: the tiny config and the example data."""

from __future__ import annotations

import torch

VOCAB = 128
SEQ = 16


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def examples(n: int, lengths: tuple[int, ...] = (5, 9, 12, SEQ), seed: int = 0) -> list[dict]:
    """``n`` random token sequences with lengths cycling through ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()} for i in range(n)
    ]
