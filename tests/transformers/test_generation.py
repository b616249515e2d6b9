"""Generation on the simulated TPU against upstream ``generate`` on CPU, with the device counters."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import generation
from hf_tpu.transformers.buckets import BucketOverflowError


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gpt2", "t5"])
def test_greedy_matches_cpu_for_batched_prompts_of_different_lengths(family, pair, prompts, monkeypatch):
    from hf_tpu.transformers._loops import cached

    cpu, tpu = pair(family)
    ids, mask = prompts([5, 11])
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    ran, run = [], cached.run_graph

    def spy(model, state, key, *args):
        ran.append(str(key[0]))  # (a GraphKind: its text)
        return run(model, state, key, *args)

    monkeypatch.setattr(cached, "run_graph", spy)
    got = tpu.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert got.device.type == "cpu"  # back on the inputs' device
    assert torch.equal(got, expected)
    # this call ran the bucketed loop's graphs (not upstream's generate): one prefill, then a decode per new token
    assert ran[-6].endswith("prefill") and ran[-5:] == [ran[-1]] * 5 and ran[-1].endswith("decode"), ran


def test_inputs_on_the_device_come_back_on_the_device(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([7, 3])
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=4)
    got = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=4)
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), expected)


def test_compiles_are_bounded_by_the_buckets_touched(pair, prompts):
    cpu, tpu = pair("qwen3")
    generation.configure(tpu, buckets=[16, 32, 64])
    batches = [(1, 3), (9, 14), (16, 5), (17, 2), (25, 31), (7, 12)]  # 11 distinct lengths in two buckets
    with hf_tpu.sim.stats() as s:
        for seed, lengths in enumerate(batches):
            ids, mask = prompts(list(lengths), seed=seed)
            got = tpu.generate(ids, attention_mask=mask, max_new_tokens=4)
            assert torch.equal(got, cpu.generate(ids, attention_mask=mask, max_new_tokens=4))
    graphs = set(generation.compiled_graphs(tpu))
    # Prompt buckets 16 and 32, each with one cache bucket: one prefill and one decode graph per bucket, at most.
    assert {k for k in graphs if k[0] == "prefill"} == {("prefill", 2, 16, 32), ("prefill", 2, 32, 64)}
    assert s.compiles <= 4


def test_warmup_then_no_compiles_and_strict_names_the_shape(pair, prompts, monkeypatch):
    cpu, tpu = pair("gemma")
    generation.configure(tpu, buckets=[16, 32, 64, 128])
    report = hf_tpu.warmup(tpu, max_prompt_len=30, batch_sizes=[2], max_new_tokens=8, progress=False)
    assert report.prompt_buckets == (16, 32)
    assert ("decode", 2, 32) in report.graphs and ("prefill", 2, 32, 64) in report.graphs
    with hf_tpu.sim.stats() as s:
        for lengths in ((2, 13), (16, 21), (30, 1)):
            ids, mask = prompts(list(lengths))
            got = tpu.generate(ids, attention_mask=mask, max_new_tokens=8)
            assert torch.equal(got, cpu.generate(ids, attention_mask=mask, max_new_tokens=8))
        # a shorter generation reuses the warmed cache bucket instead of compiling a smaller one
        ids, mask = prompts([4, 4])
        tpu.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert s.compiles == 0

    monkeypatch.setenv(generation.STRICT_ENV, "1")
    with pytest.raises(generation.RecompileError, match=r"prefill graph for batch=1, prompt bucket=16"):
        tpu.generate(prompts([5])[0], max_new_tokens=8)
    monkeypatch.delenv(generation.STRICT_ENV)
    generation.configure(tpu, strict=True)
    try:
        with pytest.raises(generation.RecompileError, match="warm-up did not compile"):
            tpu.generate(ids, attention_mask=mask, max_new_tokens=100)  # a larger cache bucket
        tpu.generate(ids, attention_mask=mask, max_new_tokens=8)  # warmed: fine in strict mode
    finally:
        generation.configure(tpu, strict=False)


def test_a_second_strict_warmup_compiles_the_shapes_it_adds(llama, prompts):
    _, tpu = llama
    try:
        hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[1], max_new_tokens=4, strict=True, progress=False)
        # strict mode refuses a new graph in generate, but not in a later warm-up that adds it
        hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[3], max_new_tokens=4, strict=True, progress=False)
        ids, mask = prompts([5, 7, 9])
        with hf_tpu.sim.stats() as s:
            tpu.generate(ids, attention_mask=mask, max_new_tokens=4)
        assert s.compiles == 0
        with pytest.raises(generation.RecompileError, match="warm-up did not compile"):
            ids, mask = prompts([5, 7, 9, 11])
            tpu.generate(ids, attention_mask=mask, max_new_tokens=4)  # batch 4 was never warmed
    finally:
        generation.configure(tpu, strict=False)


@pytest.mark.parametrize("do_sample", [False, True])
def test_at_most_one_small_copy_each_way_per_decode_step(llama, prompts, do_sample):
    _, tpu = llama
    ids, mask = prompts([6, 9])

    def run(new_tokens):
        torch.manual_seed(0)
        with hf_tpu.sim.stats() as s:
            out = tpu.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=do_sample, eos_token_id=None
            )
        assert out.shape[1] == ids.shape[1] + new_tokens
        return s

    run(12)  # compile first
    short, long = run(2), run(12)
    steps = 10
    assert (long.h2d_copies - short.h2d_copies) / steps <= 1
    assert (long.d2h_copies - short.d2h_copies) / steps <= 1
    assert (long.host_syncs - short.host_syncs) / steps <= 1
    assert long.compiles == 0 and long.shape_signatures == 0
    if not do_sample:  # greedy: only the chosen tokens come back, not the logits
        assert (long.d2h_bytes - short.d2h_bytes) / steps <= 2 * 8


def test_repetition_penalty_runs_on_the_device_and_matches_cpu(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([6, 9])
    kwargs = {"attention_mask": mask, "repetition_penalty": 1.3, "eos_token_id": None}
    assert torch.equal(tpu.generate(ids, max_new_tokens=12, **kwargs), cpu.generate(ids, max_new_tokens=12, **kwargs))
    assert ("decode+repetition_penalty", 2, 32) in generation.compiled_graphs(tpu)
    with hf_tpu.sim.stats() as short:
        tpu.generate(ids, max_new_tokens=2, **kwargs)
    with hf_tpu.sim.stats() as long:
        tpu.generate(ids, max_new_tokens=12, **kwargs)
    assert (long.d2h_bytes - short.d2h_bytes) / 10 <= 2 * 8  # the tokens come back, not the logits
    assert (long.h2d_copies - short.h2d_copies) / 10 <= 1


def test_sampling_is_reproducible_with_a_seed(llama, prompts):
    _, tpu = llama
    ids, mask = prompts([4, 7])
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": True, "top_k": 20, "temperature": 0.9}
    runs = []
    for seed in (1234, 1234, 99):
        torch.manual_seed(seed)
        runs.append(tpu.generate(ids, **kwargs))
    assert torch.equal(runs[0], runs[1])  # the device generator, seeded by torch.manual_seed, draws inside the graph
    assert not torch.equal(runs[0], runs[2])


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_what_upstream_streams(llama, prompts):
    cpu, tpu = llama
    ids, _ = prompts([5, 5])
    a, b = _Collect(), _Collect()
    expected = cpu.generate(ids, max_new_tokens=5, streamer=a)
    got = tpu.generate(ids, max_new_tokens=5, streamer=b)
    assert torch.equal(got, expected)
    assert b.chunks == a.chunks and b.ended


def test_eos_max_length_and_custom_stopping_criteria_as_upstream(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([4, 8])
    free = cpu.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 2])  # a token the first row emits at its third step
    for kwargs in (
        {"max_new_tokens": 8, "eos_token_id": eos},  # row 0 stops early and is padded while row 1 goes on
        {"max_length": ids.shape[1] + 3},
    ):
        assert torch.equal(
            tpu.generate(ids, attention_mask=mask, **kwargs), cpu.generate(ids, attention_mask=mask, **kwargs)
        )

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 12, dtype=torch.bool)

    stop = StoppingCriteriaList([StopAt()])
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=16, stopping_criteria=stop)
    got = tpu.generate(ids, attention_mask=mask, max_new_tokens=16, stopping_criteria=stop)
    assert got.shape[1] == 12 and torch.equal(got, expected)


def test_return_dict_with_scores(llama, prompts):
    cpu, tpu = llama
    ids, mask = prompts([6, 2])
    kwargs = {"attention_mask": mask, "max_new_tokens": 3, "return_dict_in_generate": True, "output_scores": True}
    expected, got = cpu.generate(ids, **kwargs), tpu.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == 3
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))


def test_bad_inputs_get_clear_messages(llama, prompts):
    _, tpu = llama
    limit = generation.plan_shapes(tpu, 1, 1, 1)  # the default ladder ends at max_position_embeddings
    ladder_max = generation.model_state(tpu).settings.buckets.max
    assert limit.prompt_bucket == 16
    long_prompt = torch.randint(3, tpu.config.vocab_size, (1, ladder_max + 1))
    with pytest.raises(BucketOverflowError, match=rf"the prompt is {ladder_max + 1} tokens, past the largest bucket"):
        tpu.generate(long_prompt, max_new_tokens=2)
    with pytest.raises(BucketOverflowError, match="plus max_new_tokens"):
        tpu.generate(torch.randint(3, tpu.config.vocab_size, (1, 10)), max_new_tokens=ladder_max)


def test_dynamic_cache_and_beam_search_with_host_criteria_warn_and_run_upstream(llama, prompts):
    cpu, tpu = llama
    ids, _ = prompts([5])
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="every decode step has a new shape and compiles"):
        got = tpu.generate(ids, max_new_tokens=3, cache_implementation="dynamic")
    assert torch.equal(got, cpu.generate(ids, max_new_tokens=3))
    # beam search runs hf_tpu's beam loop (tests/transformers/test_beam_search.py), but not with stopping criteria
    # that the host must ask
    stop = StoppingCriteriaList([_NeverStop()])
    with pytest.warns(UserWarning, match="stopping_criteria of your own"):
        got = tpu.generate(ids, max_new_tokens=3, num_beams=2, stopping_criteria=stop)
    assert torch.equal(got, cpu.generate(ids, max_new_tokens=3, num_beams=2, stopping_criteria=stop))


class _NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_decoder_numbering_tokens_by_its_cache_length_gets_its_prompt_first(prompts):
    # BartForCausalLM takes no position_ids and numbers its tokens from the cache length: left padding would shift
    # its learned positions, so the loop puts the prompt first and the bucket's padding after it
    from transformers import BartConfig, BartForCausalLM

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=96, d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=64,
        forced_eos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    cpu = BartForCausalLM(config).eval()
    tpu = BartForCausalLM(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 1}
    for lengths in ([4, 7], [9, 12]):  # the user's own left padding is kept as upstream keeps it
        ids, mask = prompts(lengths)
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(ids, attention_mask=mask, **kwargs)
        assert torch.equal(got, cpu.generate(ids, attention_mask=mask, **kwargs))
    assert s.compiles == 0  # one prompt bucket: the second length compiles nothing
    assert set(generation.compiled_graphs(tpu)) == {("prefill", 2, 16, 32), ("decode", 2, 32)}
    kwargs["repetition_penalty"] = 1.3  # the device history starts at the prompt's first slot
    got = tpu.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, cpu.generate(ids, attention_mask=mask, **kwargs))


def test_a_decoder_numbering_tokens_by_its_cache_length_with_a_sliding_window_runs_without_a_cache():
    # a window would take in the padding after the prompt: the loop without a cache, with the reason
    from transformers import BartConfig, BartForCausalLM

    from hf_tpu.transformers import explain

    config = BartConfig(
        vocab_size=96, d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    config.layer_types = ["sliding_attention"]
    config.sliding_window = 8
    model = BartForCausalLM(config).eval().to("tpu")
    route = explain(model, input_ids=torch.ones(1, 3, dtype=torch.long))
    assert route.loop == "cacheless" and "StaticSlidingWindowLayer layers cannot hold" in route.reason


def test_disable_restores_upstream_generate():
    from transformers.generation.utils import GenerationMixin

    patched = GenerationMixin.generate
    assert hasattr(patched, "__hf_tpu_upstream__")
    hf_tpu.disable("generation")
    try:
        assert GenerationMixin.generate is patched.__hf_tpu_upstream__
    finally:
        hf_tpu.enable("generation")
    assert GenerationMixin.generate.__hf_tpu_upstream__ is patched.__hf_tpu_upstream__
