"""Beam search and beam sampling on hf_tpu's bucketed loop (hf_tpu.transformers._loops.beam), against upstream's
``_beam_search`` on the CPU in the same test, with the device counters."""

from __future__ import annotations

import os

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import explain, generation

DICT = {"return_dict_in_generate": True, "output_scores": True}


def _beam_kinds(tpu) -> set[str]:
    return {k[0].split("+", 1)[0] for k in generation.compiled_graphs(tpu) if k[0].startswith("beam_")}


def _assert_same(got, expected, scores: bool = True):
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    assert torch.equal(got.beam_indices, expected.beam_indices), (got.beam_indices, expected.beam_indices)
    if scores:
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-5, atol=1e-5)
        assert len(got.scores) == len(expected.scores)
        for mine, theirs in zip(got.scores, expected.scores):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def _stopping_eos(cpu, ids, mask, **kwargs) -> int:
    """An eos id upstream's beams meet early for this prompt (the second new token of its best beam), so that the
    search finishes hypotheses before max_new_tokens."""
    out = cpu.generate(ids, attention_mask=mask, eos_token_id=None, **kwargs)
    return int(out[0, ids.shape[1] + 1])


@pytest.mark.parametrize(
    "num_beams, returns, early_stopping, length_penalty",
    [(3, 2, False, 1.0), (2, 1, True, 1.0), (4, 3, "never", 0.5), (3, 3, False, -1.5)],
)
def test_beam_search_matches_cpu(llama, prompts, num_beams, returns, early_stopping, length_penalty):
    cpu, tpu = llama
    ids, mask = prompts([5, 11])  # batch 2, left padding
    kwargs = dict(
        max_new_tokens=7, num_beams=num_beams, num_return_sequences=returns, early_stopping=early_stopping,
        length_penalty=length_penalty, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    eos = _stopping_eos(cpu, ids, mask, **kwargs)
    assert explain(tpu, input_ids=ids, attention_mask=mask, eos_token_id=eos, **kwargs).loop == "cached"
    expected = cpu.generate(ids, attention_mask=mask, eos_token_id=eos, **kwargs, **DICT)
    got = tpu.generate(ids, attention_mask=mask, eos_token_id=eos, **kwargs, **DICT)
    assert (expected.sequences[:, ids.shape[1] :] == eos).any()  # hypotheses finished at eos
    _assert_same(got, expected)
    assert _beam_kinds(tpu) >= {"beam_prefill", "beam_decode"}
    # the plain call: the sequences only, as upstream's
    plain = tpu.generate(ids, attention_mask=mask, eos_token_id=eos, **kwargs)
    assert torch.equal(plain, expected.sequences)


def test_several_prompt_lengths_in_one_bucket_compile_once(pair, prompts):
    cpu, tpu = pair("qwen3")
    kwargs = dict(max_new_tokens=5, num_beams=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    tpu.generate(prompts([4, 9])[0], attention_mask=prompts([4, 9])[1], **kwargs)
    with hf_tpu.sim.stats() as s:
        for lengths in ((3, 12), (16, 1), (7, 7)):
            ids, mask = prompts(list(lengths), seed=sum(lengths))
            got = tpu.generate(ids, attention_mask=mask, **kwargs, **DICT)
            _assert_same(got, cpu.generate(ids, attention_mask=mask, **kwargs, **DICT))
    assert s.compiles == 0


def test_device_processors_run_in_the_beam_graphs(llama, prompts):
    # what transformers' GenerationTesterMixin passes its beam tests: repetition penalty, n-gram ban, bad words
    cpu, tpu = llama
    ids, mask = prompts([6, 10], seed=3)
    kwargs = dict(
        max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False, repetition_penalty=1.2,
        no_repeat_ngram_size=2, bad_words_ids=[[7], [11, 12]], remove_invalid_values=True, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    got = tpu.generate(ids, attention_mask=mask, **kwargs, **DICT)
    _assert_same(got, cpu.generate(ids, attention_mask=mask, **kwargs, **DICT))
    kinds = [k[0] for k in generation.compiled_graphs(tpu) if k[0].startswith("beam_decode")]
    assert any("repetition_penalty" in k and "no_repeat_ngram" in k for k in kinds), kinds


def test_logits_and_the_cache_come_back_as_upstreams(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([4, 8], seed=5)
    kwargs = dict(max_new_tokens=4, num_beams=2, do_sample=False, eos_token_id=None, pad_token_id=0,
                  output_logits=True, **DICT)  # fmt: skip
    expected = cpu.generate(ids, attention_mask=mask, **kwargs)
    got = tpu.generate(ids, attention_mask=mask, **kwargs)
    _assert_same(got, expected)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    field = "cache" if hasattr(expected, "cache") else "past_key_values"
    mine, theirs = getattr(got, field), getattr(expected, field)
    assert mine.get_seq_length() == theirs.get_seq_length()
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys.cpu(), b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values.cpu(), b.values, rtol=1e-5, atol=1e-5)


def test_one_small_copy_per_step_and_nothing_sent(llama, prompts):
    _, tpu = llama
    ids, mask = prompts([5, 9])
    kwargs = dict(num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(new_tokens):
        with hf_tpu.sim.stats() as s:
            out = tpu.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **kwargs)
        assert out.shape[1] == ids.shape[1] + new_tokens  # no eos: every step ran
        return s

    run(10)  # compiles
    short, long = run(2), run(10)
    steps = 8
    assert long.compiles == 0
    assert (long.h2d_copies - short.h2d_copies) / steps == 0
    assert (long.d2h_copies - short.d2h_copies) / steps <= 1
    assert (long.host_syncs - short.host_syncs) / steps <= 1
    assert (long.d2h_bytes - short.d2h_bytes) / steps <= 8


def test_warmup_compiles_the_beam_graphs(pair, prompts, monkeypatch):
    cpu, tpu = pair("gemma")
    generation.configure(tpu, buckets=[16, 32, 64])
    report = hf_tpu.warmup(tpu, max_prompt_len=20, batch_sizes=[2], max_new_tokens=6, num_beams=[2], progress=False)
    assert {k[0].split("+", 1)[0] for k in report.graphs} >= {"beam_prefill", "beam_decode"}
    monkeypatch.setenv(generation.STRICT_ENV, "1")  # a graph warm-up did not compile would raise
    with hf_tpu.sim.stats() as s:
        for lengths in ((3, 12), (20, 17)):
            ids, mask = prompts(list(lengths))
            kwargs = dict(max_new_tokens=6, num_beams=2, pad_token_id=0)
            got = tpu.generate(ids, attention_mask=mask, **kwargs, **DICT)
            _assert_same(got, cpu.generate(ids, attention_mask=mask, **kwargs, **DICT))
    assert s.compiles == 0
    with pytest.raises(ValueError, match="num_beams must hold integers of at least 2"):
        hf_tpu.warmup(tpu, max_prompt_len=8, num_beams=1, progress=False)


def test_beam_sample_is_seeded_and_scores_its_own_tokens(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([5, 8], seed=7)
    kwargs = dict(max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=True, temperature=0.8, top_k=20,
                  eos_token_id=None, pad_token_id=0, **DICT)  # fmt: skip

    def run():
        torch.manual_seed(11)
        return tpu.generate(ids, attention_mask=mask, **kwargs)

    first, second = run(), run()
    assert torch.equal(first.sequences, second.sequences)
    assert "+beam_sample" in " ".join(k[0] for k in generation.compiled_graphs(tpu))
    # the first step's processed scores are the prompt's, before any draw: upstream's on the CPU
    torch.manual_seed(11)
    reference = cpu.generate(ids, attention_mask=mask, **kwargs)
    torch.testing.assert_close(first.scores[0], reference.scores[0], rtol=1e-5, atol=1e-5)
    # each returned hypothesis: its score is the sum of the scores of the tokens it took, divided by its length
    # (length_penalty 1), as upstream's compute_transition_scores reads them back through beam_indices
    transition = cpu.compute_transition_scores(first.sequences, first.scores, first.beam_indices)
    lengths = (first.beam_indices >= 0).sum(dim=1)
    torch.testing.assert_close(transition.sum(dim=1) / lengths, first.sequences_scores, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(first.sequences_scores).all()


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_beam_calls_only_upstream_serves_say_why(pair, llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([6])
    kwargs = dict(max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
    cases = [
        ({"stopping_criteria": StoppingCriteriaList([_Never()])}, "stopping_criteria of your own"),
    ]
    generation.WARNED.clear()
    for extra, reason in cases:
        route = explain(tpu, input_ids=ids, attention_mask=mask, **kwargs, **extra)
        assert route.loop == "upstream" and route.warn and reason in route.reason, route
        with pytest.warns(UserWarning, match=reason):
            got = tpu.generate(ids, attention_mask=mask, **kwargs, **extra)
        expected = cpu.generate(ids, attention_mask=mask, **kwargs, **extra)
        got = got if isinstance(got, torch.Tensor) else got.sequences
        expected = expected if isinstance(expected, torch.Tensor) else expected.sequences
        assert torch.equal(got, expected)
    t5_cpu, t5 = pair("t5")
    route = explain(t5, input_ids=ids, **kwargs)
    assert route.loop == "upstream" and "encoder-decoder" in route.reason


def test_a_processor_without_device_form_sends_the_beam_call_upstream(llama, prompts):
    # the processors are built inside upstream's generate: the beam loop finds this one has no device form, and the
    # call (not the model) runs upstream's loop, with the reason
    cpu, tpu = llama
    ids, mask = prompts([6])
    kwargs = dict(max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0, encoder_repetition_penalty=1.3)
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="EncoderRepetitionPenaltyLogitsProcessor has no device form"):
        got = tpu.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, cpu.generate(ids, attention_mask=mask, **kwargs))
    assert explain(tpu).loop == "cached"  # the model's route stays


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_attentions_and_hidden_states_come_from_the_beam_graphs(prompts, use_cache):
    # as the greedy loop's (tests/transformers/test_step_outputs.py): each forward's, cut to upstream's shapes; the
    # rows of the caller's own padding tokens (mask 0, read by no token) are left out of the comparison
    import copy

    from hf_tpu.testing import tiny_config, tiny_model

    config = tiny_config("llama", vocab_size=96)
    config._attn_implementation = "eager"  # (sdpa computes no attention weights)
    cpu = tiny_model("llama", config=config)
    tpu = copy.deepcopy(cpu).to("tpu")
    ids, mask = prompts([4, 6], seed=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False, eos_token_id=None,
                  pad_token_id=0, output_attentions=True, output_hidden_states=True, use_cache=use_cache,
                  **DICT)  # fmt: skip
    assert explain(tpu, input_ids=ids, **kwargs).loop == ("cached" if use_cache else "cacheless")
    got, expected = tpu.generate(ids, **kwargs), cpu.generate(ids, **kwargs)
    _assert_same(got, expected)
    rows = mask.repeat_interleave(2, dim=0).bool()  # the prompt's rows, per beam
    for mine, theirs, attention in ((got.attentions, expected.attentions, True),
                                    (got.hidden_states, expected.hidden_states, False)):  # fmt: skip
        assert len(mine) == len(theirs) == 4
        for step, (ours, up) in enumerate(zip(mine, theirs)):
            assert len(ours) == len(up) > 0
            for a, b in zip(ours, up):
                assert a.shape == b.shape, (step, a.shape, b.shape)
                if attention:
                    a, b = a.transpose(1, 2), b.transpose(1, 2)
                keep = torch.ones(a.shape[:2], dtype=torch.bool)  # (rows, queries): the prompt's by its mask
                if step == 0 or not use_cache:
                    keep[:, : rows.shape[1]] = rows
                torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-5)
    assert any(k[0].endswith("+attentions+hidden_states") for k in generation.compiled_graphs(tpu))


_CACHED_PROCESS = """
import json, sys, torch
import hf_tpu, hf_tpu.sim
from transformers import AutoModelForCausalLM
hf_tpu.sim.enable()
hf_tpu.enable("generation")
cpu = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
tpu = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval().to("tpu")
report = hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[2], max_new_tokens=5, num_beams=3, progress=False,
                       cache_dir=sys.argv[2])
ids = torch.tensor([[0, 0, 5, 17, 33, 8, 61], [9, 9, 41, 2, 70, 12, 4]])
mask = (torch.arange(7) >= torch.tensor([[2], [0]])).long()
kw = dict(attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
with hf_tpu.sim.stats() as s:
    got = tpu.generate(ids, **kw)
print("RESULT", json.dumps({"warm_compiles": report.new_compiles, "from_cache": report.from_cache,
                            "compiles": s.compiles, "same": torch.equal(got, cpu.generate(ids, **kw))}))
"""


def test_beam_graphs_come_from_the_persistent_compile_cache_in_a_new_process(llama, model_root, tmp_path):
    import transformers as T

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # this process's intra-op thread count (tests/conftest.py sets 1): with another count, the second process
           # found none of the cached graphs usable and compiled all of them again
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           # this process's float32 matmul precision: a float32 model's graphs are stored per precision
           "HF_TPU_SIM_MATMUL_PRECISION": torch.get_float32_matmul_precision()}
    cache = tmp_path / "cache"

    # The first process is this one (a test worker that built other models first, as a server may have): a fresh
    # copy of the model warms up into the cache, compiling its graphs; the second process then loads them.
    cpu = llama[0]
    tpu = T.AutoModelForCausalLM.from_pretrained(model_root / "llama").eval().to("tpu")
    report = hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[2], max_new_tokens=5, num_beams=3, progress=False,
                           cache_dir=cache)  # fmt: skip
    ids = torch.tensor([[0, 0, 5, 17, 33, 8, 61], [9, 9, 41, 2, 70, 12, 4]])
    mask = (torch.arange(7) >= torch.tensor([[2], [0]])).long()
    kw = dict(attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    with hf_tpu.sim.stats() as s:
        got = tpu.generate(ids, **kw)
    generation.configure(tpu, compile_cache=False)
    assert torch.equal(got, cpu.generate(ids, **kw))
    assert report.new_compiles > 0 and s.compiles == 0 and not report.cache_problems

    done = subprocess.run(
        [sys.executable, "-c", _CACHED_PROCESS, str(model_root / "llama"), str(cache)],
        capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")][-1].split(" ", 1)[1])
    assert second["same"]
    assert second["warm_compiles"] == 0 and second["from_cache"] >= 4 and second["compiles"] == 0, second


@pytest.mark.parametrize("do_sample", [False, True], ids=["beam_search", "beam_sample"])
def test_beam_search_without_a_cache(llama, prompts, do_sample):
    # use_cache=False (transformers' own dict-output beam tests pass it): the loop without a cache, its buffer's rows
    # following the beams; with the attentions and hidden states of each forward over the whole sequence
    cpu, tpu = llama
    ids, mask = prompts([4, 7], seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, num_beams=2, num_return_sequences=2, do_sample=do_sample,
                  use_cache=False, eos_token_id=None, pad_token_id=0, output_logits=True, output_hidden_states=True,
                  **DICT)  # fmt: skip
    assert explain(tpu, input_ids=ids, **kwargs).loop == "cacheless"
    torch.manual_seed(0)
    got = tpu.generate(ids, **kwargs)
    assert {k[0].split("+", 1)[0] for k in generation.compiled_graphs(tpu)} >= {"beam_cacheless_prefill",
                                                                                 "beam_cacheless_decode"}
    torch.manual_seed(0)
    expected = cpu.generate(ids, **kwargs)
    if do_sample:  # the device's draws: the first step's scores are the prompt's, and each hypothesis scores its tokens
        torch.testing.assert_close(got.scores[0], expected.scores[0], rtol=1e-5, atol=1e-5)
        transition = cpu.compute_transition_scores(got.sequences, got.scores, got.beam_indices)
        lengths = (got.beam_indices >= 0).sum(dim=1)
        torch.testing.assert_close(transition.sum(dim=1) / lengths, got.sequences_scores, rtol=1e-5, atol=1e-5)
        return
    _assert_same(got, expected)
    rows = mask.repeat_interleave(2, dim=0).bool()
    assert len(got.hidden_states) == len(expected.hidden_states) == 5
    for step, (ours, up) in enumerate(zip(got.hidden_states, expected.hidden_states)):
        for a, b in zip(ours, up, strict=True):
            assert a.shape == b.shape, (step, a.shape, b.shape)
            keep = torch.ones(a.shape[:2], dtype=torch.bool)
            keep[:, : rows.shape[1]] = rows
            torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_token_type_ids_take_the_beam_loop(pair, prompts, use_cache):
    # GPT-2's token types (transformers' own GPT-2 generation tests pass them): the prompt's through the prefill,
    # then its last one for every new token as upstream extends them; the beams of a prompt share them
    cpu, tpu = pair("gpt2")
    ids, mask = prompts([4, 7], seed=3)
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # the last type differs from the first: it changes the new tokens' scores
    kwargs = dict(attention_mask=mask, token_type_ids=types, max_new_tokens=5, num_beams=2, num_return_sequences=2,
                  do_sample=False, use_cache=use_cache, eos_token_id=None, pad_token_id=0, **DICT)  # fmt: skip
    assert explain(tpu, input_ids=ids, **kwargs).loop == ("cached" if use_cache else "cacheless")
    got, expected = tpu.generate(ids, **kwargs), cpu.generate(ids, **kwargs)
    _assert_same(got, expected)
    untyped = cpu.generate(ids, **{**kwargs, "token_type_ids": None})
    assert not torch.allclose(untyped.scores[-1], expected.scores[-1])  # the types reach the new tokens too
    kind = "beam_prefill" if use_cache else "beam_cacheless_prefill"
    assert any(k[0].startswith(kind) and k[0].endswith("+token_type_ids") for k in generation.compiled_graphs(tpu))
