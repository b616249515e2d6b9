"""``output_attentions`` / ``output_hidden_states`` on hf_tpu's loops, against upstream's ``generate`` on the CPU: the
graphs return every layer's attention weights and hidden states, cut on the host to upstream's shapes (the bucket's
padding out), with a cache, with a static cache, without a cache, sampling, and continuing from a cache. The rows of
the caller's own padding tokens (attention mask 0, which no token attends to) are left out of the comparison:
upstream's there are an artefact of its mask (uniform weights over its key length), not a result."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from hf_tpu.testing import tiny_config, tiny_model
from hf_tpu.transformers import explain, generation
from hf_tpu.transformers._settings import model_state
from hf_tpu.transformers._upstream import cache_name, output_cache_field

VOCAB = 96  # (as the shared models': make_prompts draws ids below it)
FLAGS = {"output_attentions": True, "output_hidden_states": True, "return_dict_in_generate": True}


@pytest.fixture(scope="module")
def eager_pair():
    """``eager_pair(family) -> (cpu, tpu)``: tiny models with eager attention (sdpa computes no attention weights)."""
    made = {}

    def build(family: str):
        if family not in made:
            config = tiny_config(family, vocab_size=VOCAB)
            config._attn_implementation = "eager"
            cpu = tiny_model(family, config=config)
            made[family] = (cpu, copy.deepcopy(cpu).to("tpu"))
        return made[family]

    return build


def _kinds(model) -> set[str]:
    return {str(key[0]) for key in model_state(model).compiled}


def _same(ours: tuple, theirs: tuple, mask: torch.Tensor, attention: bool) -> None:
    """Each forward's per-layer tensors: upstream's shapes, and its values on every row but the caller's padding."""
    assert len(ours) == len(theirs)
    for step, (mine, up) in enumerate(zip(ours, theirs)):
        assert len(mine) == len(up) > 0
        for a, b in zip(mine, up):
            assert a.shape == b.shape, (step, a.shape, b.shape)
            rows = a.shape[-2] if attention else a.shape[1]
            keep = torch.ones(a.shape[0], rows, dtype=torch.bool)
            if rows >= mask.shape[1]:  # the whole prompt (and, without a cache, the tokens after it)
                keep[:, : mask.shape[1]] = mask.bool()
            if attention:
                a, b = a.transpose(1, 2), b.transpose(1, 2)
            torch.testing.assert_close(a.cpu()[keep], b[keep])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "how", [{}, {"cache_implementation": "static"}, {"use_cache": False}, {"do_sample": True, "top_k": 4}],
    ids=["cache", "static", "no-cache", "sample"],
)  # fmt: skip
def test_attentions_and_hidden_states_come_from_the_loop_like_cpu(family, how, eager_pair, prompts):
    cpu, tpu = eager_pair(family)
    ids, mask = prompts([4, 6], seed=1)
    kw = {"attention_mask": mask, "max_new_tokens": 4, "eos_token_id": None, "output_scores": True, **FLAGS, **how}
    kw.setdefault("do_sample", False)
    route = explain(tpu, input_ids=ids, **kw)
    assert route.loop == ("cacheless" if how.get("use_cache") is False else "cached"), route
    torch.manual_seed(3)
    got = tpu.generate(ids, **kw)
    torch.manual_seed(3)
    expected = cpu.generate(ids, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    _same(got.attentions, expected.attentions, mask, attention=True)
    _same(got.hidden_states, expected.hidden_states, mask, attention=False)
    assert any(kind.endswith("+attentions+hidden_states") for kind in _kinds(tpu)), _kinds(tpu)


def test_continuing_from_a_cache_returns_the_uncached_tokens_as_one_forward(eager_pair, prompts):
    cpu, tpu = eager_pair("llama")
    ids, mask = prompts([5, 3], seed=2)
    kw = {"max_new_tokens": 2, "do_sample": False, "eos_token_id": None, **FLAGS}
    first = tpu.generate(ids, attention_mask=mask, **kw)
    cache = getattr(first, output_cache_field(type(first)))
    cache.crop(-3)  # the prompt and a new token held, three taken off: upstream runs four tokens in one forward
    full = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], dim=1)
    got = tpu.generate(first.sequences, attention_mask=full, **{cache_name(): cache}, **kw)
    reference = getattr(cpu.generate(ids, attention_mask=mask, **kw), output_cache_field(type(first)))
    reference.crop(-3)
    expected = cpu.generate(first.sequences, attention_mask=full, **{cache_name(): reference}, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    assert got.attentions[0][0].shape[-2:] == (4, first.sequences.shape[1])  # 4 uncached tokens, in one entry
    _same(got.attentions, expected.attentions, full, attention=True)
    _same(got.hidden_states, expected.hidden_states, full, attention=False)


def test_sdpa_gives_hidden_states_and_no_attention_weights_as_upstream(llama, prompts):
    cpu, tpu = llama  # sdpa attention: upstream's forward records no attention weights
    ids, mask = prompts([3, 5], seed=4)
    kw = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "eos_token_id": None, **FLAGS}
    got, expected = tpu.generate(ids, **kw), cpu.generate(ids, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    assert got.attentions == expected.attentions == ((), (), ())
    _same(got.hidden_states, expected.hidden_states, mask, attention=False)


def test_a_failure_returning_attentions_leaves_hidden_states_on_the_loop(from_config, prompts):
    # sdpa warns through logger.warning_once when asked for attention weights, which dynamo cannot trace: that call
    # runs upstream's loop; a later call asking for hidden states only still takes hf_tpu's loop (the failure was
    # recorded against the attentions it asked for, not against every call asking for outputs)
    config = tiny_config("llama", vocab_size=96)
    config._attn_implementation = "sdpa"
    cpu, tpu = from_config(transformers.LlamaForCausalLM, config)
    ids, mask = prompts([3, 5], seed=4)
    kw = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "eos_token_id": None,
          "return_dict_in_generate": True}  # fmt: skip
    tpu.generate(ids, output_attentions=True, output_hidden_states=True, **kw)
    assert explain(tpu, output_attentions=True, output_hidden_states=True, **kw).loop == "upstream"
    assert explain(tpu, output_hidden_states=True, **kw).loop == "cached"
    got, expected = (m.generate(ids, output_hidden_states=True, **kw) for m in (tpu, cpu))
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    _same(got.hidden_states, expected.hidden_states, mask, attention=False)


def test_an_encoder_decoder_asking_for_them_runs_upstream_with_the_reason(pair):
    cpu, tpu = pair("t5")
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = {"max_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True, "output_hidden_states": True}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="on an encoder-decoder model: hf_tpu's graphs return"):
        got = tpu.generate(ids.to("tpu"), **kw)  # (upstream's encoder call takes its ids on the model's device)
    assert torch.equal(got.sequences.cpu(), cpu.generate(ids, **kw).sequences)


def test_attention_weights_of_a_sliding_window_cache_run_upstream_with_the_reason(from_config, prompts):
    config = tiny_config("mistral", vocab_size=96)
    config._attn_implementation = "eager"
    cpu, tpu = from_config(transformers.MistralForCausalLM, config)
    ids, mask = prompts([4, 7], seed=5)
    kw = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "output_attentions": True}
    kw["return_dict_in_generate"] = True
    assert "layer kinds other than full attention" in explain(tpu, input_ids=ids, **kw).reason
    got = tpu.generate(ids, **kw)
    assert torch.equal(got.sequences.cpu(), cpu.generate(ids, **kw).sequences)


def test_a_forward_that_cannot_trace_with_them_runs_upstream_and_keeps_the_models_route(
    from_config, prompts, monkeypatch
):
    # without the hooks installed ahead (upstream installs them under a lock at the first forward asking for
    # outputs, which dynamo cannot trace), the outputs graph fails its first trace: that call runs upstream's loop,
    # the model keeps its cached route for every other call
    from hf_tpu.transformers import _graphs

    monkeypatch.setattr(_graphs, "prepare", lambda model: None)
    config = tiny_config("llama", vocab_size=96)
    config._attn_implementation = "eager"
    cpu, tpu = from_config(transformers.LlamaForCausalLM, config)
    ids, mask = prompts([4, 6], seed=6)
    kw = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "eos_token_id": None, **FLAGS}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="forward returning them cannot be compiled as one static-shape graph"):
        got = tpu.generate(ids, **kw)
    assert torch.equal(got.sequences.cpu(), cpu.generate(ids, **kw).sequences)
    assert explain(tpu).loop == "cached"
    assert explain(tpu, **kw).loop == "upstream" and "cannot be compiled" in explain(tpu, **kw).reason
