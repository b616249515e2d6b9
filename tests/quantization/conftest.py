"""Tiny quantized Llamas for the quantization tests: one checkpoint, loaded per kind (bf16, int8, int4) once per
session, because warm-up compiles, not forwards, are what costs time here.

Sizes: hidden 128 (int4's group size 128 divides every in_features), 2 layers, vocab 128.
"""

from __future__ import annotations

import gc

import pytest
import torch

import hf_tpu
import hf_tpu.sim

LAYERS = 2
GEOMETRY = dict(
    hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_hidden_layers=LAYERS,
    # Weights drawn wider than transformers' 0.02: a random model's next-token logits then differ by more than
    # bf16's rounding, so that greedy tokens are a property of the weights and not of a padded prefill's rounding.
    initializer_range=0.3,
)


def quantization_config(kind: str):
    """transformers' ``quantization_config`` as a user writes it for ``kind`` (None for bf16)."""
    if kind == "bf16":
        return None
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    if kind == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    if kind == "int4":
        return TorchAoConfig(Int4WeightOnlyConfig(group_size=128))
    raise ValueError(f"unknown kind {kind!r}")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from hf_tpu.testing import tiny_model

    path = tmp_path_factory.mktemp("quant") / "llama"
    tiny_model("llama", path, **GEOMETRY)
    return path


@pytest.fixture(scope="module", autouse=True)
def _quantization_enabled():
    hf_tpu.sim.enable()
    with hf_tpu.enabled("device_map", "generation", "quantization"):
        yield


MAX_PROMPT, NEW_TOKENS = 16, 6


class Loaded:
    """A model loaded on ``tpu`` with the device memory its load took (``weights``: live bytes after - before)."""

    def __init__(self, model, weights: int) -> None:
        self.model, self.weights = model, weights
        self.warm = False

    def warmed(self):
        """The model after hf_tpu's warm-up for batch 1, prompts up to MAX_PROMPT, NEW_TOKENS new tokens."""
        if not self.warm:
            hf_tpu.warmup(self.model, max_prompt_len=MAX_PROMPT, batch_sizes=[1], max_new_tokens=NEW_TOKENS,
                          progress=False)
            self.warm = True
        return self.model


_LOADED: dict[str, Loaded] = {}


def load(kind: str, path, device_map="tpu") -> Loaded:
    from transformers import AutoModelForCausalLM

    gc.collect()
    before = hf_tpu.sim.memory_allocated()
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map=device_map, dtype=torch.bfloat16, quantization_config=quantization_config(kind)
    ).eval()
    return Loaded(model, hf_tpu.sim.memory_allocated() - before)


@pytest.fixture
def loaded(checkpoint):
    """``loaded(kind) -> Loaded``: the ``kind`` model on tpu, one per session."""

    def get(kind: str) -> Loaded:
        if kind not in _LOADED:
            _LOADED[kind] = load(kind, checkpoint)
        return _LOADED[kind]

    return get


def make_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts of the given lengths: (input_ids, attention_mask) on the host."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 128, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


_REFERENCES: dict[str, object] = {}


@pytest.fixture
def cpu_reference(checkpoint):
    """``cpu_reference(kind)``: the ``kind`` model quantized on tpu, then moved to the CPU: the same quantized
    weights (and the same dequantizing code) run by the CPU, one per session."""

    def get(kind: str):
        if kind not in _REFERENCES:
            _REFERENCES[kind] = load(kind, checkpoint).model.to("cpu")
            gc.collect()
        return _REFERENCES[kind]

    return get


def inner_tensors(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a quantized tensor subclass holds (``qdata``, ``scale``, ...), or ``{"": tensor}``."""
    if hasattr(type(tensor), "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return {name: getattr(tensor, name) for name in names}
    return {"": tensor}
