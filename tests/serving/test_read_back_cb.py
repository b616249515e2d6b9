"""Continuous batching without a host wait per decode step (hf_tpu/serving/_chunks.py): the decode-only steps run in
chunks of K = 8 with one read-back each, against CPU ``generate`` per request in the same test.

The read-backs are counted by the simulator (``d2h_copies``: every copy of a device tensor to the host; ``host_syncs``:
every point where the host waited for a device value). Sampled requests are seeded: the CPU reference draws with
hf_tpu's keyed sampler on the CPU's scores (``SeededDraw`` of test_penalties), as the step does on the device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T
from _timeouts import SAFETY_TIMEOUT_S
from conftest import VOCAB, random_prompts
from test_penalties import SeededDraw, finished
from transformers.generation.logits_process import LogitsProcessorList

import hf_tpu.sim
from hf_tpu import serving

NEW = 64
K = 8
NEVER = VOCAB  # an end-of-sequence id no step emits (None would be the model's own, which it does emit)


def _cpu(cpu, prompt: list[int], kw: dict, eos: int | None) -> list[int]:
    procs = [SeededDraw(kw["seed"], kw["temperature"], kw.get("top_k", 0))] if kw.get("temperature") else []
    config = T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos or NEVER, pad_token_id=0)
    out = cpu.generate(torch.tensor([prompt]), generation_config=config, logits_processor=LogitsProcessorList(procs))
    return out[0, len(prompt) :].tolist()


def _ending(free: list[int], at: int) -> int:
    """A token of ``free`` at or after ``at`` that it does not emit before: as the end-of-sequence id, it ends the
    request there."""
    for p in range(at, len(free)):
        if free[p] not in free[:p]:
            return free[p]
    raise AssertionError("no fresh token after the position: pick another prompt")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_manager_reads_back_once_per_chunk_and_equals_cpu(pair, sampled):
    """Four requests of 64 new tokens (two end early on their end-of-sequence id, mid-chunk; two run to the limit),
    greedy or seeded sampled: token for token CPU ``generate``'s, at most one read-back per 4 steps, 0 compiles."""
    cpu, tpu = pair
    prompts = random_prompts([5, 9, 13, 7], seed=4)
    kws = [{"temperature": 0.9, "top_k": 40, "seed": 100 + i} if sampled else {} for i in range(len(prompts))]
    free = [_cpu(cpu, p, kw, None) for p, kw in zip(prompts, kws, strict=True)]
    eos = [_ending(free[0], 21), _ending(free[1], 36), NEVER, NEVER]  # 21, 36: not multiples of 8 (mid-chunk)
    expected = [_cpu(cpu, p, kw, e) for p, kw, e in zip(prompts, kws, eos, strict=True)]
    assert len(expected[0]) < NEW and len(expected[1]) < NEW and len(expected[2]) == NEW

    config = T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=NEVER, pad_token_id=0)
    with tpu.continuous_batching_context_manager(generation_config=config, timeout=SAFETY_TIMEOUT_S) as m:
        with hf_tpu.sim.stats() as s:  # after the manager's warm-up
            ids = [m.add_request(p, max_new_tokens=NEW, eos_token_id=e, **kw)
                   for p, kw, e in zip(prompts, kws, eos, strict=True)]  # fmt: skip
            results = finished(m, ids)
        record = serving.read_backs(m)
    for i, request_id in enumerate(ids):
        assert results[request_id].error is None, results[request_id].error
        assert results[request_id].generated_tokens == expected[i], f"request {i}"
    assert s.compiles == 0
    assert record.every == K and record.chunks > 0 and record.read_backs == s.d2h_copies, (record, s.d2h_copies)
    assert s.d2h_copies * 4 <= record.steps and s.host_syncs * 4 <= record.steps, (record, s.d2h_copies, s.host_syncs)
    assert record.extra_tokens < 2 * K  # the two requests that ended mid-chunk, fewer than K each


def test_generate_batch_reads_back_once_per_chunk_and_equals_cpu_greedy(pair):
    """``generate_batch`` (the offline path): four requests, 64 new tokens, greedy; the second batch after warm-up
    reads back at most once per 4 steps and compiles nothing."""
    cpu, tpu = pair
    config = T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=NEVER, pad_token_id=0)
    prompts = random_prompts([6, 11, 4, 8], seed=5)
    try:
        tpu.generate_batch(prompts[:1], generation_config=config, progress_bar=False, persistent_manager=True)
        record = serving.read_backs(tpu)
        before = dataclasses.replace(record, reasons=dict(record.reasons))
        with hf_tpu.sim.stats() as s:
            out = tpu.generate_batch(prompts, generation_config=config, progress_bar=False, warmup=False,
                                     persistent_manager=True)  # fmt: skip
        after = serving.read_backs(tpu)
        results = sorted(out.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[1]))
        for prompt, result in zip(prompts, results, strict=True):
            assert result.generated_tokens == _cpu(cpu, prompt, {}, None)
        assert s.compiles == 0
        steps, chunks = after.steps - before.steps, after.chunks - before.chunks
        reads = after.read_backs - before.read_backs
        assert steps == NEW and chunks > 0 and reads == s.d2h_copies, (before, after, s.d2h_copies)
        assert s.d2h_copies * 4 <= steps and s.host_syncs * 4 <= steps, (before, after, s.d2h_copies)
    finally:
        tpu.destroy_cached_continuous_batching_manager()


def test_read_back_every_1_is_upstreams_loop(pair):
    """``read_back_every=1``: every step reads back (upstream's loop), the same tokens."""
    cpu, tpu = pair
    config = T.GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=NEVER, pad_token_id=0)
    prompts = random_prompts([6, 9], seed=6)
    saved = serving.SETTINGS.read_back_every
    serving.configure(read_back_every=1)
    try:
        with tpu.continuous_batching_context_manager(generation_config=config, timeout=SAFETY_TIMEOUT_S) as m:
            ids = [m.add_request(p, max_new_tokens=12) for p in prompts]
            results = finished(m, ids)
            assert m._hf_tpu_read_back_every == 1 and serving.read_backs(m).chunks == 0
    finally:
        serving.configure(read_back_every=saved)
    for request_id, prompt in zip(ids, prompts, strict=True):
        cpu_config = T.GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=NEVER, pad_token_id=0)
        want = cpu.generate(torch.tensor([prompt]), generation_config=cpu_config)[0, len(prompt) :].tolist()
        assert results[request_id].generated_tokens == want


def test_a_request_arriving_mid_run_and_one_asking_logprobs(pair):
    """A streamed request decoding in chunks, then a request that arrives after its 10th token (admitted at the end
    of a chunk, prefilled in a step of its own path), then one asking for log-probabilities (its rows come back in
    the chunk's one copy): every token stream equals CPU's, delivered in order, the log-probabilities and top
    alternatives are CPU's log-softmax, and every read-back is counted."""
    cpu, tpu = pair
    prompts = random_prompts([7, 10, 5], seed=8)
    config = T.GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=NEVER, pad_token_id=0)
    with tpu.continuous_batching_context_manager(generation_config=config, timeout=SAFETY_TIMEOUT_S) as m:
        with hf_tpu.sim.stats() as s:
            first = m.add_request(prompts[0], max_new_tokens=40, streaming=True)
            streamed = []
            for out in m.request_id_iter(first):
                streamed.append(list(out.generated_tokens))
                if len(out.generated_tokens) == 10:
                    second = m.add_request(prompts[1], max_new_tokens=40)
            third = m.add_request(prompts[2], max_new_tokens=20, logprobs=2)
            results = finished(m, [second, third])
        record = serving.read_backs(m)
    want = [_cpu(cpu, p, {}, None)[:n] for p, n in zip(prompts, (40, 40, 20), strict=True)]
    assert streamed[-1] == want[0] and [len(t) for t in streamed] == list(range(1, 41))
    assert results[second].generated_tokens == want[1] and results[third].generated_tokens == want[2]
    assert record.chunks >= 4 and record.read_backs == s.d2h_copies and s.d2h_copies * 4 <= record.steps
    with torch.no_grad():
        logits = cpu(torch.tensor([prompts[2] + want[2]])).logits[0, len(prompts[2]) - 1 : -1].float()
    log_probs = logits.log_softmax(-1)
    assert len(results[third].logprobs) == 20
    for j, (chosen, alternatives) in enumerate(results[third].logprobs):
        assert abs(chosen - log_probs[j, want[2][j]].item()) < 1e-4, j
        top = log_probs[j].topk(2)
        assert [a for a, _ in alternatives] == top.indices.tolist(), j
        assert all(abs(v - t) < 1e-4 for (_, v), t in zip(alternatives, top.values.tolist(), strict=True)), j


def test_min_tokens_caps_a_chunk_where_the_end_of_sequence_mask_changes(pair):
    """A request under ``min_tokens`` (its end-of-sequence id biased up, so it ends the first step it may) runs in
    chunks cut where its mask changes: it ends exactly after ``min_tokens``, as CPU's processors say."""
    from test_penalties import EOS, cpu_processors

    cpu, tpu = pair
    prompts = random_prompts([6, 8], seed=9)
    kws = [{"min_tokens": 20, "logit_bias": {EOS: 100.0}}, {"min_tokens": 13}]
    config = T.GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    want = []
    for prompt, kw in zip(prompts, kws, strict=True):
        procs = LogitsProcessorList(cpu_processors(len(prompt), kw))
        out = cpu.generate(torch.tensor([prompt]), generation_config=config, logits_processor=procs)
        want.append(out[0, len(prompt) :].tolist())
    assert len(want[0]) == 21 and want[0][-1] == EOS
    with tpu.continuous_batching_context_manager(generation_config=config, timeout=SAFETY_TIMEOUT_S) as m:
        ids = [m.add_request(p, max_new_tokens=40, **kw) for p, kw in zip(prompts, kws, strict=True)]
        results = finished(m, ids)
        record = serving.read_backs(m)
    for request_id, tokens in zip(ids, want, strict=True):
        assert results[request_id].generated_tokens == tokens
    assert record.chunks > 0 and "min_tokens" not in record.reasons


def test_requests_waiting_for_a_slot_do_not_stop_chunks(pair):
    """Six requests on four slots (two wait for a slot): the chunks run while they wait, each ending where a request
    reaches its max_new_tokens and frees a slot; every request equals CPU's."""
    cpu, tpu = pair
    prompts = random_prompts([5, 9, 6, 7, 8, 4], seed=10)
    lengths = [20, 30, 44, 50, 25, 35]
    config = T.GenerationConfig(max_new_tokens=50, do_sample=False, eos_token_id=NEVER, pad_token_id=0)
    with tpu.continuous_batching_context_manager(generation_config=config, timeout=SAFETY_TIMEOUT_S) as m:
        with hf_tpu.sim.stats() as s:
            ids = [m.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
            results = finished(m, ids)
        record = serving.read_backs(m)
    for request_id, prompt, n in zip(ids, prompts, lengths, strict=True):
        assert results[request_id].generated_tokens == _cpu(cpu, prompt, {}, None)[:n]
    assert record.chunks > 0 and record.read_backs == s.d2h_copies and s.d2h_copies * 4 <= record.steps, record
