"""Decode without a host wait: the new tokens stay on the device and come back every K decode steps
(hf_tpu/transformers/_loops/readback.py), against upstream's ``generate`` on CPU in the same test.

The read-backs are counted by the simulator (``d2h_copies``: every copy of a device tensor to the host, ``.item()``
included; ``host_syncs``: every point where the host waited for a device value). Sampled calls equal the CPU's
seeded draws: the device samples by the exponential race (``argmax(p / E)``, one uniform draw per token from the
device generator, :func:`hf_tpu.transformers.sampling.select`), so the CPU reference draws the same way from the
CPU generator seeded alike (:func:`_cpu_draws_as_the_device`), which the simulator's device generator mirrors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_tpu.sim
from hf_tpu.transformers import explain, generation
from hf_tpu.transformers._loops.readback import READ_AHEAD

NEW = 64
SAMPLE = {"do_sample": True, "temperature": 0.9, "top_k": 40}


@contextlib.contextmanager
def _cpu_draws_as_the_device():
    """Upstream's ``torch.multinomial(probs, 1)`` replaced, while the block runs, by the device's exponential race
    drawn from the CPU generator (the same law; the same numbers as the device's for the same seed)."""
    multinomial = torch.multinomial

    def race(probs, num_samples, **kwargs):
        assert num_samples == 1 and not kwargs
        noise = -torch.log1p(-torch.rand_like(probs))
        return (probs / noise.clamp_min(torch.finfo(probs.dtype).tiny)).argmax(dim=-1, keepdim=True)

    torch.multinomial = race
    try:
        yield
    finally:
        torch.multinomial = multinomial


def _cpu(cpu, ids, kwargs, seed=0):
    torch.manual_seed(seed)
    with _cpu_draws_as_the_device():
        return cpu.generate(ids, **kwargs)


def _ending_ids(free, prompt_len: int, rows: list[int], at: int, floor: int = 10) -> list[int]:
    """For each of ``rows``, a token it emits in the free run ``free`` (from new token ``at`` on where it can, else
    from ``floor`` on) that no row emits before new token ``floor``: as end-of-sequence ids, they end each of those
    rows at or after ``floor`` and by that token (other rows may end on them too)."""
    new = free[:, prompt_len:]
    early = set(new[:, :floor].flatten().tolist())
    chosen = []
    for row in rows:
        fresh = [(p, int(t)) for p, t in enumerate(new[row].tolist()) if p >= floor and t not in early | set(chosen)]
        assert fresh, f"row {row} emits no token after {floor} that no row emits before: pick another prompt"
        chosen.append(next((t for p, t in fresh if p >= at), fresh[-1][1]))
    return chosen


@pytest.mark.parametrize(
    ("batch", "do_sample", "ending"),
    [
        (1, False, "none"),
        pytest.param(1, False, "early", marks=pytest.mark.slow),
        pytest.param(1, True, "none", marks=pytest.mark.slow),
        pytest.param(1, True, "early", marks=pytest.mark.slow),
        pytest.param(4, False, "none", marks=pytest.mark.slow),
        pytest.param(4, False, "some", marks=pytest.mark.slow),
        pytest.param(4, False, "all", marks=pytest.mark.slow),
        pytest.param(4, True, "none", marks=pytest.mark.slow),
        (4, True, "some"),
        pytest.param(4, True, "all", marks=pytest.mark.slow),
    ],
)
def test_generate_reads_back_once_per_k_steps_and_equals_cpu(llama, prompts, batch, do_sample, ending):
    """64 new tokens, greedy and sampled, batch 1 and 4, with no end-of-sequence id, one that ends a row early
    while others go on ("some"), and ids that end every row early ("all", "early" at batch 1): token for token the
    CPU's, and at most one read-back per 4 decode steps (K = 8), the extra steps after the last row stopped fewer
    than K + READ_AHEAD (the steps dispatched before a read-back waits)."""
    cpu, tpu = llama
    generation.configure(tpu, buckets=[16, 32, 64, 128])  # prompt + 64 new tokens past the model's 64 positions
    ids, mask = prompts([5 + 3 * row for row in range(batch)], seed=batch)
    kwargs = {"attention_mask": mask, "max_new_tokens": NEW, "pad_token_id": 0, **(SAMPLE if do_sample else {})}
    kwargs["do_sample"] = do_sample
    free = _cpu(cpu, ids, {**kwargs, "eos_token_id": None})
    eos = None
    if ending != "none":
        rows = [0] if ending in ("early", "some") else list(range(batch))
        eos = _ending_ids(free, ids.shape[1], rows, at=24)
    kwargs["eos_token_id"] = eos
    expected = _cpu(cpu, ids, kwargs)
    if ending == "some":
        assert expected.shape[1] == ids.shape[1] + NEW and (expected[0, -1] == 0)  # row 0 padded, another went on
    if ending in ("all", "early"):
        assert expected.shape[1] < ids.shape[1] + NEW  # every row ended early

    torch.manual_seed(0)
    with hf_tpu.sim.stats() as s, generation.read_backs() as calls:
        got = tpu.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    steps = got.shape[1] - ids.shape[1] - 1  # the decode steps whose tokens were returned
    assert s.d2h_copies * 4 <= steps and s.host_syncs * 4 <= steps, (s.d2h_copies, s.host_syncs, steps)
    (call,) = calls
    assert call.every == 8 and call.reason is None and call.read_backs == s.d2h_copies
    assert call.decode_steps == steps + call.extra_steps and 0 <= call.extra_steps < call.every + READ_AHEAD
    if ending == "none":  # max_new_tokens ends the call: no step is dispatched past it, read ahead or not
        assert call.extra_steps == 0


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


class _StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamer_and_a_criterion_of_the_callers_own_between_read_backs(llama, prompts):
    """A streamer gets upstream's ``put`` calls, the first one after the prefill's read-back (the time to the first
    token does not grow); a caller's own stopping criterion runs on the host at each read-back, once per token, and
    cuts mid-chunk where it stops."""
    cpu, tpu = llama
    ids, mask = prompts([6, 9], seed=3)
    kwargs = {"attention_mask": mask, "max_new_tokens": 20, "eos_token_id": None, "pad_token_id": 0}
    a, b = _Collect(), _Collect()
    expected = cpu.generate(ids, streamer=a, **kwargs)
    with hf_tpu.sim.stats() as s, generation.read_backs() as calls:
        got = tpu.generate(ids, streamer=b, **kwargs)
    assert torch.equal(got, expected) and b.chunks == a.chunks and b.ended
    assert s.d2h_copies == calls[0].read_backs == 1 + 3  # the first token alone, then 19 in chunks of 8, 8, 3

    stop = StoppingCriteriaList([_StopAtLength(ids.shape[1] + 11)])  # stops at the 11th new token: mid-chunk
    expected = cpu.generate(ids, stopping_criteria=stop, **kwargs)
    with generation.read_backs() as calls:
        got = tpu.generate(ids, stopping_criteria=stop, **kwargs)
    assert torch.equal(got, expected) and got.shape[1] == ids.shape[1] + 11
    # 16 tokens dispatched for the second read-back, and the next window's first READ_AHEAD before it waited
    assert calls[0].read_backs == 2 and calls[0].extra_steps == 16 - 11 + READ_AHEAD


def test_calls_that_need_the_host_each_step_read_back_each_step_and_explain_says_why(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([4, 7])
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0}
    assert explain(tpu, input_ids=ids, **kwargs).step_by_step is None
    assert "max_time" in explain(tpu, input_ids=ids, max_time=60.0, **kwargs).step_by_step
    scores = {"return_dict_in_generate": True, "output_scores": True}
    assert "logits come back" in explain(tpu, input_ids=ids, **scores, **kwargs).step_by_step
    for asked in ({"max_time": 60.0}, scores):
        with generation.read_backs() as calls:
            got = tpu.generate(ids, **asked, **kwargs)
        expected = cpu.generate(ids, **asked, **kwargs)
        assert torch.equal(getattr(got, "sequences", got), getattr(expected, "sequences", expected))
        assert calls[0].every == 1 and calls[0].read_backs == 6 and calls[0].reason
    generation.configure(tpu, read_back_every=1)
    try:
        assert "read_back_every=1" in explain(tpu, input_ids=ids, **kwargs).step_by_step
        with hf_tpu.sim.stats() as s:
            assert torch.equal(tpu.generate(ids, **kwargs), cpu.generate(ids, **kwargs))
        assert s.d2h_copies == 6
    finally:
        generation.configure(tpu, read_back_every=8)
    with pytest.raises(ValueError, match="read_back_every must be a positive integer"):
        generation.configure(tpu, read_back_every=0)
