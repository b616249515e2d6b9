"""Shared by the training tests and the data-parallel ranks: the tiny config and the example data."""

from __future__ import annotations

import torch

VOCAB = 128
SEQ = 16


def tiny_config():
    from hf_tpu.testing import tiny_config as config

    return config("llama", vocab_size=VOCAB, max_position_embeddings=64)


def examples(n: int, lengths: tuple[int, ...] = (5, 9, 12, SEQ), seed: int = 0) -> list[dict]:
    """``n`` random token sequences with lengths cycling through ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()} for i in range(n)
    ]


class Losses:
    """A ``TrainerCallback`` collecting the logged loss of every step in ``.values``."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Losses(TrainerCallback):
            def __init__(self):
                self.values: list[float] = []

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.values.append(float(logs["loss"]))

        return _Losses()
