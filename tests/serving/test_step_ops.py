"""What a steady decode step of the continuous-batching loop dispatches on the device, whatever the batch
(hf_tpu/serving/_staging.py, hf_tpu/serving/_chunks.py): the step's inputs go over in one host->device copy, the
step graph runs, the chunk keeps the step's tokens (one eager copy); one device->host copy per chunk.

Eager ops are counted as torch_tpu counts them (``torch.tpu._get_cache_stats().num_cache_reqs``: each eager op and
each graph compile is a request; the simulator answers it from its counters), per chunk of decode-only steps, at 1
and 8 requests in the same test; the tokens equal CPU ``generate`` per request.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers as T
from _timeouts import SAFETY_TIMEOUT_S
from conftest import random_prompts
from test_penalties import finished

import hf_tpu.sim
from hf_tpu import _torch_tpu, serving
from hf_tpu.serving import _chunks

NEW = 24


@dataclasses.dataclass
class _Counts:
    steps: int = 0
    chunks: int = 0
    eager: int = 0  # torch_tpu's cache requests: eager ops (and compiles, 0 after warm-up)
    h2d: int = 0
    d2h: int = 0


def _decode(tpu, prompts: list[list[int]], monkeypatch) -> tuple[_Counts, dict]:
    counts = _Counts()
    run_chunk = _chunks.run_chunk

    def counted(manager, processor, record, most=None):
        steps, cache = record.chunked_steps, _torch_tpu.cache_stats()
        with hf_tpu.sim.stats() as s:
            run_chunk(manager, processor, record, most)
        counts.steps += record.chunked_steps - steps
        counts.chunks += 1
        counts.eager += (_torch_tpu.cache_stats() - cache).requests
        counts.h2d += s.h2d_copies
        counts.d2h += s.d2h_copies

    config = T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    monkeypatch.setattr(_chunks, "run_chunk", counted)
    try:
        with tpu.continuous_batching_context_manager(generation_config=config, timeout=SAFETY_TIMEOUT_S) as m:
            with hf_tpu.sim.stats() as s:  # after the manager's warm-up
                ids = [m.add_request(p, max_new_tokens=NEW) for p in prompts]
                results = finished(m, ids)
            assert s.compiles == 0
    finally:
        monkeypatch.setattr(_chunks, "run_chunk", run_chunk)
    return counts, {i: results[i].generated_tokens for i in ids}


def test_eager_ops_per_decode_step_do_not_grow_with_the_batch(pair, monkeypatch):
    cpu, tpu = pair
    saved = serving.SETTINGS.slots
    serving.configure(slots=8)
    try:
        per_step = {}
        for n in (1, 8):
            prompts = random_prompts([4 + 3 * i for i in range(n)], seed=11)
            counts, tokens = _decode(tpu, prompts, monkeypatch)
            for prompt, got in zip(prompts, tokens.values(), strict=True):
                want = cpu.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
                assert got == want, f"{n} requests, prompt of {len(prompt)} tokens"
            assert counts.steps >= NEW // 2 and counts.chunks > 0, counts
            assert counts.h2d == counts.steps, counts  # one copy of each step's inputs
            assert counts.d2h == counts.chunks, counts  # one read-back per chunk
            # one eager op per step (the copy of its tokens into the chunk's buffer), and the buffer's allocation
            # at the manager's first chunk (2 ops)
            assert counts.eager <= counts.steps + 2, counts
            per_step[n] = counts.eager / counts.steps
        assert per_step[1] == per_step[8], per_step  # at 1 request as at 8
    finally:
        serving.configure(slots=saved)


def test_the_step_graphs_attention_mask_is_upstreams():
    """The mask the step graph computes from the cumulative lengths (``_staging.masks``) equals, value for value, what
    upstream's ``build_attention_mask`` writes on the reset mask: decodes, prefills, chunked prefills, padding
    sequences and rows, with and without a sliding window, in float32 and bfloat16."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching.utils import build_attention_mask

    from hf_tpu.serving import _staging

    cases = [  # (query lengths, key lengths, padded sequences, padded query tokens, padded key tokens)
        ([1, 1, 1], [5, 9, 2], 4, 16, 32),  # decodes
        ([3, 6], [3, 6], 2, 16, 16),  # first prefills: no cache read (the keys are the queries)
        ([4, 1, 2], [10, 7, 2], 5, 8, 24),  # a chunked prefill, a decode, a prefill
        ([2, 3], [12, 3], 2, 5, 20),  # no padding sequence
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for window in (1, 4):
            for lens_q, lens_k, sequences, q, k in cases:
                cu_q, cu_k = [0], [0]
                for a, b in zip(lens_q, lens_k, strict=True):
                    cu_q.append(cu_q[-1] + a)
                    cu_k.append(cu_k[-1] + b)
                want = torch.full((1, 1, q, k), torch.finfo(dtype).min, dtype=dtype)
                build_attention_mask(want, cu_q, cu_k, sliding_window=window)
                pad = sequences - len(lens_q)
                layer = "sliding_attention" if window > 1 else "full_attention"
                batch = {
                    "input_ids": torch.zeros(1, q, dtype=torch.int32),
                    "read_index": [torch.zeros(k if k > q else 0, dtype=torch.int32)],
                    "cu_seq_lens_q": torch.tensor(cu_q + [cu_q[-1]] * pad, dtype=torch.int32),
                    "cu_seq_lens_k": {layer: torch.tensor(cu_k + [cu_k[-1]] * pad, dtype=torch.int32)},
                }
                staging = SimpleNamespace(mask_types={layer: window}, mask_dtype=dtype)
                got = _staging.masks(staging, batch)
                assert got.dtype == dtype and torch.equal(got, want), (dtype, window, lens_q, lens_k)
