"""Which tests form the slow tier: one place, with the reason for each group.

The README's test command runs the *core* tier: every capability's representative tests, CPU references included,
in about 10 minutes on an idle 2-core host. A test slow by nature joins the *slow* tier, which ``.ci/run`` runs as a
step of its own (``python -m pytest -n 2 -m slow tests``); nothing is dropped. A test can also carry
``@pytest.mark.slow`` itself (a new family's test does, unless it is the only test of its path); this table holds the
tests that were moved, so that the move is one reviewable list. ``tests/test_testing.py`` checks that every entry
still names collected tests.

Each entry is ``(node id prefix, reason)``: a module (``tests/x.py``), a test with all its parameters
(``tests/x.py::test_a``), or parameters (``tests/x.py::test_a[p]``; a prefix inside the brackets,
``tests/x.py::test_a[p-``, takes every parameter that starts so).
"""

from __future__ import annotations

#: (node id prefix, why it is slow and what stays in the core tier instead)
SLOW: list[tuple[str, str]] = []


def _slow(module: str, reason: str, *tests: str) -> None:
    SLOW.extend((f"tests/{module}::{test}" if test else f"tests/{module}", reason) for test in tests or ("",))


_slow(
    "transformers/test_vision_generate.py",
    "per-family image loop beyond the representatives (core: llava, qwen2_vl, idefics3, lfm3_vl)",
    "test_greedy_with_images_equals_cpu_from_host_pixels[gemma3]",
    "test_greedy_with_images_equals_cpu_from_host_pixels[qwen2_5_vl]",
    "test_greedy_with_images_equals_cpu_from_host_pixels[exaone4_5]",
    "test_greedy_with_images_equals_cpu_from_host_pixels[hyperclovax_vision_v2]",
    "test_greedy_with_images_equals_cpu_from_host_pixels[mistral3]",
)
_slow(
    "transformers/test_vision_generate.py",
    "per-family warm-up beyond the representatives (core: llava, qwen2_vl, idefics3, lfm3_vl)",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[gemma3]",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[qwen2_5_vl]",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[exaone4_5]",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[hyperclovax_vision_v2]",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[mistral3]",
)
_slow(
    "transformers/test_vision_generate.py",
    "per-family copies beyond the representatives (core: llava, qwen2_vl, idefics3, lfm3_vl)",
    "test_one_small_copy_each_way_per_decode_step_with_images[gemma3]",
    "test_one_small_copy_each_way_per_decode_step_with_images[qwen2_5_vl]",
    "test_one_small_copy_each_way_per_decode_step_with_images[exaone4_5]",
    "test_one_small_copy_each_way_per_decode_step_with_images[hyperclovax_vision_v2]",
    "test_one_small_copy_each_way_per_decode_step_with_images[mistral3]",
)
_slow(
    "transformers/test_vision_generate.py",
    "per-family warm-up check beyond the representatives (the families of the other moved tests)",
    "test_warmup_of_images_says_what_it_cannot_warm[gemma3]",
    "test_warmup_of_images_says_what_it_cannot_warm[qwen2_5_vl]",
    "test_warmup_of_images_says_what_it_cannot_warm[exaone4_5]",
    "test_warmup_of_images_says_what_it_cannot_warm[hyperclovax_vision_v2]",
    "test_warmup_of_images_says_what_it_cannot_warm[mistral3]",
)
_slow(
    "transformers/test_vision_generate.py",
    "the grid path's second family (core: qwen2_vl)",
    "test_grid_model_text_and_untyped_calls_equal_cpu_on_the_cached_loop[qwen2_5_vl]",
)
_slow(
    "transformers/test_vision_generate.py",
    "per-family warm-up of image counts (core: llava)",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[gemma3]",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[idefics3]",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[lfm3_vl]",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[mistral3]",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[qwen2_5_vl]",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[qwen2_vl]",
)
_slow(
    "transformers/test_vision_generate.py",
    "the positioned path's second family (core: gemma4)",
    "test_gemma4_images_run_the_cached_loop_equal_cpu_and_another_count_and_size_compile_nothing[gemma4_unified]",
)
_slow(
    "transformers/test_vision_generate.py",
    "the padded path's second family (core: idefics2)",
    "test_padded_images_drop_on_the_host_equal_cpu_read_nothing_and_warmed_calls_compile_nothing[smolvlm]",
)
_slow(
    "transformers/test_vision_generate.py",
    "per-family host-read check (core: llava)",
    "test_image_prefill_reads_nothing_on_the_host_and_the_image_tokens_are_checked_there[gemma3]",
    "test_image_prefill_reads_nothing_on_the_host_and_the_image_tokens_are_checked_there[qwen2_vl]",
)
_slow(
    "transformers/test_vlm_sweep.py",
    "the image-text-to-text sweep's slice (the PaliGemma row alone took 199 s in CI); the sweep runs whole as a "
    "benchmark",
    "test_slice_verdicts_match_cpu_and_the_docs",
)
_slow(
    "transformers/test_arch_sweep.py",
    "the causal-LM sweep's slice; each layer kind is in the core tier through test_cache_layers",
    "test_slice_verdicts_match_cpu_and_the_docs",
)
_slow(
    "transformers/test_cache_layers.py",
    "a layer kind's second family (core: gemma3 sliding, qwen3_5 linear, mamba2 SSM, deepseek_v3 MLA, bart "
    "seq2seq)",
    "test_each_layer_kind_runs_the_bucketed_loop_like_cpu[gemma4]",
    "test_each_layer_kind_runs_the_bucketed_loop_like_cpu[gpt_oss]",
    "test_each_layer_kind_runs_the_bucketed_loop_like_cpu[recurrent_gemma]",
    "test_each_layer_kind_runs_the_bucketed_loop_like_cpu[minimax]",
    "test_each_layer_kind_runs_the_bucketed_loop_like_cpu[deepseek_v32]",
    "test_each_layer_kind_runs_the_bucketed_loop_like_cpu[falcon]",
)
_slow(
    "distributed/test_tensor_parallel.py",
    "a launch of 4 ranks (core: test_tp2_matches_tp1)",
    "test_tp4_matches_tp1_with_plan_fixes",
)
_slow(
    "distributed/test_torch_tpu_launch_recipe.py",
    "a launch of 4 ranks",
    "test_the_torch_tpu_launch_recipe_runs_tp4_generate_on_four_simulated_chips",
)
_slow(
    "training/test_fsdp.py",
    "a launch of 4 ranks (core: llama and mixtral on 2)",
    "test_trainer_fsdp2_equals_one_process_on_the_whole_batch[llama-4]",
)
_slow(
    "training/test_fsdp.py",
    "a launch of 4 ranks then 2",
    "test_sharded_checkpoint_of_4_ranks_resumes_on_2_and_exports_a_plain_model",
)
_slow(
    "diffusers/test_minimax_h3_tp.py",
    "a launch of 4 ranks (core: Flux on 2)",
    "test_minimax_h3_tp4_equals_tp1",
)
_slow(
    "diffusers/test_qwen_image_tp.py",
    "a launch of 4 ranks (core: Flux on 2)",
    "test_qwen_image_21_tp4_equals_tp1",
)
_slow(
    "cli/test_bench.py",
    "a benchmark's quick run as a process",
    "test_generate_quick_buckets_compile_no_more_than_upstream",
)
_slow(
    "cli/test_bench.py",
    "two benchmarks' quick runs as a process",
    "test_quick_runs_end_to_end_with_consistent_json",
)
_slow(
    "kernels/test_ragged_dot.py",
    "the XLA tile sweep's random and one-group layouts (core: the tail layout at every tile size)",
    "test_xla_tiled_every_tile_size[random-",
    "test_xla_tiled_every_tile_size[one_group-",
)
_slow(
    "kernels/test_ragged_dot.py",
    "Pallas interpret-mode cases beyond one (core: 37x64x128x8-tail-True; interpret mode runs the grid in Python)",
    "test_pallas_kernel_interpret_matches_float64[1x32x64x4-random-False]",
    "test_pallas_kernel_interpret_matches_float64[1x32x64x4-one_group-True]",
    "test_pallas_kernel_interpret_matches_float64[64x16x24x64-random-True]",
    "test_pallas_kernel_interpret_matches_float64[200x32x256x5-one_group-False]",
)
_slow(
    "cli/test_bench.py",
    "a benchmark's quick run: two processes sharing a compile cache (core: "
    "tests/transformers/test_compile_cache.py)",
    "test_compile_cache_quick_figures_are_consistent",
)
_slow(
    "test_selftest.py",
    "the whole `hf-tpu selftest` as a process (each check's capability has core tests)",
    "test_selftest_passes_on_the_simulated_device",
)
_slow(
    "docs/test_docs.py",
    "a page whose python blocks load, warm up and run several models (the README's and the other pages' blocks stay "
    "in the core tier)",
    "test_python_blocks_run[docs/training.md]",
    "test_python_blocks_run[docs/serving.md]",
    "test_python_blocks_run[docs/encoders.md]",
)
_slow("ray/test_serve_arguments.py", "needs Ray (the [ray] extra), which .ci/run installs for the slow tier")


def slow_prefix(nodeid: str) -> str | None:
    """The entry of :data:`SLOW` that ``nodeid`` falls under, or None."""
    for prefix, _ in SLOW:
        if nodeid == prefix or (nodeid.startswith(prefix) and ("[" in prefix or nodeid[len(prefix)] in "[:")):
            return prefix
    return None


def mark_slow(items) -> None:
    """Add the ``slow`` marker to the items :data:`SLOW` names. An entry whose module was collected but which names
    none of its tests (a test renamed or removed) is an error, so that the table cannot go stale."""
    import pytest

    used = set()
    for item in items:
        prefix = slow_prefix(item.nodeid)
        if prefix is not None:
            item.add_marker(pytest.mark.slow)
            used.add(prefix)
    modules = {item.nodeid.split("::", 1)[0] for item in items}
    stale = [p for p, _ in SLOW if p not in used and p.split("::", 1)[0] in modules]
    if stale:
        raise pytest.UsageError(f"tests/_tiers.py names tests that were not collected: {stale}; update SLOW")
