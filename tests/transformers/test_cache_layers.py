"""The bucketed static cache per layer kind: sliding-window, hybrid linear-attention, SSM, multi-latent,
multi-query and encoder-decoder models on hf_tpu's loop, token-identical to upstream's ``generate`` on CPU."""

from __future__ import annotations

import pytest
import torch
import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import generation
from hf_tpu.transformers._static_cache import _static_cache_problem

# Eight prompt lengths in one bucket (16): each is padded on the left to it on the device; the CPU reference runs
# the prompt unpadded, so equality also proves that the padding leaves every layer's state as the prompt would.
LENGTHS = (1, 3, 5, 7, 9, 12, 14, 16)
NEW = 6


def _prompt(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "family",
    [
        "gemma3",  # sliding window (6 slots, shorter than the sequences) alternating with full attention
        "qwen3_5",  # Gated DeltaNet linear attention + full attention
        "mamba2",  # SSM only: conv + recurrent state
        "deepseek_v3",  # multi-latent attention (a compressed latent cached) + MoE with the default experts
        "falcon",  # multi-query: one KV head, where the config's static-cache shape says 4
        "bart",  # encoder-decoder with 4 encoder and 2 decoder heads
    ],
)
def test_each_layer_kind_runs_the_bucketed_loop_like_cpu(family, pair):
    cpu, tpu = pair(family)
    assert _static_cache_problem(tpu) is None
    generation.configure(tpu, buckets=[16, 32])
    report = hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[1], max_new_tokens=NEW, progress=False)
    assert report.prompt_buckets == (16,)
    signatures = []
    for seed, n in enumerate(LENGTHS):
        ids = _prompt(n, seed, cpu.config.get_text_config(decoder=True).vocab_size)
        expected = cpu.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        assert torch.equal(got, expected), (n, got, expected)
        assert s.compiles == 0, n
        signatures.append(s.shape_signatures)
        steps = got.shape[1] - ids.shape[1] - 1 if not cpu.config.is_encoder_decoder else got.shape[1] - 2
        assert s.d2h_copies <= steps + 2 and s.h2d_copies <= steps + 4, (n, s)  # one small copy each way per step
    assert max(signatures[1:]) <= 4, signatures  # a new prompt length meets (almost) no new eager op
    assert generation.compiled_graphs(tpu)  # hf_tpu's loop ran, not upstream's


def test_a_hybrid_model_is_served_from_the_compile_cache_in_a_second_process(tmp_path):
    import transformers as T
    from test_compile_cache import _worker

    from hf_tpu.testing import tiny_config

    torch.manual_seed(0)
    model_dir = tmp_path / "qwen3_5"
    config = tiny_config("qwen3_5", vocab_size=96)  # the worker draws ids below 96
    T.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    cold = _worker(model_dir, tmp_path / "cache")
    assert cold["equal"] and not cold["problems"] and cold["new_compiles"] == cold["graphs"] > 0
    warm = _worker(model_dir, tmp_path / "cache")
    assert warm["equal"] and not warm["problems"]
    assert warm["warm_compiles"] == warm["new_compiles"] == warm["generate_compiles"] == 0
    assert warm["from_cache"] == warm["graphs"] == cold["graphs"]
