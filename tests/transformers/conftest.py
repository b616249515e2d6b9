"""Tiny models for the generation tests, built from configs, saved and loaded back through ``from_pretrained``.

Each model family is built once per test session (module-level cache) so that the compiled graphs are shared by the
tests that use it: compiles, not forwards, are what costs time here.
"""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim

VOCAB = 96


def _config(family: str):
    from hf_tpu.testing import tiny_config

    return tiny_config(family, vocab_size=VOCAB)


_MODELS: dict[str, tuple] = {}


def load_pair(family: str, tmp_root) -> tuple:
    """(cpu_model, tpu_model): the same tiny weights, saved and loaded back, one copy on each device."""
    if family not in _MODELS:
        import transformers as T

        torch.manual_seed(0)
        config = _config(family)
        cls = T.AutoModelForSeq2SeqLM if config.is_encoder_decoder else T.AutoModelForCausalLM
        path = tmp_root / family
        cls.from_config(config).save_pretrained(path)
        cpu = cls.from_pretrained(path).eval()
        tpu = cls.from_pretrained(path).eval().to("tpu")
        _MODELS[family] = (cpu, tpu)
    return _MODELS[family]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gen-models")


@pytest.fixture(scope="module", autouse=True)
def _generation_enabled():
    hf_tpu.sim.enable()
    with hf_tpu.enabled("generation"):
        yield


@pytest.fixture
def pair(model_root):
    """``pair(family) -> (cpu_model, tpu_model)``."""
    return lambda family: load_pair(family, model_root)


@pytest.fixture
def llama(model_root):
    return load_pair("llama", model_root)


def _from_config(model_class, config) -> tuple:
    """(cpu_model, tpu_model) of ``model_class(config)``: the same random weights (seed 0), one copy on each device."""
    torch.manual_seed(0)
    cpu = model_class(config).eval()
    tpu = model_class(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


@pytest.fixture(scope="session")
def from_config():
    """``from_config(model_class, config) -> (cpu_model, tpu_model)``, built in the test (no save and load)."""
    return _from_config


@pytest.fixture
def prompts():
    """``prompts(lengths, seed=0) -> (input_ids, attention_mask)``, see :func:`make_prompts`."""
    return make_prompts


def make_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts of the given lengths: (input_ids, attention_mask) on the host."""
    from hf_tpu.testing import left_padded_prompts

    return left_padded_prompts(lengths, vocab=VOCAB, seed=seed)
