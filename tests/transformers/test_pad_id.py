"""A pad id the model cannot embed (``pad_token_id=-1``, as transformers' own tests pass, or one past the vocabulary)
works on hf_tpu's loops: the padding they add, and a finished row's next input, embed a valid id; the sequences
keep the caller's pad id, as upstream's do."""

from __future__ import annotations

import pytest
import torch

from hf_tpu.transformers import generation


def _spy(monkeypatch) -> list[str]:
    from hf_tpu.transformers import _graphs

    ran, run = [], _graphs.run_graph

    def spy(model, state, key, *args):
        ran.append(str(key[0]))  # (a GraphKind: its text)
        return run(model, state, key, *args)

    for module in ("_loops.cached", "_loops.cacheless"):
        monkeypatch.setattr(f"hf_tpu.transformers.{module}.run_graph", spy, raising=False)
    monkeypatch.setattr(_graphs, "run_graph", spy)
    return ran


@pytest.mark.parametrize("pad", [-1, 96, 1000])  # 96: the vocabulary's size
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_pad_id_the_model_cannot_embed_generates_like_cpu(llama, prompts, monkeypatch, pad, use_cache):
    cpu, tpu = llama
    ids, mask = prompts([4, 9])
    kw = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "use_cache": use_cache}
    kw["eos_token_id"] = None
    expected = cpu.generate(ids, pad_token_id=pad, **kw)  # (no row finishes: the CPU never embeds the pad id)
    ran = _spy(monkeypatch)
    got = tpu.generate(ids, pad_token_id=pad, **kw)
    assert torch.equal(got, expected)
    kinds = {k.split("+")[0] for k in ran}
    assert kinds == ({"prefill", "decode"} if use_cache else {"cacheless_prefill", "cacheless_decode"}), ran


def test_a_finished_row_gets_the_pad_id_in_its_sequence_and_a_valid_one_on_the_device(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([4, 9], seed=1)
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False}
    free = cpu.generate(ids, **kw, eos_token_id=None)
    prompt_len = ids.shape[1]
    eos = int(free[0, prompt_len + 1])  # row 0 stops after its second new token
    assert eos not in free[1, prompt_len:].tolist() and eos not in free[0, prompt_len : prompt_len + 1].tolist()
    # Upstream's loop on the CPU embeds the finished row's pad id at the next step: with -1 it raises.
    with pytest.raises(IndexError):
        cpu.generate(ids, pad_token_id=-1, eos_token_id=eos, **kw)
    got = tpu.generate(ids, pad_token_id=-1, eos_token_id=eos, **kw)
    assert torch.equal(got[1], free[1])  # the unfinished row: the CPU's tokens
    assert torch.equal(got[0, : prompt_len + 2], free[0, : prompt_len + 2])
    assert got[0, prompt_len + 2 :].tolist() == [-1] * 4  # the finished row: the caller's pad id, as upstream writes
    # with a pad id the CPU can embed, upstream's own output for the same call
    kw.update(pad_token_id=0, eos_token_id=eos)
    assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))


def test_an_encoder_decoder_pads_its_encoder_input_with_a_valid_id(pair, prompts):
    cpu, tpu = pair("t5")
    ids, mask = prompts([3, 8])
    kw = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": -1}
    kw["decoder_start_token_id"] = 0
    got = tpu.generate(ids, **kw)
    assert torch.equal(got, cpu.generate(ids, **kw))
    assert any(k[0] == "encoder" for k in generation.compiled_graphs(tpu))
