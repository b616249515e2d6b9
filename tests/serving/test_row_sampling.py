"""hf_tpu's per-row sampling (hf_tpu/serving/_sampling.py) against transformers' warpers on CPU, without a server."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_tpu.serving._sampling import ROWS, noise_key, sample

VOCAB = 64


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of Pearson's chi-square (Wilson-Hilferty), over the tokens CPU gives a probability; any draw of a
    token CPU excludes fails outright."""
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the warpers remove"
    expected = probs[support] * n
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    df = max(int(support.sum()) - 1, 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def args_of(rows: list[tuple[float, int, float, float, int]]) -> torch.Tensor:
    columns = list(zip(*rows))
    floats = torch.tensor([columns[0], columns[2], columns[3]], dtype=torch.float32).view(torch.int32)
    return torch.stack([floats[0], torch.tensor(columns[1], dtype=torch.int32), floats[1], floats[2],
                        torch.tensor(columns[4], dtype=torch.int32)])  # fmt: skip


def cpu_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    return torch.softmax(warpers(None, logits[None].clone())[0], dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.5, 8, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 20, 0.9, 0.05)],
)
def test_draws_follow_transformers_warpers(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 2
    n = 20000
    rows = [(temperature, top_k, top_p, min_p, noise_key(seed, 0, 7)) for seed in range(n)]
    tokens = sample(logits.expand(n, VOCAB).contiguous(), args_of(rows))
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert chi_square_p(counts, cpu_probs(logits, temperature, top_k, top_p, min_p).double()) > 1e-3


def test_greedy_and_sampled_rows_share_a_step_and_a_key_repeats_its_draw():
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB)
    rows = [(0.0, 0, 1.0, 0.0, noise_key(1, 0, 0)), (1.0, 0, 1.0, 0.0, noise_key(2, 0, 0)),
            (0.0, 5, 0.5, 0.0, noise_key(3, 0, 0)), (1.0, 0, 1.0, 0.0, noise_key(2, 0, 0)),
            (1.0, 0, 1.0, 0.0, noise_key(2, 1, 0)), (1.0, 1, 1.0, 0.0, noise_key(4, 0, 0))]  # fmt: skip
    same = logits.clone()
    same[3] = same[1]
    same[4] = same[1]
    tokens = sample(same, args_of(rows))
    assert tokens[0] == same[0].argmax() and tokens[2] == same[2].argmax()  # greedy rows: argmax, filters ignored
    assert tokens[5] == same[5].argmax()  # top_k 1 samples the argmax
    assert tokens[1] == tokens[3]  # the same key, the same draw
    draws = [sample(same[1:2], args_of([(1.0, 0, 1.0, 0.0, noise_key(2, c, 0))]))[0].item() for c in range(40)]
    assert len(set(draws)) > 1  # another choice index, another draw


def test_rows_and_keys():
    assert ROWS[:5] == ("temperature", "top_k", "top_p", "min_p", "key")  # (sample reads these; penalties the rest)
    keys = {noise_key(s, c, p) for s in range(4) for c in range(3) for p in range(5)}
    assert len(keys) == 60 and all(-(2**31) <= k < 2**31 for k in keys)


def test_a_top_p_that_is_zero_in_float32_keeps_the_most_likely_token():
    """top_p 1e-300 is 0 in float32: the filters kept no token and the step drew token 0 (a pad) every time."""
    torch.manual_seed(2)
    logits = torch.randn(8, VOCAB) * 3
    rows = [(t, k, float(torch.tensor(1e-300, dtype=torch.float32)), 0.0, noise_key(s, 0, 0))
            for s, (t, k) in enumerate([(1.0, 0), (1.5, 5), (0.7, 0), (2.0, 64)] * 2)]  # fmt: skip
    assert (sample(logits, args_of(rows)) == logits.argmax(dim=-1)).all()


def test_the_row_sampler_fails_a_request_whose_settings_the_step_cannot_hold():
    """Upstream calls ``check_kwargs`` as a request joins the batch and fails that request alone on an error."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )

    from hf_tpu.errors import InvalidArgumentError
    from hf_tpu.serving._penalties import RequestTable
    from hf_tpu.serving._sampling import RowSampling

    upstream = ContinuousBatchingLogitsProcessorList(LogitsProcessorList())
    rows = RowSampling(upstream, GenerationConfig(), top_n=5, table=RequestTable(2, VOCAB, "cpu"))
    rows.check_kwargs({"temperature": 0.5, "top_k": 2**31 - 1, "seed": 2**70, "logprobs": 5, "logit_bias": {3: 1.0}})
    for bad in ({"top_k": 2**31}, {"min_tokens": -(2**31) - 1}, {"temperature": float("inf")},
                {"top_p": float("nan")}, {"repetition_penalty": 1e39}, {"logprobs": 6}, {"logit_bias": {VOCAB: 1.0}},
                {"logit_bias": {1: float("inf")}}):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            rows.check_kwargs(bad)
    # below vLLM's epsilon a sampling config is greedy (a temperature of 1e-39 is 0 in float32: pad tokens before)
    assert RowSampling(upstream, GenerationConfig(do_sample=True, temperature=1e-39), 5,
                       RequestTable(2, VOCAB, "cpu")).defaults["temperature"] == 0.0  # fmt: skip
