"""Logits processors, warpers and sampling on the device (hf_tpu.transformers.sampling), against upstream on CPU."""

from __future__ import annotations

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
from hf_tpu.transformers.sampling import device_plan, process, select

# Chat models' shipped sampling settings (generation_config.json): the generation config's default top_k=50 stays
# on where the file sets none.
QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
LLAMA3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
GEMMA3 = {"do_sample": True, "top_k": 64, "top_p": 0.95}


def _step_counters(tpu, ids, mask, kwargs, short=2, long=6):
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
        first = _step_counters(tpu, ids, mask, QWEN3)
        for settings in (QWEN3, LLAMA3, GEMMA3):
            h2d, d2h, d2h_bytes, compiles = _step_counters(tpu, ids, mask, settings)
            assert h2d <= 1 and d2h <= 1, (settings, h2d, d2h)
            assert d2h_bytes <= 64, (settings, d2h_bytes)
            if settings is LLAMA3:  # other temperature/top-p values than Qwen3's: the same graphs
                assert compiles == 0
    assert first[1] <= 1
    kinds = {k[0] for k in generation.compiled_graphs(tpu) if k[1] == batch}
    assert "decode+temperature+top_k+top_p+sample" in kinds and "decode+top_k+top_p+sample" in kinds


def test_other_values_compile_nothing_after_warmup(pair, prompts):
    _, tpu = pair("qwen3")
    tpu.generation_config.update(**QWEN3)
    try:
        assert generation.default_variant(tpu) == "+temperature+top_k+top_p+sample"
        hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[2], max_new_tokens=4, strict=True, progress=False)
        ids, mask = prompts([5, 9])
        with hf_tpu.sim.stats() as s:
            for t, p, k in ((0.6, 0.95, 20), (1.3, 0.5, 3), (0.2, 0.99, 90)):
                tpu.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=t, top_p=p, top_k=k)
        assert s.compiles == 0
    finally:
        generation.configure(tpu, strict=False)
        tpu.generation_config.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)


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
    with torch.no_grad():
        logits = cpu(ids).logits[:, -1, :].float()
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


def test_greedy_with_each_processor_matches_cpu(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([6, 9], seed=2)
    base = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False}
    free = cpu.generate(ids, **base, eos_token_id=None)[:, ids.shape[1] :]
    first, second = int(free[0, 0]), int(free[0, 1])
    eos = int(free[1, 2])
    groups = [
        {  # one graph for these: every processor is on in one call
            "no_repeat_ngram_size": 2,
            "bad_words_ids": [[second], [int(free[1, 0]), int(free[1, 1])]],
            "suppress_tokens": [int(free[0, 3])],
            "begin_suppress_tokens": [first],
            "min_new_tokens": 4,
            "eos_token_id": eos,
            "repetition_penalty": 1.2,
        },
        {
            "forced_bos_token_id": 1,  # cur_len is never 1 here: upstream's no-op, kept so
            "forced_eos_token_id": eos,
            "max_length": ids.shape[1] + 6,
            "min_length": ids.shape[1] + 3,
            "sequence_bias": [[[first], -4.0], [[int(free[1, 0]), int(free[1, 1])], 3.0]],
            "remove_invalid_values": True,
            "renormalize_logits": True,
            "eos_token_id": eos,
        },
    ]
    for group in groups:
        for name in group:  # each processor changes CPU's output on its own (so its device form is exercised)
            if name in ("eos_token_id", "max_length", "forced_bos_token_id", "remove_invalid_values"):
                continue
            alone = {name: group[name], "eos_token_id": group.get("eos_token_id")}
            if name == "forced_eos_token_id":
                alone["max_length"] = group["max_length"]
            if name == "renormalize_logits":
                continue  # a log-softmax leaves the argmax alone
            args = {**base, **alone}
            if "max_length" in args:
                args.pop("max_new_tokens")
            plain = {**base, "eos_token_id": group.get("eos_token_id")}
            if "max_length" in args:
                plain = {**args, name: None}
            assert not torch.equal(cpu.generate(ids, **args), cpu.generate(ids, **plain)), name
        args = {**base, **group}
        if "max_length" in args:
            args.pop("max_new_tokens")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no host-path warning: all of them run on the device
            got = tpu.generate(ids, **args)
        assert torch.equal(got, cpu.generate(ids, **args))


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
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _SEEDED, str(model_root / "llama")], capture_output=True, text=True, env=env,
        timeout=SAFETY_TIMEOUT_S, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS")][-1]
    assert line == f"TOKENS {here}"
