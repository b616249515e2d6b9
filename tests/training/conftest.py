"""Tiny causal LMs for the training tests: built from a config, saved to ``tmp_path``, loaded back twice (CPU, tpu).

``hf_tpu.enable("training")`` is on for the whole session (its own test checks upstream without it).
"""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim

VOCAB = 128
SEQ = 16


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("train-models") / "llama"
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return path


@pytest.fixture
def load(model_dir):
    """``load(device)``: a fresh copy of the tiny model on ``device`` (through ``from_pretrained``)."""
    from transformers import AutoModelForCausalLM

    def _load(device: str = "cpu"):
        return AutoModelForCausalLM.from_pretrained(model_dir).to(device)

    return _load


def examples(n: int, lengths: tuple[int, ...] = (5, 9, 12, SEQ), seed: int = 0) -> list[dict]:
    """``n`` random token sequences with lengths cycling through ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()} for i in range(n)
    ]


@pytest.fixture(scope="session", autouse=True)
def _training_enabled():
    hf_tpu.sim.enable()
    torch.set_num_threads(1)
    with hf_tpu.enabled("training"):
        yield
