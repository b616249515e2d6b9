"""Per-request penalties and biases in the continuous-batching step (hf_tpu/serving/_penalties.py) against
transformers' own logits processors on CPU: ``RepetitionPenaltyLogitsProcessor``, ``SequenceBiasLogitsProcessor``
(``logit_bias``), ``MinNewTokensLengthLogitsProcessor`` (``min_tokens``), and OpenAI's presence and frequency
penalties (no transformers processor: :class:`OpenAIPenalties` below, the formula of OpenAI's documentation)."""

from __future__ import annotations

import time

import pytest
import torch
import transformers as T
from _timeouts import SAFETY_TIMEOUT_S
from conftest import VOCAB, random_prompts
from test_row_sampling import args_of
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

import hf_tpu.sim
from hf_tpu.serving._penalties import RequestTable, penalize, record
from hf_tpu.serving._sampling import noise_key, sample

NEW = 8
EOS = 2


class OpenAIPenalties(LogitsProcessor):
    """``score - frequency * count - presence * (count > 0)``, counts over the generated tokens (after the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class SeededDraw(LogitsProcessor):
    """The draw the step makes from the processed scores (hf_tpu's seeded Gumbel noise, keyed by the request's seed
    and the sequence length), as a one-hot row greedy search picks."""

    def __init__(self, seed: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        self.seed, self.warp = seed, (temperature, top_k, top_p, 0.0)

    def __call__(self, input_ids, scores):
        key = noise_key(self.seed, 0, input_ids.shape[1])
        token = sample(scores.float(), args_of([(*self.warp, key)]))
        return torch.full_like(scores, -1.0).scatter(1, token[:, None], 1.0)


def cpu_processors(prompt_len: int, kw: dict, default_repetition: float = 1.0) -> list:
    """transformers' processors for a request's ``kw``, in the step's order: bias and min_tokens, repetition,
    presence and frequency."""
    procs = []
    if kw.get("logit_bias"):
        procs.append(SequenceBiasLogitsProcessor({(int(t),): b for t, b in kw["logit_bias"].items()}))
    if kw.get("min_tokens"):
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, kw["min_tokens"], EOS))
    repetition = kw.get("repetition_penalty", default_repetition)
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    if kw.get("presence_penalty") or kw.get("frequency_penalty"):
        procs.append(OpenAIPenalties(prompt_len, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0)))
    return procs


class _State:  # what the table reads of transformers' RequestState
    def __init__(self, request_id, prompt, generated, kw):
        self.request_id, self.initial_tokens, self.generated_tokens = request_id, prompt, generated
        self._true_initial_tokens, self._eos_token_ids, self.logit_processor_kwargs = 0, {EOS}, kw


def test_penalize_equals_transformers_processors_row_by_row():
    torch.manual_seed(0)
    table = RequestTable(capacity=4, vocab=VOCAB, device="cpu")
    cases = [
        ({"repetition_penalty": 1.3}, [5, 9, 9, 40], [7, 7, 12]),
        ({"presence_penalty": 0.5, "frequency_penalty": 0.75, "logit_bias": {"3": 5.0, "50": -100.0}}, [4, 8],
         [8, 3, 3]),
        ({"min_tokens": 4, "repetition_penalty": 0.8, "logit_bias": {str(EOS): 30.0}}, [11, 2, 60], [17]),
        ({}, [20, 21], []),
    ]  # fmt: skip
    scores = torch.randn(len(cases), VOCAB) * 3
    rows = torch.tensor([table.row_of(_State(f"r{i}", p, g, kw)) for i, (kw, p, g) in enumerate(cases)])
    values = [(kw.get("repetition_penalty", 1.0), kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0),
               int(len(g) < kw.get("min_tokens", 0))) for kw, _, g in cases]  # fmt: skip
    rep, pres, freq, block = (torch.tensor(c) for c in zip(*values))
    got = penalize(scores, table, rows, rep.float(), pres.float(), freq.float(), block.int())
    for i, (kw, prompt, generated) in enumerate(cases):
        ids = torch.tensor([prompt + generated])
        want = LogitsProcessorList(cpu_processors(len(prompt), kw))(ids, scores[i : i + 1].clone())
        assert torch.equal(got[i : i + 1], want), f"case {i}: {kw}"
    # the chosen tokens are counted in their rows (the spare row takes padding rows)
    record(table, torch.tensor([rows[0], table.spare]), torch.tensor([7, 7]))
    assert table.tokens[rows[0], 7] == 4 * 3 and table.tokens[table.spare].sum() == 4
    table.release({"r1", "r2"})
    assert sorted(table.rows) == ["r1", "r2"] and len(table.free) == 2


@pytest.fixture
def manager_config():
    # the model's own repetition penalty (dropped by upstream's continuous batching) is every request's default
    return T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                              repetition_penalty=1.3)  # fmt: skip


CASES = [  # per-request kwargs of add_request (what hf-tpu serve sends), greedy and seeded sampled, mixed
    {},
    {"repetition_penalty": 1.0, "presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {7: 4.0, 9: -100.0}},
    {"temperature": 0.9, "seed": 11, "top_k": 20, "frequency_penalty": 1.0, "repetition_penalty": 1.1},
    {"min_tokens": 3, "logit_bias": {EOS: 100.0}, "repetition_penalty": 1.0},
    {"temperature": 1.2, "seed": 5, "presence_penalty": -1.0, "min_tokens": 5, "logit_bias": {EOS: 10.0}},
]


def cpu_reference(cpu, prompt: list[int], kw: dict) -> list[int]:
    procs = cpu_processors(len(prompt), kw, default_repetition=1.3)
    if kw.get("temperature"):
        procs.append(SeededDraw(kw["seed"], kw["temperature"], kw.get("top_k", 0)))
    config = T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    out = cpu.generate(torch.tensor([prompt]), generation_config=config, logits_processor=LogitsProcessorList(procs))
    return out[0, len(prompt) :].tolist()


def finished(manager, ids: list[str]) -> dict:
    """The finished results of ``ids`` (upstream's ``get_result`` hands out results in arrival order)."""
    deadline, results = time.monotonic() + SAFETY_TIMEOUT_S, {}
    while len(results) < len(ids):
        assert time.monotonic() < deadline and manager.is_running(), f"unfinished: {set(ids) - set(results)}"
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    return results


def test_penalties_per_request_in_one_batch_match_cpu_with_no_compile_after_warmup(pair, manager_config):
    cpu, tpu = pair
    prompts = random_prompts([6, 9, 4, 7, 5], seed=3)
    with tpu.continuous_batching_context_manager(generation_config=manager_config, timeout=SAFETY_TIMEOUT_S) as m:
        with hf_tpu.sim.stats() as s:  # after the manager's warm-up
            ids = [m.add_request(p, max_new_tokens=NEW, **kw) for p, kw in zip(prompts, CASES, strict=True)]
            results = finished(m, ids)
    assert s.compiles == 0
    for request_id, prompt, kw in zip(ids, prompts, CASES, strict=True):
        result = results[request_id]
        assert result.error is None, (request_id, result.error)
        assert result.generated_tokens == cpu_reference(cpu, prompt, kw), kw
    # min_tokens held EOS back, then the bias chose it
    assert results[ids[3]].generated_tokens[-1] == EOS and len(results[ids[3]].generated_tokens) == 4
