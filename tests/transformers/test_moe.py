"""MoE models on hf_tpu's fast path: transformers' default experts (``grouped_mm``) and the ragged-dot Hub kernel.

Routing never changes a shape: a second prompt length in the same bucket compiles nothing and meets at most a few
new eager shapes, a decode step costs one small copy each way, warm-up covers every later length, and a second
process loads every graph from the persistent compile cache. The other MoE families are in the architecture sweep
(docs/architectures.md; a slice of it in tests/transformers/test_arch_sweep.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu
import hf_tpu.sim
from hf_tpu import compile_cache
from hf_tpu.transformers import generation

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_cache_worker.py")
VOCAB = 96
WARMUP = {"max_prompt_len": 20, "batch_sizes": [2], "max_new_tokens": 6}  # as _cache_worker.py warms up
KW = {"do_sample": False, "eos_token_id": None}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from hf_tpu.testing import tiny_model

    path = tmp_path_factory.mktemp("moe") / "qwen3_moe"
    tiny_model("qwen3_moe", path, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def expected(moe_dir):
    """``expected(length, seed, new_tokens)``: greedy tokens of ``_prompt(length, 2, seed)`` on CPU with transformers'
    default experts (``grouped_mm``), computed once for both experts implementations (the ragged-dot kernel must
    give upstream's tokens too)."""
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(moe_dir, experts_implementation="grouped_mm").eval()
    memo: dict[tuple, torch.Tensor] = {}

    def tokens(length: int, seed: int, new_tokens: int = 6) -> torch.Tensor:
        if (length, seed, new_tokens) not in memo:
            ids, mask = _prompt(length, batch=2, seed=seed)
            memo[length, seed, new_tokens] = cpu.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **KW)
        return memo[length, seed, new_tokens]

    return tokens


def _implementation(name: str) -> str:
    if name == "ragged_dot_tpu":
        pytest.importorskip("jax", reason="the ragged-dot kernel needs jax (pip install 'hf-tpu[kernels]')")
        from hf_tpu.kernels import use_ragged_dot_experts

        return use_ragged_dot_experts()
    return name


def _prompt(length: int, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[:, : 20 - length] = 0
    mask[0, : 20 - max(1, length - 3)] = 0  # rows of one batch differ in length
    return ids, mask


def _fast_path_in_one_process(experts: str, moe_dir: Path, expected, cache: Path) -> tuple[str, object]:
    """The in-process part of the fast-path test, its graphs stored in ``cache``: (the experts implementation, the
    warm-up's report)."""
    from transformers import AutoModelForCausalLM

    impl = _implementation(experts)
    tpu = AutoModelForCausalLM.from_pretrained(moe_dir, experts_implementation=impl, device_map="tpu").eval()
    kw = KW
    with hf_tpu.enabled("generation"):
        generation.configure(tpu, compile_cache=cache)  # every graph compiled below is stored there
        # Two prompt lengths in one bucket (16): the second compiles nothing, whatever the routing.
        first, second = _prompt(5, batch=2, seed=1), _prompt(11, batch=2, seed=2)
        got = tpu.generate(first[0], attention_mask=first[1], max_new_tokens=6, **kw)
        assert torch.equal(got, expected(5, seed=1))
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(second[0], attention_mask=second[1], max_new_tokens=6, **kw)
        assert torch.equal(got, expected(11, seed=2))
        assert {k[0] for k in generation.compiled_graphs(tpu)} == {"prefill", "decode"}  # hf_tpu's loop ran
        assert s.compiles == 0 and s.shape_signatures <= 4
        with hf_tpu.sim.stats() as short:
            tpu.generate(second[0], attention_mask=second[1], max_new_tokens=2, **kw)
        assert (s.h2d_copies - short.h2d_copies) / 4 <= 1 and (s.d2h_copies - short.d2h_copies) / 4 <= 1

        # Warm-up (the other prompt bucket), then 8 prompt lengths across both buckets: no compile.
        report = hf_tpu.warmup(tpu, progress=False, **WARMUP)
        assert len(report.graphs) == 4  # prefill and decode for prompt buckets 16 and 32
        with hf_tpu.sim.stats() as s:
            for length in (1, 3, 6, 9, 13, 16, 17, 20):
                ids, mask = _prompt(length, batch=2, seed=length)
                got = tpu.generate(ids, attention_mask=mask, max_new_tokens=6, **kw)
                assert torch.equal(got, expected(length, seed=length)), length
        assert s.compiles == 0
    return impl, report


def test_moe_fast_path_bucket_warmup_in_one_process(moe_dir, expected, tmp_path):
    """The fast-path test below without its second process (that test is in the slow tier; the second process on the
    compile cache is in the core tier through tests/transformers/test_compile_cache.py)."""
    _fast_path_in_one_process("grouped_mm", moe_dir, expected, tmp_path / "cache")


@pytest.mark.parametrize("experts", ["grouped_mm", "ragged_dot_tpu"])
def test_moe_fast_path_bucket_warmup_and_compile_cache(experts, moe_dir, expected, tmp_path):
    cache = tmp_path / "cache"
    impl, report = _fast_path_in_one_process(experts, moe_dir, expected, cache)

    # A second process loads every graph from the cache and compiles none.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", compile_cache.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(moe_dir), str(cache), impl],
        env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    warm = json.loads(proc.stdout.strip().splitlines()[-1])
    assert warm["equal"] and not warm["problems"]
    assert warm["warm_compiles"] == warm["new_compiles"] == 0
    assert warm["from_cache"] == warm["graphs"] == len(report.graphs)
    assert warm["generate_compiles"] == 0
