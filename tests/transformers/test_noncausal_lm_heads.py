"""An encoder's LM head generating as a decoder (RoBERTa, BERT, ELECTRA, ... with ``is_decoder=False``): its
attention is bidirectional, so the bucketed loop's mask must hide the cache positions no token has reached yet,
as upstream's growing cache has no keys there."""

from __future__ import annotations

import pytest
import torch

import hf_tpu.sim
from hf_tpu.transformers import generation

_GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}


@pytest.fixture(scope="module")
def roberta():
    from transformers import RobertaConfig, RobertaForCausalLM

    config = RobertaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert not config.is_decoder  # the causal-LM class's default config: bidirectional self-attention
    torch.manual_seed(0)
    cpu = RobertaForCausalLM(config).eval()
    tpu = RobertaForCausalLM(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


@pytest.mark.filterwarnings("ignore:hf_tpu. output_scores/output_logits need the scores on the host")
def test_bidirectional_lm_head_matches_cpu_left_padded(roberta, prompts):
    cpu, tpu = roberta
    ids, mask = prompts([5, 11])
    kwargs = {**_GREEDY, "max_new_tokens": 6, "return_dict_in_generate": True, "output_logits": True}
    expected = cpu.generate(ids, attention_mask=mask, **kwargs)
    got = tpu.generate(ids, attention_mask=mask, **kwargs)
    assert generation.compiled_graphs(tpu)  # hf_tpu's loop ran, not upstream's generate
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    for step, (want, have) in enumerate(zip(expected.logits, got.logits, strict=True)):
        # without the mask of written positions the queries also read the empty slots: ~1e-2 off
        torch.testing.assert_close(have.cpu(), want, rtol=0, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


def test_bidirectional_lm_head_two_lengths_in_one_bucket(roberta, prompts):
    cpu, tpu = roberta
    for length, seed in ((5, 1), (11, 2)):
        ids, _ = prompts([length], seed=seed)
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(ids, max_new_tokens=12, **_GREEDY)
        assert torch.equal(got.cpu(), cpu.generate(ids, max_new_tokens=12, **_GREEDY)), length
    assert s.compiles == 0  # the second length reuses the first one's graphs
