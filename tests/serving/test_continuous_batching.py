"""``generate_batch`` and the continuous-batching manager on the simulated TPU against CPU greedy ``generate``."""

from __future__ import annotations

import transformers as T
from _timeouts import SAFETY_TIMEOUT_S
from conftest import cpu_greedy, random_prompts

import hf_tpu.sim
from hf_tpu import serving
from hf_tpu.serving.kv_sizing import kv_cache_plan
from hf_tpu.serving.ladder import StepLadder

NEW = 6


def _config():
    return T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_generate_batch_matches_cpu_greedy_with_static_step_shapes(pair):
    cpu, tpu = pair
    prompts = random_prompts([5, 17, 33, 60, 9, 12, 41, 2])
    out = tpu.generate_batch(prompts, generation_config=_config(), progress_bar=False, persistent_manager=True)
    try:
        for i, prompt in enumerate(prompts):
            assert out[f"req_{i}"].generated_tokens == cpu_greedy(cpu, prompt, NEW), f"prompt {i}"
        manager = tpu._cached_continuous_batching_manager
        runner = manager.batch_processor.model_runner
        ladder = runner._hf_tpu_ladder
        assert ladder == StepLadder((32,), (0, 64, 1024))
        assert serving.compiled_shapes(tpu) <= set(ladder.shapes)  # every step ran on a rung pair
        # The paged cache is sized for 4 requests of the model's length, not from the host's RAM.
        cache = runner.cache
        config = tpu.config
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
        assert cache.num_blocks * 64 == 4 * config.max_position_embeddings
        assert cache.cache_tensor.numel() <= (cache.num_blocks + 2 * 8) * 64 * per_token
        assert cache.cache_tensor.numel() < 2**22
        # After warm-up, a new mix of lengths compiles nothing (the step inputs go over in one copy of one shape:
        # docs/serving.md, "Step inputs: one host->device copy per step").
        prompts = random_prompts([3, 29, 8, 50, 14], seed=1)
        with hf_tpu.sim.stats() as s:
            out = tpu.generate_batch(prompts, generation_config=_config(), progress_bar=False, warmup=False)
        results = sorted(out.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[1]))  # ids go on from req_8
        for prompt, result in zip(prompts, results, strict=True):
            assert result.generated_tokens == cpu_greedy(cpu, prompt, NEW), f"prompt of {len(prompt)} tokens"
        assert s.compiles == 0
    finally:
        tpu.destroy_cached_continuous_batching_manager()


def test_kv_sizing_rule_and_cap():
    common = {"layers": 4, "kv_heads": 2, "head_dim": 32, "itemsize": 4, "max_len": 256, "page_size": 256}
    plan = kv_cache_plan(**common, slots=32, free_hbm=16 * 2**30)
    assert plan.tokens == 32 * 256 and plan.bytes == 32 * 256 * 2 * 4 * 2 * 32 * 4
    capped = kv_cache_plan(**common, slots=32, free_hbm=16 * 2**30, cap_bytes=2**20)
    assert capped.bytes <= 2**20 + plan.page_size * plan.bytes_per_token and "cap" in capped.why
    tiny_chip = kv_cache_plan(**common, slots=32, free_hbm=2**22)  # half of 4 MiB: 1024 tokens
    assert tiny_chip.tokens == 1024
    try:
        kv_cache_plan(**common, slots=1, free_hbm=2**30, cap_bytes=1024)
    except ValueError as exc:
        assert "HF_TPU_KV_CACHE_GIB" in str(exc)
    else:
        raise AssertionError("a cap below one full-length request must be refused")


def test_step_ladder_pads_up_and_names_an_overflow():
    ladder = StepLadder.build(max_batch_tokens=256, max_kv_tokens=8192, page_size=256)
    assert ladder.pad(1, 0) == (16, 0) and ladder.pad(65, 4097) == (256, 8192)
    try:
        ladder.pad(257, 0)
    except ValueError as exc:
        assert "257 query tokens" in str(exc)
    else:
        raise AssertionError("a step past the largest rung must be refused")


def test_a_request_the_step_cannot_hold_fails_alone_and_the_batch_goes_on(pair):
    """A request whose settings do not fit the step's int32/float32 rows (here: top_k 2**31, past the door's check)
    fails as it joins the batch; the requests around it get CPU's tokens and the worker lives (issue 64: such a
    request used to kill the continuous-batching loop for good)."""
    cpu, tpu = pair
    prompts = random_prompts([7, 19, 4], seed=3)
    cb = tpu.init_continuous_batching(generation_config=_config())
    cb.start()
    try:
        cb.add_request(prompts[0], request_id="good_0", max_new_tokens=NEW)
        cb.add_request(prompts[1], request_id="bad", max_new_tokens=NEW, top_k=2**31, temperature=1.0)
        cb.add_request(prompts[2], request_id="good_1", max_new_tokens=NEW)
        got = {}
        while len(got) < 3:
            out = cb.get_result(timeout=SAFETY_TIMEOUT_S)
            assert out is not None, "the manager stopped answering"
            if out.is_finished():
                got[out.request_id] = out
        assert got["bad"].error is not None and "int32" in str(got["bad"].error)
        assert got["good_0"].generated_tokens == cpu_greedy(cpu, prompts[0], NEW)
        assert got["good_1"].generated_tokens == cpu_greedy(cpu, prompts[2], NEW)
        assert cb.is_running() and cb.background_thread_status.fatal_error is None
    finally:
        cb.stop(block=True)
        tpu.destroy_cached_continuous_batching_manager()
