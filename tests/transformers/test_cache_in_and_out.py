"""The cache in and out of hf_tpu's loop, against upstream's ``generate`` on the CPU: ``return_dict_in_generate=True``
returns the call's cache as a transformers ``DynamicCache`` (what upstream's loop leaves in its cache), which the
next ``generate`` continues from on the fast path (copied into the bucketed cache, its uncached token through the
decode graph), with the tokens and scores of one longer call and no compile; a cache the loop cannot take runs
upstream's loop with a one-time warning naming why."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_tpu.sim
from hf_tpu.transformers import explain, generation
from hf_tpu.transformers._upstream import cache_name, output_cache_field

KW = {"do_sample": False, "return_dict_in_generate": True, "output_scores": True, "eos_token_id": None}


def _cache_of(out):
    return getattr(out, output_cache_field(type(out)))


def _ones(mask, n: int):
    return torch.cat([mask, torch.ones(mask.shape[0], n, dtype=mask.dtype)], dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_three_tokens_then_one_more_from_the_cache_equal_four(family, pair, prompts):
    cpu, tpu = pair(family)
    ids, mask = prompts([3, 7])
    four = tpu.generate(ids, attention_mask=mask, max_new_tokens=4, **KW)  # (warms the shapes both calls use)
    three = tpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
    cache = _cache_of(three)
    assert isinstance(cache, transformers.DynamicCache) and cache.get_seq_length() == ids.shape[1] + 2
    # the cache holds what upstream's loop leaves in the one it returns
    upstream = _cache_of(cpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW))
    assert upstream.get_seq_length() == cache.get_seq_length()
    for ours, theirs in zip(cache.layers, upstream.layers):
        torch.testing.assert_close(ours.keys.cpu(), theirs.keys)
        torch.testing.assert_close(ours.values.cpu(), theirs.values)
    with hf_tpu.sim.stats() as s:
        one = tpu.generate(
            three.sequences, attention_mask=_ones(mask, 3), max_new_tokens=1, **{cache_name(): cache}, **KW
        )
    assert s.compiles == 0
    assert torch.equal(one.sequences, four.sequences)
    assert torch.equal(one.scores[0], four.scores[3])  # the same decode step as the longer call's
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=4, **KW)
    assert torch.equal(four.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(four.scores), torch.stack(expected.scores))
    assert cache_name() in ("cache", "past_key_values") and _cache_of(one).get_seq_length() == ids.shape[1] + 3


def test_the_returned_cache_continues_in_a_forward_like_cpu(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([5, 2], seed=3)
    out = tpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
    ref = cpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
    last, full = out.sequences[:, -1:], _ones(mask, 3)
    with torch.no_grad():
        got = tpu(input_ids=last.to("tpu"), attention_mask=full.to("tpu"), **{cache_name(): _cache_of(out)}).logits
        want = cpu(input_ids=last, attention_mask=full, **{cache_name(): _cache_of(ref)}).logits
    torch.testing.assert_close(got.cpu(), want)


def test_a_cache_the_caller_built_is_copied_in(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([6, 4], seed=4)
    cache = transformers.DynamicCache()  # filled on the CPU by the caller's own forward over all but the last id
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate numbers a left-padded prompt
    inputs = {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1], "position_ids": positions[:, :-1]}
    with torch.no_grad():
        cpu(**inputs, **{cache_name(): cache})
    kw = {"attention_mask": mask, "max_new_tokens": 4, **KW}
    got = tpu.generate(ids, **{cache_name(): cache}, **kw)
    expected = cpu.generate(ids, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))
    assert cache.get_seq_length() == ids.shape[1] - 1  # (the caller's cache is read, not changed)


def _assert_same_cache(ours, theirs):
    assert type(ours) is type(theirs) and len(ours.layers) == len(theirs.layers)
    assert int(ours.get_seq_length()) == int(theirs.get_seq_length())
    for mine, up in zip(ours.layers, theirs.layers):
        assert type(mine) is type(up)
        assert int(mine.get_seq_length()) == int(up.get_seq_length())
        torch.testing.assert_close(mine.keys.cpu(), up.keys)
        torch.testing.assert_close(mine.values.cpu(), up.values)


# mistral: every layer a window of 6; gemma3: a window of 6 then a full-attention layer. Prompts of 7 and 9 tokens:
# the window is full before the first new token, so the bucketed layers are rings.
@pytest.mark.parametrize("family", ["mistral", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_sliding_window_caches_come_back_as_upstreams_and_continue(family, pair, prompts):
    cpu, tpu = pair(family)
    ids, mask = prompts([7, 9], seed=7)
    three = tpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
    ref = cpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
    assert torch.equal(three.sequences.cpu(), ref.sequences)
    _assert_same_cache(_cache_of(three), _cache_of(ref))  # DynamicSlidingWindowLayer: the last window - 1 tokens
    four = cpu.generate(ids, attention_mask=mask, max_new_tokens=4, **KW)
    assert torch.equal(tpu.generate(ids, attention_mask=mask, max_new_tokens=4, **KW).sequences.cpu(), four.sequences)
    more = {"attention_mask": _ones(mask, 3), "max_new_tokens": 1, cache_name(): _cache_of(three), **KW}
    assert explain(tpu, input_ids=three.sequences, **more).loop == "cached"
    with hf_tpu.sim.stats() as s:
        one = tpu.generate(three.sequences, **more)
    assert s.compiles == 0  # the decode graph of the longer call
    assert torch.equal(one.sequences.cpu(), four.sequences)
    torch.testing.assert_close(one.scores[0].cpu(), four.scores[3])
    # the same with the static cache upstream returns for cache_implementation="static"
    kw = {"attention_mask": mask, "max_new_tokens": 3, "cache_implementation": "static", **KW}
    static, ref = tpu.generate(ids, **kw), cpu.generate(ids, **kw)
    assert isinstance(_cache_of(static), transformers.StaticCache)
    _assert_same_cache(_cache_of(static), _cache_of(ref))
    got = tpu.generate(static.sequences, attention_mask=_ones(mask, 3), max_new_tokens=1,
                       **{cache_name(): _cache_of(static)}, **KW)  # fmt: skip
    assert torch.equal(got.sequences.cpu(), four.sequences)


def test_a_short_call_keeps_one_slot_per_token_and_continues_past_the_window(pair, prompts):
    # prompts of 2 and 3 tokens, 2 new: the window (6) is not full, the bucketed layer is not a ring; the next call
    # goes past the window
    cpu, tpu = pair("mistral")
    ids, mask = prompts([2, 3], seed=8)
    out, ref = (m.generate(ids, attention_mask=mask, max_new_tokens=2, **KW) for m in (tpu, cpu))
    _assert_same_cache(_cache_of(out), _cache_of(ref))
    more = {"attention_mask": _ones(mask, 2), "max_new_tokens": 6, **KW}
    got = tpu.generate(out.sequences, **{cache_name(): _cache_of(out)}, **more)
    expected = cpu.generate(ref.sequences, **{cache_name(): _cache_of(ref)}, **more)
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    _assert_same_cache(_cache_of(got), _cache_of(expected))


def test_a_cache_with_other_layer_kinds_runs_upstream_with_the_reason(llama, prompts):
    from transformers import MistralConfig

    cpu, tpu = llama
    ids, mask = prompts([5], seed=5)
    config = MistralConfig(**{**cpu.config.to_dict(), "sliding_window": 4096})

    def filled(device):
        cache = transformers.DynamicCache(config=config)  # sliding-window layers where the model has full ones
        model = cpu if device == "cpu" else tpu
        with torch.no_grad():
            model(input_ids=ids[:, :-1].to(device), attention_mask=mask[:, :-1].to(device), **{cache_name(): cache})
        return cache

    kw = {"attention_mask": mask, "max_new_tokens": 3, **KW}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="copied into the bucketed cache only when every layer is full attention"):
        got = tpu.generate(ids, **{cache_name(): filled("tpu")}, **kw)
    expected = cpu.generate(ids, **{cache_name(): filled("cpu")}, **kw)
    assert torch.equal(got.sequences.cpu(), expected.sequences)


def test_an_encoder_decoder_says_it_returns_no_cache(pair, prompts):
    _, tpu = pair("t5")
    ids, mask = prompts([4, 6])
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="returns no cache for T5ForConditionalGeneration"):
        out = tpu.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
    assert _cache_of(out) is None


def test_a_cache_with_inputs_embeds_runs_upstream_with_the_reason(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([5], seed=6)
    embeds = cpu.get_input_embeddings()(ids).detach()

    def filled(model, device):
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[:, :-1].to(device), **{cache_name(): cache})
        return cache

    kw = {"attention_mask": mask, "max_new_tokens": 3, **KW}
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="a cache passed in with inputs_embeds"):
        got = tpu.generate(ids, inputs_embeds=embeds, **{cache_name(): filled(tpu, "tpu")}, **kw)
    expected = cpu.generate(ids, inputs_embeds=embeds, **{cache_name(): filled(cpu, "cpu")}, **kw)
    assert torch.equal(got.sequences.cpu(), expected.sequences)


def test_a_static_cache_call_returns_a_static_cache_like_upstreams(llama, prompts):
    # cache_implementation="static": upstream returns the StaticCache it generated with (max_length - 1 slots, the
    # tokens in the first ones); the next call continues from it on the fast path
    cpu, tpu = llama
    ids, mask = prompts([4, 6], seed=6)
    kw = {"attention_mask": mask, "max_new_tokens": 3, "cache_implementation": "static", **KW}
    out = tpu.generate(ids, **kw)
    ref = cpu.generate(ids, **kw)
    ours, theirs = _cache_of(out), _cache_of(ref)
    assert isinstance(ours, transformers.StaticCache) and isinstance(theirs, transformers.StaticCache)
    assert int(ours.get_seq_length()) == int(theirs.get_seq_length()) == ids.shape[1] + 2
    for mine, up in zip(ours.layers, theirs.layers):
        assert mine.keys.shape == up.keys.shape == (2, mine.keys.shape[1], ids.shape[1] + 2, mine.keys.shape[3])
        torch.testing.assert_close(mine.keys.cpu(), up.keys)
        torch.testing.assert_close(mine.values.cpu(), up.values)
    more = {"attention_mask": _ones(mask, 3), "max_new_tokens": 1, **KW}
    got = tpu.generate(out.sequences, **{cache_name(): ours}, **more)
    expected = cpu.generate(ids, **{**kw, "max_new_tokens": 4})
    assert torch.equal(got.sequences, expected.sequences)
