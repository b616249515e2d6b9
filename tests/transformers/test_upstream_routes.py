"""Models whose code cannot run hf_tpu's bucketed, compiled loop run upstream's loop on the TPU with a one-time
warning naming why, token-identical to upstream's ``generate`` on the CPU (never a crash)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_tpu
from hf_tpu.transformers import explain, generation


def _generate_like_cpu(cpu, tpu, prompts, match: str) -> None:
    generation.WARNED.clear()
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with pytest.warns(UserWarning, match=match):
        got = tpu.generate(prompts[0], **kw)
    assert got.device.type == "cpu"  # as upstream: the sequences come back where the prompt was
    assert torch.equal(got, cpu.generate(prompts[0], **kw))
    for ids in prompts[1:]:
        assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert not generation.compiled_graphs(tpu)


def test_an_own_prepare_inputs_for_generation_gets_its_inputs_on_the_device(prompts, from_config):
    # XLM's prepare_inputs_for_generation overrides upstream's without its last step (moving the inputs to the
    # model's device): upstream's loop on host prompts handed its embedding host ids
    from transformers import XLMConfig, XLMWithLMHeadModel

    config = XLMConfig(vocab_size=96, emb_dim=32, n_layers=1, n_heads=2, max_position_embeddings=64)
    cpu, tpu = from_config(XLMWithLMHeadModel, config)
    _generate_like_cpu(cpu, tpu, [prompts([5])[0]], "running upstream's generate")
    assert "prepare_inputs_for_generation" not in vars(tpu)  # the call's wrapper is gone after it


def test_a_model_with_its_own_cache_and_inputs_preparation_runs_upstream_for_its_real_reason(prompts, from_config):
    # XLNet: its own memory instead of a cache (max_position_embeddings=-1: no position table), and its own
    # prepare_inputs_for_generation (host inputs, before hf_tpu moved them: a same-device error)
    from transformers import XLNetConfig, XLNetLMHeadModel

    cpu, tpu = from_config(XLNetLMHeadModel, XLNetConfig(vocab_size=96, d_model=32, n_layer=1, n_head=2, d_inner=64))
    _generate_like_cpu(cpu, tpu, [prompts([5])[0]], "XLNetLMHeadModel: it keeps its own cache type")


def _cpmant(from_config):
    from transformers import CpmAntConfig, CpmAntForCausalLM

    config = CpmAntConfig(
        vocab_size=96, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=1,
        prompt_length=4, prompt_types=3, segment_types=4, position_bias_num_buckets=16, position_bias_max_distance=64,
    )  # fmt: skip
    return from_config(CpmAntForCausalLM, config)


def test_a_model_with_no_graph_in_any_form_runs_upstream_with_every_reason(prompts, from_config):
    # CPM-Ant branches on its cache length and re-reads the whole sequence each step (no graph with a cache, even
    # with the length as a host int), and its outputs on a sequence change with the tokens after it
    cpu, tpu = _cpmant(from_config)
    generation.WARNED.clear()
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "max_new_tokens": 4}
    ids = prompts([5])[0]
    match = (
        r"cannot be compiled as one .*; with its cache length as a host int: .*; and without a cache: "
        r"CpmAntForCausalLM's outputs on a sequence change"
    )
    with pytest.warns(UserWarning, match=match):
        assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert not generation.compiled_graphs(tpu)
    # warm-up after that call: no graph to compile, said in the report (warned once already, by generate)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = hf_tpu.warmup(tpu, max_prompt_len=8, batch_sizes=[1], max_new_tokens=4, progress=False)
    assert report.graphs == [] and len(report.not_warmed) == 1
    assert "warm-up has no graph to compile" in report.not_warmed[0] and "and without a cache" in report.not_warmed[0]


def test_warmup_first_of_a_model_whose_forward_does_not_trace_demotes_it_and_returns(prompts, from_config):
    # the same CPM-Ant (its forward branches on its cache length), warmed before any call: warm-up demotes it down
    # the routes as generate would (host length, then without a cache, then upstream's loop), warns once with the
    # reason and returns; explain then says so, and generate runs upstream's loop without warning again
    cpu, tpu = _cpmant(from_config)
    generation.WARNED.clear()
    assert explain(tpu).loop == "cached"  # (what can be checked before a trace finds nothing)
    with pytest.warns(UserWarning, match=r"at modeling_cpmant\.py.*no graph to compile") as w:
        report = hf_tpu.warmup(tpu, max_prompt_len=8, batch_sizes=[1], max_new_tokens=4, progress=False)
    assert len([x for x in w if "hf_tpu:" in str(x.message)]) == 1
    route = explain(tpu)
    assert route.loop == "upstream" and "cannot be compiled as one static-shape graph" in route.reason
    assert "and without a cache: CpmAntForCausalLM's outputs on a sequence change" in route.reason
    assert len(report.not_warmed) == 1 and route.reason in report.not_warmed[0]
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "max_new_tokens": 4}
    for ids in (prompts([5])[0], prompts([3, 6], seed=1)[0]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (said once, by warm-up)
            got = tpu.generate(ids, **kw)
        assert torch.equal(got, cpu.generate(ids, **kw))


def test_a_class_with_its_own_generate_is_named_and_warmup_refuses_it(prompts, from_config):
    # MusicGen-Melody's decoder defines its own generate (a loop over codebooks calling the sampler itself): hf_tpu's
    # loop, plugged into GenerationMixin.generate, never runs; upstream's code runs on the TPU with inputs placed there
    from transformers import MusicgenMelodyDecoderConfig, MusicgenMelodyForCausalLM, WhisperForConditionalGeneration

    from hf_tpu.transformers._upstream import own_generate

    config = MusicgenMelodyDecoderConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64, num_codebooks=1,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    cpu, tpu = from_config(MusicgenMelodyForCausalLM, config)
    assert "MusicgenMelodyForCausalLM: its class has a generate of its own" in own_generate(tpu)
    assert own_generate(WhisperForConditionalGeneration.__new__(WhisperForConditionalGeneration)) is None  # super()
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    ids = prompts([5])[0]
    assert torch.equal(tpu.generate(ids.to("tpu"), **kw).cpu(), cpu.generate(ids, **kw))
    assert not generation.compiled_graphs(tpu)
    with pytest.raises(generation.NotCompilableError, match="a generate of its own"):
        hf_tpu.warmup(tpu, max_prompt_len=8, batch_sizes=[1], max_new_tokens=4, progress=False)


def test_the_assistants_generate_inside_upstreams_assisted_decoding_runs_upstream_too(from_config, prompts):
    # assisted decoding (upstream's loop) calls the assistant's generate with the outer call's logits processors,
    # which keep device state they prepare at their first call: that inner call runs upstream's loop as well (on
    # hf_tpu's, the processors would run on the host and leave host tensors for the outer loop on the tpu)
    # (a class without logits_to_keep: its assistant call would otherwise take hf_tpu's loop)
    from transformers import GPT2DoubleHeadsModel

    from hf_tpu.testing import tiny_config

    cpu, tpu = from_config(GPT2DoubleHeadsModel, tiny_config("gpt2", vocab_size=96))
    ids, mask = prompts([6], seed=8)
    kw = {"max_new_tokens": 4, "do_sample": False, "bad_words_ids": [[1, 0]], "repetition_penalty": 1.2,
          "return_dict_in_generate": True, "output_scores": True, "eos_token_id": None}  # fmt: skip
    from hf_tpu.transformers import _upstream

    inner = []
    original = _upstream.nested_call

    def spy():
        reason = original()
        inner.append(reason)
        return reason

    _upstream.nested_call = spy
    try:
        got = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), assistant_model=tpu, **kw)
    finally:
        _upstream.nested_call = original
    expected = cpu.generate(ids, attention_mask=mask, assistant_model=cpu, **kw)
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores).cpu(), torch.stack(expected.scores))
    assert any(reason and "inside upstream's generate" in reason for reason in inner), inner


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return Phi3ForCausalLM, config


def _phimoe():
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return PhimoeForCausalLM, config


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM, MambaConfig(vocab_size=96, hidden_size=32, state_size=4, num_hidden_layers=2)


@pytest.mark.parametrize("family", [_phi3, _phimoe, _mamba], ids=["phi3", "phimoe", "mamba"])
def test_the_call_s_prepare_inputs_wrapper_keeps_the_class_s_signature(family):
    # upstream's generate takes inputs_embeds only where inspect.signature(model.prepare_inputs_for_generation)
    # names them: the wrapper upstream's loop runs with must show the class's own method's signature
    import inspect

    from hf_tpu.transformers._upstream import inputs_on_model_device

    model_class, config = family()
    tpu = model_class(config).eval().to("tpu")
    own = inspect.signature(tpu.prepare_inputs_for_generation)
    assert "prepare_inputs_for_generation" in model_class.__dict__
    with inputs_on_model_device(tpu):
        assert "prepare_inputs_for_generation" in vars(tpu)  # the call's wrapper is in place
        assert inspect.signature(tpu.prepare_inputs_for_generation) == own
        assert tpu.prepare_inputs_for_generation.__name__ == "prepare_inputs_for_generation"
        assert tpu.prepare_inputs_for_generation.__doc__ == model_class.prepare_inputs_for_generation.__doc__
    assert "prepare_inputs_for_generation" not in vars(tpu)
    assert "inputs_embeds" in own.parameters


def test_phi3_generates_from_inputs_embeds_on_upstreams_loop_like_cpu(prompts, from_config):
    # transformers' test_generate_from_inputs_embeds_1_beam_search and test_generate_continue_from_inputs_embeds
    # on Phi3 (whose class overrides prepare_inputs_for_generation): both run upstream's loop on the TPU
    from hf_tpu.transformers._upstream import cache_name

    cpu, tpu = from_config(*_phi3())
    ids = prompts([5], seed=3)[0]
    embeds = cpu.get_input_embeddings()(ids).detach()
    kw = {"do_sample": False, "pad_token_id": 0}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="beam search with inputs_embeds"):
        got = tpu.generate(inputs_embeds=embeds, num_beams=2, max_new_tokens=3, **kw)
    assert torch.equal(got.cpu(), cpu.generate(inputs_embeds=embeds, num_beams=2, max_new_tokens=3, **kw))

    # continue: the first call's cache and the embeddings of the whole sequence so far
    whole = cpu.generate(inputs_embeds=embeds, max_new_tokens=4, **kw)
    first = tpu.generate(inputs_embeds=embeds, max_new_tokens=2, return_dict_in_generate=True, **kw)
    assert torch.equal(first.sequences.cpu(), whole[:, :2])
    more = torch.cat([embeds, cpu.get_input_embeddings()(first.sequences.cpu()).detach()], dim=1)
    ids_so_far = torch.cat([ids, first.sequences.cpu()], dim=1)
    cache = getattr(first, cache_name())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (why this call runs upstream's loop is said by the route)
        rest = tpu.generate(ids_so_far, inputs_embeds=more, max_new_tokens=2, **{cache_name(): cache}, **kw)
    assert torch.equal(rest[:, ids.shape[1] :].cpu(), whole)
