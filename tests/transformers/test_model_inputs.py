"""Prompt inputs besides ids on hf_tpu's loop, against upstream's ``generate`` on the CPU: the prompt as embeddings
(left on the host, as transformers' TPU page advises for generate inputs), token types (GPT-2), and no prompt at all
(upstream's bos start). A model whose layout the loop cannot build from them runs upstream's loop with a warning."""

from __future__ import annotations

import pytest
import torch

from hf_tpu.transformers import explain, generation
from hf_tpu.transformers._settings import model_state


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The graph kinds the cached loop ran during the test."""
    from hf_tpu.transformers._loops import cached

    kinds, run = [], cached.run_graph

    def spy(model, state, key, *args):
        kinds.append(str(key[0]))  # (a GraphKind: its text)
        return run(model, state, key, *args)

    monkeypatch.setattr(cached, "run_graph", spy)
    return kinds


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_inputs_embeds_on_the_host_generate_like_cpu_on_the_loop(family, pair, prompts, ran):
    cpu, tpu = pair(family)
    ids, mask = prompts([4, 9])
    embeds = cpu.get_input_embeddings()(ids).detach()  # on the CPU, for a model on the tpu
    kw = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "eos_token_id": None}
    got = tpu.generate(inputs_embeds=embeds, **kw)
    expected = cpu.generate(inputs_embeds=embeds, **kw)
    assert got.device.type == "cpu" and torch.equal(got, expected)  # the new tokens only, as upstream returns
    assert ran[0] == "embeds_prefill" and ran[1:] == ["decode"] * 4, ran
    # with the ids too (the sequences start with them), the scores on the host, a penalty over the history
    kw.update(return_dict_in_generate=True, output_scores=True, repetition_penalty=1.5)
    got = tpu.generate(ids, inputs_embeds=embeds, **kw)
    expected = cpu.generate(ids, inputs_embeds=embeds, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))


def test_inputs_embeds_on_the_tpu_with_an_eos_id_generate_like_cpu(llama, prompts, ran):
    # Embeddings already on the tpu (transformers' own tests make them there) with an end-of-sequence id and pad -1:
    # upstream builds the call's special tokens and stopping criteria on the prompt's device; hf_tpu's loop keeps
    # the sequence on the host, so the prompt comes back for upstream's preparation and goes to the device again.
    cpu, tpu = llama
    ids, mask = prompts([5, 8], seed=5)
    embeds = cpu.get_input_embeddings()(ids).detach()
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "eos_token_id": int(ids[0, -1]),
          "pad_token_id": -1, "return_dict_in_generate": True, "output_scores": True}  # fmt: skip
    got = tpu.generate(inputs_embeds=embeds.to("tpu"), **{**kw, "attention_mask": mask.to("tpu")})
    expected = cpu.generate(inputs_embeds=embeds, **kw)
    assert got.sequences.device.type == "tpu" and torch.equal(got.sequences.cpu(), expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))
    assert ran and ran[0] == "embeds_prefill", ran


def test_embeds_with_the_penalty_on_the_device_keep_its_history_after_the_prompt(llama, prompts, ran):
    cpu, tpu = llama
    ids, mask = prompts([6, 3], seed=2)
    embeds = cpu.get_input_embeddings()(ids).detach()
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "repetition_penalty": 3.0}
    kw["eos_token_id"] = None
    assert torch.equal(tpu.generate(inputs_embeds=embeds, **kw), cpu.generate(inputs_embeds=embeds, **kw))
    assert ran[0] == "embeds_prefill+repetition_penalty", ran


def test_token_type_ids_run_the_loop_like_cpu(pair, prompts, ran):
    cpu, tpu = pair("gpt2")
    ids, mask = prompts([5, 8])
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # the last type differs from the first: upstream repeats the last one for new tokens
    kw = {"attention_mask": mask, "token_type_ids": types, "max_new_tokens": 5, "do_sample": False}
    kw["eos_token_id"] = None
    got = tpu.generate(ids, **kw)
    assert torch.equal(got, cpu.generate(ids, **kw))
    assert not torch.equal(got, cpu.generate(ids, **{**kw, "token_type_ids": None}))  # the types change the tokens
    assert ran[0] == "prefill+token_type_ids" and set(ran[1:]) == {"decode+token_type_ids"}, ran


def test_no_prompt_starts_from_the_bos_id_on_the_loop(llama, ran):
    cpu, tpu = llama
    got = tpu.generate(max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert got.device.type == "tpu"  # as upstream: the bos row is made on the model's device
    assert torch.equal(got.cpu(), cpu.generate(max_new_tokens=4, do_sample=False, eos_token_id=None))
    assert ran[0] == "prefill", ran


def test_a_prompt_first_model_runs_embeds_upstream_with_the_reason(prompts, from_config):
    from transformers import BartConfig, BartForCausalLM

    config = BartConfig(
        vocab_size=96, d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=64,
        forced_eos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    cpu, tpu = from_config(BartForCausalLM, config)
    ids, _ = prompts([6])
    embeds = cpu.get_input_embeddings()(ids).detach()
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 1}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="places its prompt by its cache length"):
        got = tpu.generate(inputs_embeds=embeds, **kw)
    assert torch.equal(got.cpu(), cpu.generate(inputs_embeds=embeds, **kw))


def test_token_type_ids_without_a_cache_run_the_loop_without_a_cache_like_cpu(pair, prompts):
    cpu, tpu = pair("gpt2")
    ids, mask = prompts([4, 7], seed=7)
    types = torch.zeros_like(ids)
    types[:, 4:] = 1  # upstream repeats the last type for every new token
    kw = {"attention_mask": mask, "token_type_ids": types, "max_new_tokens": 5, "do_sample": False, "use_cache": False}
    kw.update(eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    assert explain(tpu, input_ids=ids, **kw).loop == "cacheless"
    got, expected = tpu.generate(ids, **kw), cpu.generate(ids, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))
    assert any(str(key[0]) == "cacheless_prefill+token_type_ids" for key in model_state(tpu).compiled)


def test_an_encoder_decoder_without_input_ids_runs_upstream_with_the_reason(pair):
    cpu, tpu = pair("t5")
    kw = {"max_new_tokens": 3, "do_sample": False, "bos_token_id": 0}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="generate got no input ids; running upstream's generate"):
        got = tpu.generate(**kw)
    assert torch.equal(got.cpu(), cpu.generate(**kw))


def test_an_input_the_forward_never_reads_stays_on_the_loop_and_one_it_reads_runs_upstream(prompts, from_config):
    """GLM-5 Next's forward takes ``mm_token_type_ids`` (its processor returns them) and never reads them: the loop
    leaves them out and equals the CPU's; a forward that reads such an input runs upstream's loop naming it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Ignores(LlamaForCausalLM):
        def forward(self, *args, mm_token_type_ids=None, **kwargs):
            return super().forward(*args, **kwargs)

    class Reads(LlamaForCausalLM):
        def forward(self, *args, mm_token_type_ids=None, **kwargs):
            out = super().forward(*args, **kwargs)
            if mm_token_type_ids is not None:
                out.logits = out.logits + mm_token_type_ids.sum()
            return out

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    ids, mask = prompts([6])
    kw = {"attention_mask": mask, "mm_token_type_ids": torch.zeros_like(ids), "max_new_tokens": 4, "do_sample": False}
    cpu, tpu = from_config(Ignores, config)
    assert explain(tpu, input_ids=ids, **kw).loop == "cached"
    assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    _, tpu = from_config(Reads, config)
    route = explain(tpu, input_ids=ids, **kw)
    assert route.loop == "upstream" and "mm_token_type_ids" in route.reason, route
