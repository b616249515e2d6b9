"""Logits processors, warpers and sampling on the device (hf_tpu.transformers.sampling), against upstream on CPU."""

from __future__ import annotations

import os

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S
from transformers.generation import logits_process as lp

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import generation
from hf_tpu.transformers.sampling import advance, device_plan, process, select

# Chat models' shipped sampling settings (generation_config.json): the generation config's default top_k=50 stays
# on where the file sets none.
QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
LLAMA3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
GEMMA3 = {"do_sample": True, "top_k": 64, "top_p": 0.95}


def _step_counters(tpu, ids, mask, kwargs, short=2, long=4):
    """Per decode step: (h2d copies, d2h copies, d2h bytes per sequence, compiles of the long run)."""

    def run(new_tokens):
        torch.manual_seed(0)
        with hf_tpu.sim.stats() as s:
            out = tpu.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None, **kwargs)
        assert out.shape[1] == ids.shape[1] + new_tokens
        return s

    a, b = run(short), run(long)
    steps = long - short
    return (
        (b.h2d_copies - a.h2d_copies) / steps,
        (b.d2h_copies - a.d2h_copies) / steps,
        (b.d2h_bytes - a.d2h_bytes) / steps / ids.shape[0],
        b.compiles + a.compiles,
    )


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_chat_defaults_sample_on_the_device_with_one_small_copy_per_step(llama, prompts, batch):
    _, tpu = llama
    ids, mask = prompts([5 + (i % 7) for i in range(batch)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no host-path warning
        for settings in (QWEN3, LLAMA3, GEMMA3):
            h2d, d2h, d2h_bytes, compiles = _step_counters(tpu, ids, mask, settings)
            assert h2d <= 1 and d2h <= 1, (settings, h2d, d2h)
            assert d2h_bytes <= 64, (settings, d2h_bytes)
            if settings is not QWEN3:  # other values, or warpers upstream leaves out: the same graphs
                assert compiles == 0, settings
    kinds = {k[0] for k in generation.compiled_graphs(tpu) if k[1] == batch}
    assert {"prefill+temperature+top_k+top_p+sample", "decode+temperature+top_k+top_p+sample"} <= kinds


def test_other_values_compile_nothing_after_warmup(llama, prompts):
    _, tpu = llama
    saved = tpu.generation_config.to_dict()
    tpu.generation_config.update(**QWEN3)
    try:
        assert generation.default_variant(tpu) == "+temperature+top_k+top_p+sample"
        hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[1], max_new_tokens=4, strict=True, progress=False)
        ids, mask = prompts([9])
        with hf_tpu.sim.stats() as s:
            for t, p, k in ((0.6, 0.95, 20), (1.3, 0.5, 3), (1.0, 1.0, 0), (0.2, 0.99, 90)):
                tpu.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=t, top_p=p, top_k=k)
        assert s.compiles == 0
    finally:
        generation.configure(tpu, strict=False)
        tpu.generation_config.update(**{k: saved.get(k) for k in QWEN3})


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at about 1 - 5e-4 (Wilson-Hilferty; z: the normal quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "warpers",
    [
        [lp.TemperatureLogitsWarper(0.6), lp.TopKLogitsWarper(20), lp.TopPLogitsWarper(0.95)],  # Qwen3
        [lp.TemperatureLogitsWarper(1.5), lp.MinPLogitsWarper(0.05), lp.TypicalLogitsWarper(0.9)],
    ],
    ids=["qwen3", "min_p+typical"],
)
def test_device_sampler_draws_upstream_distribution(llama, prompts, warpers):
    cpu, _ = llama
    ids, _ = prompts([8])
    with torch.no_grad():  # a random tiny model's logits are nearly flat: sharpen them so that temperature and the
        logits = cpu(ids).logits[:, -1, :].float() * 12  # cut-offs shape the law (a 0.7-for-0.6 error fails here)
    expected = torch.softmax(lp.LogitsProcessorList(warpers)(ids, logits.clone()), dim=-1)[0].double()
    draws = 6000
    plan = device_plan(warpers, ids.expand(draws, -1), vocab=logits.shape[-1], do_sample=True)
    sampling = plan.to_device("tpu", 1, 0)
    fn = torch.compile(select, backend="tpu", fullgraph=True, dynamic=False)
    torch.manual_seed(3)
    tokens = fn(logits.expand(draws, -1).contiguous().to("tpu"), sampling).cpu()
    counts = torch.bincount(tokens, minlength=logits.shape[-1]).double()
    assert counts[expected == 0].sum() == 0  # nothing outside upstream's kept set is ever drawn
    kept = expected > 0
    assert kept.sum() > 3
    want = expected[kept] * draws
    small = want < 5  # pool the rare tokens into one bin, as a chi-square test needs
    observed = torch.cat([counts[kept][~small], counts[kept][small].sum().reshape(1)])
    want = torch.cat([want[~small], want[small].sum().reshape(1)])
    stat = float(((observed - want) ** 2 / want.clamp_min(1e-12)).sum())
    assert stat < _chi2_critical(int(observed.numel()) - 1), stat


@pytest.mark.parametrize(
    "procs",
    [
        [lp.TopKLogitsWarper(5, min_tokens_to_keep=7), lp.TopPLogitsWarper(0.3, min_tokens_to_keep=4)],
        [lp.MinPLogitsWarper(0.2, min_tokens_to_keep=3), lp.EpsilonLogitsWarper(0.02, min_tokens_to_keep=2)],
        [lp.TypicalLogitsWarper(0.5, min_tokens_to_keep=2), lp.EtaLogitsWarper(0.05, min_tokens_to_keep=2)],
        [lp.TemperatureLogitsWarper(0.7), lp.InfNanRemoveLogitsProcessor(), lp.LogitNormalization()],
    ],
    ids=["top_k+top_p", "min_p+epsilon", "typical+eta", "temperature+inf_nan+normalize"],
)
def test_warpers_keep_what_upstream_keeps(llama, prompts, procs):
    cpu, _ = llama
    ids, _ = prompts([8, 8, 8], seed=5)
    with torch.no_grad():
        logits = cpu(ids).logits[:, -1, :].float() * 3
    expected = lp.LogitsProcessorList(procs)(ids, logits.clone())
    plan = device_plan(procs, ids, vocab=logits.shape[-1], do_sample=True)
    got = process(logits.to("tpu"), plan.to_device("tpu", 1, 0)).cpu()  # eager on the device: no compile
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    torch.testing.assert_close(got[torch.isfinite(got)], expected[torch.isfinite(expected)])


def _processor_groups(free, prompt_len: int) -> list[dict]:
    """Two calls' settings that turn on every processor generation configs set, from CPU's free greedy output."""
    first, second, eos = int(free[0, 0]), int(free[0, 1]), int(free[1, 2])
    pair = [int(free[1, 0]), int(free[1, 1])]
    return [
        {
            "no_repeat_ngram_size": 2,
            "bad_words_ids": [[second], pair],
            "suppress_tokens": [int(free[0, 3])],
            "begin_suppress_tokens": [first],
            "min_new_tokens": 4,
            "repetition_penalty": 1.2,
            "eos_token_id": eos,
            "max_new_tokens": 10,
        },
        {
            "forced_bos_token_id": 1,  # upstream forces it only at length 1, never here: its no-op must hold too
            "forced_eos_token_id": eos,
            "min_length": prompt_len + 3,
            "sequence_bias": [[[first], -4.0], [pair, 3.0]],
            "remove_invalid_values": True,
            "renormalize_logits": True,
            "eos_token_id": eos,
            "max_length": prompt_len + 6,
        },
    ]


def test_greedy_with_processors_matches_cpu(llama, prompts):
    """Over several steps (the device state: length, history, tokens seen) with every processor on at once."""
    cpu, tpu = llama
    for seed in (4,):  # a prompt where the n-gram ban and the repetition penalty act too
        ids, mask = prompts([6, 9], seed=seed)
        free = cpu.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)[:, ids.shape[1] :]
        for group in _processor_groups(free, ids.shape[1]):
            args = {"attention_mask": mask, **group}
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no host-path warning: every one of them runs on the device
                got = tpu.generate(ids, **args)
            expected = cpu.generate(ids, **args)
            assert torch.equal(got, expected), (seed, group)
            limits = {k: group[k] for k in ("max_new_tokens", "max_length") if k in group}
            assert not torch.equal(expected, cpu.generate(ids, attention_mask=mask, eos_token_id=None, **limits))


def _crafted_ids() -> torch.Tensor:
    """Two sequences whose last tokens complete n-grams, bad words and biased prefixes seen earlier."""
    return torch.tensor([[0, 0, 7, 8, 9, 7, 8, 9, 7, 8], [11, 12, 13, 14, 11, 12, 5, 6, 13, 11]])


_PROCESSORS = {
    "repetition_penalty": lambda: lp.RepetitionPenaltyLogitsProcessor(1.7),
    "repetition_penalty_ignoring_prompt": lambda: lp.RepetitionPenaltyLogitsProcessor(0.6, prompt_ignore_length=4),
    "no_repeat_ngram_2": lambda: lp.NoRepeatNGramLogitsProcessor(2),
    "no_repeat_ngram_3": lambda: lp.NoRepeatNGramLogitsProcessor(3),
    "bad_words": lambda: lp.NoBadWordsLogitsProcessor([[4], [8, 9], [7, 8, 40], [12, 13], [95]], eos_token_id=95),
    "sequence_bias": lambda: lp.SequenceBiasLogitsProcessor([[[9], 2.5], [[11, 12], -3.0], [[7, 8, 41], 1.5]]),
    "suppress_tokens": lambda: lp.SuppressTokensLogitsProcessor([1, 2, 50]),
    "begin_suppress_tokens": lambda: lp.SuppressTokensAtBeginLogitsProcessor([3, 60], begin_index=11),
    "min_length": lambda: lp.MinLengthLogitsProcessor(12, eos_token_id=[2, 9]),
    "min_new_tokens": lambda: lp.MinNewTokensLengthLogitsProcessor(10, 2, eos_token_id=9),
    "forced_bos": lambda: lp.ForcedBOSTokenLogitsProcessor(5),
    "forced_eos": lambda: lp.ForcedEOSTokenLogitsProcessor(12, eos_token_id=[9, 3]),
}


@pytest.mark.parametrize("name", sorted(_PROCESSORS))
def test_each_processor_matches_upstream_step_by_step(llama, name):
    """The device form against upstream's ``__call__`` on the same sequence and logits, for three steps (the state
    the graph advances in place), run eagerly on the device: no compile."""
    cpu, _ = llama
    ids = _crafted_ids()
    proc = _PROCESSORS[name]()
    plan = device_plan([proc], ids, vocab=96, do_sample=False)
    assert not isinstance(plan, str), plan
    sampling = plan.to_device("tpu", 16, 2)  # the prompt after two slots of bucket padding, as in the loop
    changed = False
    for appended in ([9, 11], [7, 14], [8, 5]):
        with torch.no_grad():
            logits = cpu(ids).logits[:, -1, :].float()
        expected = _PROCESSORS[name]() if name.startswith("forced") else proc
        expected = expected(ids, logits.clone())
        got = process(logits.to("tpu"), sampling).cpu()
        assert torch.equal(torch.isfinite(got), torch.isfinite(expected)), ids.shape[1]
        torch.testing.assert_close(got[torch.isfinite(got)], expected[torch.isfinite(expected)])
        changed = changed or not torch.equal(expected, logits)
        step = torch.tensor(appended)[:, None]
        advance(sampling, step.to("tpu"))
        ids = torch.cat([ids, step], dim=1)
    assert changed or name == "forced_bos"  # the crafted sequence makes each of them act (BOS only at length 1)


def test_a_processor_without_device_form_keeps_the_host_path_and_warns_once(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([5, 8])

    class Halve(lp.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return torch.where(torch.arange(scores.shape[-1]) % 2 == 0, scores, scores - 5.0)

    args = {"attention_mask": mask, "max_new_tokens": 4, "logits_processor": lp.LogitsProcessorList([Halve()])}
    with pytest.warns(UserWarning, match=r"Halve has no device form.*2 x 96 float32 = 1 KiB"):
        got = tpu.generate(ids, **args)
    assert torch.equal(got, cpu.generate(ids, **args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model class and reason
        tpu.generate(ids, **args)


_SEEDED = """
import os, sys, torch
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
import hf_tpu, hf_tpu.sim
from transformers import AutoModelForCausalLM
hf_tpu.sim.enable()
hf_tpu.enable("generation")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval().to("tpu")
hf_tpu.transformers.configure(model, compile=False)  # the same loop and sampler, run op by op: no compile to wait for
ids = torch.tensor([[5, 17, 33, 8, 61], [9, 9, 41, 2, 70]])
torch.manual_seed(1234)
out = model.generate(ids, max_new_tokens=6, do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
print("TOKENS", out[:, 5:].tolist())
"""


def test_seeded_sampling_is_the_same_in_another_process(llama, model_root):
    _, tpu = llama
    ids = torch.tensor([[5, 17, 33, 8, 61], [9, 9, 41, 2, 70]])
    torch.manual_seed(1234)
    here = tpu.generate(ids, max_new_tokens=6, **QWEN3)[:, 5:].tolist()
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # this process's intra-op thread count (tests/conftest.py sets 1): with another count, the second process
           # found none of the cached graphs usable and compiled all of them again
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [sys.executable, "-c", _SEEDED, str(model_root / "llama")], capture_output=True, text=True, env=env,
        timeout=SAFETY_TIMEOUT_S, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS")][-1]
    assert line == f"TOKENS {here}"
