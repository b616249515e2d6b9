"""Continuous batching and serving on the simulated TPU: a tiny model on each device, a small step ladder."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim

VOCAB = 96
# A ladder small enough for the suite: one query rung, KV rungs 0/64/1024 (3 shapes to compile).
SMALL = {"max_batch_tokens": 32, "q_min": 32, "slots": 4, "page_size": 64, "kv_factor": 16}


@pytest.fixture(scope="module", autouse=True)
def _serving_enabled():
    import dataclasses

    from hf_tpu import serving

    hf_tpu.sim.enable()
    saved = dataclasses.asdict(serving.SETTINGS)
    serving.configure(**SMALL)
    with hf_tpu.enabled():
        yield
    serving.configure(**saved)


_PAIR: list = []


@pytest.fixture
def pair():
    """(cpu_model, tpu_model): the same tiny llama weights on each device (built once per session)."""
    if not _PAIR:
        import transformers as T

        from hf_tpu.testing import tiny_config

        torch.manual_seed(0)
        cpu = T.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB)).eval()
        tpu = T.AutoModelForCausalLM.from_config(cpu.config).eval()
        tpu.load_state_dict(cpu.state_dict())
        _PAIR.extend([cpu, tpu.to("tpu")])
    return tuple(_PAIR)


def random_prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def cpu_greedy(cpu, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = cpu.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()
