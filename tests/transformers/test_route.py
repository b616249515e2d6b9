"""``hf_tpu.transformers.explain``: the route a ``generate`` call takes, with its reason, decided in one place.

Each test builds a tiny model, asks ``explain`` before and after ``generate``, and checks that the route it names
is the loop that ran (the graph kinds compiled, or none for upstream's loop) and that the output equals the CPU's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_tpu
from hf_tpu.transformers import Route, explain, generation

GREEDY = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, "max_new_tokens": 5}


def _kinds(model) -> set[str]:
    return {key[0].split("+", 1)[0] for key in generation.compiled_graphs(model)}


def test_a_full_attention_model_takes_the_cached_loop(from_config, prompts):
    from transformers import LlamaForCausalLM

    from hf_tpu.testing import tiny_config

    cpu, tpu = from_config(LlamaForCausalLM, tiny_config("llama", vocab_size=96))
    ids = prompts([6])[0]
    route = explain(tpu, input_ids=ids, **GREEDY)
    assert isinstance(route, Route) and route.loop == "cached" and route.reason is None and route.fast
    assert route.host_sampling is None  # greedy search: the argmax in the graph
    assert torch.equal(tpu.generate(ids, **GREEDY), cpu.generate(ids, **GREEDY))
    assert _kinds(tpu) == {"prefill", "decode"}
    assert explain(tpu).loop == "cached"  # the model's own generation_config: what warm-up compiles
    scores = explain(tpu, input_ids=ids, return_dict_in_generate=True, output_scores=True, **GREEDY)
    assert scores.loop == "cached" and "output_scores" in scores.host_sampling


def test_calls_only_upstream_serves_say_why(llama, prompts):
    cpu, tpu = llama
    ids = prompts([6])[0]
    stop = StoppingCriteriaList([_NeverStop()])
    beams = explain(tpu, input_ids=ids, num_beams=2, stopping_criteria=stop, **GREEDY)
    assert beams.loop == "upstream" and beams.warn and "stopping_criteria of your own" in beams.reason
    assert explain(tpu, input_ids=ids, num_beams=2, **GREEDY).loop == "cached"  # (hf_tpu.transformers._loops.beam)
    dynamic = explain(tpu, input_ids=ids, cache_implementation="dynamic", **GREEDY)
    assert dynamic.loop == "upstream" and "every decode step has a new shape" in dynamic.reason
    on_cpu = explain(cpu, input_ids=ids, **GREEDY)
    assert on_cpu.loop == "upstream" and on_cpu.reason == "not on a tpu device" and not on_cpu.warn
    generation.WARNED.clear()
    before = generation.compiled_graphs(tpu)
    with pytest.warns(UserWarning, match="stopping_criteria of your own"):
        got = tpu.generate(ids, num_beams=2, stopping_criteria=stop, **GREEDY)
    assert torch.equal(got, cpu.generate(ids, num_beams=2, stopping_criteria=stop, **GREEDY))
    assert generation.compiled_graphs(tpu) == before  # upstream's loop ran: no graph of hf_tpu's


class _NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_use_cache_false_takes_the_loop_without_a_cache(llama, prompts):
    cpu, tpu = llama
    ids = prompts([6])[0]
    route = explain(tpu, input_ids=ids, use_cache=False, **GREEDY)
    assert route.loop == "cacheless" and not route.warn
    before = len(generation.compiled_graphs(tpu))
    got = tpu.generate(ids, use_cache=False, **GREEDY)
    assert torch.equal(got, cpu.generate(ids, use_cache=False, **GREEDY))
    new = {key[0] for key in generation.compiled_graphs(tpu)[before:]}
    assert new == {"cacheless_prefill", "cacheless_decode"}
    assert explain(tpu).loop == "cached"  # the model's calls with a cache keep their route


def test_a_model_whose_cache_has_no_bucketed_form_runs_without_one(from_config, prompts):
    # RWKV keeps its state in a cache class of its own: the loop without a cache, with the reason said
    from test_cacheless import tiny_rwkv_config
    from transformers import RwkvForCausalLM

    cpu, tpu = from_config(RwkvForCausalLM, tiny_rwkv_config())
    route = explain(tpu)
    assert route.loop == "cacheless" and route.warn and "keeps its own cache type" in route.reason
    ids = prompts([5])[0]
    assert torch.equal(tpu.generate(ids, **GREEDY), cpu.generate(ids, **GREEDY))
    assert _kinds(tpu) == {"cacheless_prefill", "cacheless_decode"}


def test_a_forward_branching_on_the_cache_length_is_demoted_to_the_host_length(from_config, prompts):
    # GIT branches on `cache_length > 0`: decided "cached" before any trace, the first trace demotes it
    from test_host_length import _git

    cpu, tpu = _git(from_config)
    assert explain(tpu).loop == "cached"
    ids = prompts([5])[0]
    assert torch.equal(tpu.generate(ids, **GREEDY), cpu.generate(ids, **GREEDY))
    route = explain(tpu)
    assert route.loop == "host_length" and "cannot be compiled as one static-shape graph" in route.reason
    assert _kinds(tpu) == {"prefill", "decode"}
    # the prompt as embeddings needs ids-built layouts such a model cannot take: upstream for that call only
    embeds = explain(tpu, inputs_embeds=torch.zeros(1, 5, 32), **GREEDY)
    assert embeds.loop == "upstream" and "places its prompt by its cache length" in embeds.reason


def test_a_model_no_loop_of_hf_tpus_serves_runs_upstreams_and_warmup_says_so(from_config):
    # XLNet keeps a cache of its own (no bucketed form), and its outputs on a sequence change with the tokens after
    # it (no bucket's padding can follow it): upstream's loop, decided before any trace, the reason naming both
    from transformers import XLNetConfig, XLNetLMHeadModel

    config = XLNetConfig(vocab_size=96, d_model=32, n_layer=2, n_head=2, d_inner=64)
    cpu, tpu = from_config(XLNetLMHeadModel, config)
    route = explain(tpu)
    assert route.loop == "upstream" and route.warn and not route.fast
    assert "keeps its own cache type" in route.reason and "and without a cache" in route.reason
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="keeps its own cache type.*warm-up has no graph to compile"):
        report = hf_tpu.warmup(tpu, max_prompt_len=8, batch_sizes=[1], max_new_tokens=4, progress=False)
    assert report.graphs == [] and route.reason in report.not_warmed[0]
    ids = torch.tensor([[5, 6, 7, 8]])
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="running upstream's generate on the TPU instead"):
        got = tpu.generate(ids, **GREEDY)
    assert torch.equal(got.cpu(), cpu.generate(ids, **GREEDY))
    assert generation.compiled_graphs(tpu) == []


def test_a_failure_raised_while_an_earlier_trace_failure_was_handled_is_not_taken_for_one():
    # The second trace of a demoted model can run while the first failure is being handled: an unrelated error then
    # (a backend's, a transfer's) has that NotCompilableError as its context and must surface as itself, not
    # demote the model once more with the first trace's reason.
    from hf_tpu.transformers._graphs import _not_one_graph

    def raised(make):
        try:
            make()
        except Exception as exc:  # noqa: BLE001
            return exc
        raise AssertionError("nothing raised")

    def dynamo_refused():  # dynamo wraps what it met: the cause is followed
        raise RuntimeError("backend wrapper") from torch._dynamo.exc.Unsupported("a branch on a tensor")

    def first_trace_failed():
        raise generation.NotCompilableError("the cached prefill") from raised(dynamo_refused)

    def while_handling():
        try:
            first_trace_failed()
        except generation.NotCompilableError:
            raise RuntimeError("failed to transfer to 'tpu' device")  # noqa: B904

    assert _not_one_graph(raised(dynamo_refused)) == "a branch on a tensor"
    assert _not_one_graph(raised(while_handling)) is None
