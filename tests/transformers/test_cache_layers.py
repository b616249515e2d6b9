"""The bucketed static cache per layer kind: sliding-window, hybrid linear-attention, SSM, multi-latent,
sparse-indexed, multi-query and encoder-decoder models on hf_tpu's loop, token-identical to upstream's ``generate``
on CPU."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import generation
from hf_tpu.transformers._cache.static import bucketed_cache, static_cache_problem

# Eight prompt lengths in one bucket (16): each is padded on the left to it on the device; the CPU reference runs
# the prompt unpadded, so equality also proves that the padding leaves every layer's state as the prompt would.
LENGTHS = (1, 3, 5, 7, 9, 12, 14, 16)
NEW = 6
# Families whose graphs a second process then loads from the persistent compile cache (the list; Qwen3-MoE
# is in test_moe.py), compiling nothing.
SECOND_PROCESS = ("gemma4", "gpt_oss", "qwen3_5")


def _prompt(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "family",
    [
        "gemma3",  # sliding window (6 slots, shorter than the sequences) alternating with full attention
        "gemma4",  # sliding window + MoE (default experts), per-layer inputs, a wider full-attention head
        "gpt_oss",  # sliding window + MoE with attention sinks
        "qwen3_5",  # Gated DeltaNet linear attention + full attention
        "mamba2",  # SSM only: conv + recurrent state
        "recurrent_gemma",  # recurrent states kept on its modules (reset by the loop) + local attention
        "minimax",  # lightning attention states in MiniMax's own cache class + full attention + MoE
        "deepseek_v3",  # multi-latent attention (a compressed latent cached) + MoE with the default experts
        "deepseek_v32",  # multi-latent attention + a sparse-attention indexer caching keys of its own (top 4 kept)
        "falcon",  # multi-query: one KV head, where the config's static-cache shape says 4
        "bart",  # encoder-decoder with 4 encoder and 2 decoder heads
    ],
)
def test_each_layer_kind_runs_the_bucketed_loop_like_cpu(family, pair, model_root, tmp_path):
    cpu, tpu = pair(family)
    assert static_cache_problem(tpu) is None
    cache = tmp_path / "cache" if family in SECOND_PROCESS else False
    generation.configure(tpu, buckets=[16, 32], compile_cache=cache)  # every graph warm-up compiles is stored there
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
    generation.configure(tpu, compile_cache=False)
    if cache:
        from test_compile_cache import _worker

        # A fresh process warms up the same shapes from the cache.
        assert report.new_compiles == len(report.graphs) > 0 and not report.cache_problems
        warm = _worker(model_root / family, cache, "--batch=1", "--max-prompt-len=16", "--buckets=16,32")
        assert warm["equal"] and not warm["problems"]
        assert warm["warm_compiles"] == warm["new_compiles"] == warm["generate_compiles"] == 0
        assert warm["from_cache"] == warm["graphs"] == len(report.graphs)


def test_heavily_compressed_attention_runs_without_a_cache_and_says_why(pair, recwarn):
    """DeepSeek-V4's heavily compressed attention can have no bucketed static form (its one-token decode reads every
    compressed entry unmasked): generate names why and runs hf_tpu's loop without a cache, whose tokens are CPU's,
    over prompts long enough to emit compressed entries (one per 8 tokens, HCA; one per 4, CSA)."""
    cpu, tpu = pair("deepseek_v4")
    why = static_cache_problem(tpu)
    assert why.startswith("its cache has DeepseekV4HCACache layers (heavily_compressed_attention), which can have no")
    assert "decode step reads every compressed entry the layer returns, unmasked" in why
    assert why.endswith("DeepseekV4CSACache layers, which have no bucketed static form in hf_tpu yet")
    for seed, n in enumerate((5, 11)):
        ids = _prompt(n, seed, cpu.config.vocab_size)
        expected = cpu.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        assert torch.equal(got.cpu(), expected), (n, got, expected)
    assert s.compiles == 0  # the second prompt length, one bucket
    assert {key[0] for key in generation.compiled_graphs(tpu)} == {"cacheless_prefill", "cacheless_decode"}
    messages = [str(w.message) for w in recwarn]
    assert any("DeepseekV4HCACache layers" in m and "loop without a cache instead" in m for m in messages)


def test_a_looped_cache_layout_runs_upstream_with_its_reason_like_cpu(pair):
    """Dory's looped middle layers: the second loop writes to copies of their cache layers (at ``layer_idx +
    cache_offset``), which the forward appends when the cache holds only the model's layers. The probe sees the copies
    (and the bucketed cache can allocate them ahead), but it also counts the writes: more writes than layers, at
    indices outside them, is a layout hf_tpu's loops do not model (a tiny config with no input or output layers gave
    other tokens on hf_tpu's loop), so generate runs upstream's loop with that reason, token-identical to the CPU."""
    import warnings

    from hf_tpu.transformers import explain
    from hf_tpu.transformers._cache.probe import cache_shapes, layout_problem

    cpu, tpu = pair("dory")
    config = tpu.config
    shapes, _ = cache_shapes(tpu)
    looped = list(range(config.n_input_layers, config.num_hidden_layers - config.n_output_layers))
    assert [s.get("copy_of") for s in shapes[config.num_hidden_layers :]] == looped * (config.n_recurrent_loops - 1)
    layers = bucketed_cache(tpu, shapes, 1, 32).layers
    assert [type(la) for la in layers[config.num_hidden_layers :]] == [type(layers[i]) for i in looped]
    writes = config.num_hidden_layers + len(looped) * (config.n_recurrent_loops - 1)
    assert f"({writes} key/value writes), at layer indices outside them" in layout_problem(tpu)
    ids = _prompt(5, 0, config.vocab_size)
    kw = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": None}
    route = explain(tpu, input_ids=ids, **kw)
    assert route.loop == "upstream" and "does not model that layout" in route.reason
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="does not model that layout"):
        got = tpu.generate(ids, **kw)
    assert torch.equal(got, cpu.generate(ids, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (said once)
        for seed, n in enumerate((14, 9)):
            ids = _prompt(n, seed, config.vocab_size)
            assert torch.equal(tpu.generate(ids, **kw), cpu.generate(ids, **kw))
    assert not generation.compiled_graphs(tpu)


@pytest.mark.parametrize(
    "overrides",
    [
        # every layer looped, no input or output layer: the copies' layout gave other tokens on hf_tpu's loop
        {
            "n_input_layers": 0,
            "n_output_layers": 0,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
        # earlier loops read the last loop's keys through shared_kv_states: a cache changes the outputs, so the
        # loop without a cache (where the cached graph does not trace) would give other tokens
        {"recurrent_kv_cache_mode": "last_loop"},
    ],
    ids=["all_looped", "last_loop"],
)
def test_dory_greedy_on_the_tpu_with_hf_tpu_equals_cpu(overrides, from_config):
    import warnings

    from transformers import DoryForCausalLM

    from hf_tpu.testing import tiny_config
    from hf_tpu.transformers import explain

    cpu, tpu = from_config(DoryForCausalLM, tiny_config("dory", vocab_size=96, **overrides))
    kw = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the route says why)
        for seed, n in enumerate((5, 11)):
            ids = _prompt(n, seed, 96)
            assert torch.equal(tpu.generate(ids, **kw).cpu(), cpu.generate(ids, **kw)), n
    assert explain(tpu, input_ids=ids, **kw).loop == "upstream"
