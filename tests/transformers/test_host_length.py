"""Models whose own code reads their cache length as a number (``torch.arange(length, length + n)``, a branch on
``length > 0``) run hf_tpu's loop: after the first trace finds a data-dependent shape or branch, their cache reports
its length as a host int, which the decode graph takes as a dynamic size, so one graph serves every length."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import explain, generation


def _roformer(from_config):
    # RoFormer's sinusoidal positions: torch.arange(cache_length, cache_length + n) with the cache length as start
    from transformers import RoFormerConfig, RoFormerForCausalLM

    config = RoFormerConfig(
        vocab_size=96, embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, is_decoder=True,
    )  # fmt: skip
    return from_config(RoFormerForCausalLM, config)


def _git(from_config):
    # GIT branches on `cache_length > 0` (to widen the mask over cached image tokens)
    from transformers import GitConfig, GitForCausalLM

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 16}  # fmt: skip
    config = GitConfig(
        vision_config=vision, vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return from_config(GitForCausalLM, config)


def _trocr(from_config):
    # TrOCR's decoder numbers its tokens from its cache length (no position_ids: prompt first) with an arange
    from transformers import TrOCRConfig, TrOCRForCausalLM

    config = TrOCRConfig(
        vocab_size=96, d_model=32, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return from_config(TrOCRForCausalLM, config)


@pytest.mark.parametrize(
    "build", [_roformer, _git, _trocr], ids=["arange-from-length", "branch-on-length", "prompt-first-arange"]
)
def test_code_reading_the_cache_length_runs_the_loop_like_cpu(build, prompts, from_config):
    cpu, tpu = build(from_config)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    short, long = prompts([5])[0], prompts([7], seed=1)[0]  # two prompt lengths of one bucket
    assert torch.equal(tpu.generate(short, **kw), cpu.generate(short, **kw))
    route = explain(tpu)  # hf_tpu's loop with the length as a host int, not upstream's
    assert route.loop == "host_length" and "cannot be compiled as one static-shape graph" in route.reason
    with hf_tpu.sim.stats() as second:
        got = tpu.generate(long, **kw)
    assert torch.equal(got, cpu.generate(long, **kw))
    assert second.compiles == 0  # the decode graph took the length as a dynamic size: one graph for every length
    with hf_tpu.sim.stats() as two:
        tpu.generate(long, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with hf_tpu.sim.stats() as six:
        tpu.generate(long, **kw)
    assert (six.h2d_copies - two.h2d_copies) / 4 <= 1 and (six.d2h_copies - two.d2h_copies) / 4 <= 1


def test_warmup_switches_to_the_host_length_and_strict_generate_compiles_nothing(prompts, tmp_path, from_config):
    cpu, tpu = _roformer(from_config)
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="the persistent compile cache does not hold its graphs"):
        report = hf_tpu.warmup(
            tpu, max_prompt_len=8, batch_sizes=[1], max_new_tokens=6, progress=False, cache_dir=tmp_path
        )
    assert report.new_compiles >= 2 and generation.model_state(tpu).host_length
    generation.configure(tpu, strict=True)
    try:
        for n in (3, 8):
            ids = prompts([n], seed=n)[0]
            with hf_tpu.sim.stats() as s:
                got = tpu.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(got, cpu.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
            assert s.compiles == 0
    finally:
        generation.configure(tpu, strict=False)
