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

The *sweep* (:data:`SWEEP`, marker ``sweep``) holds the expansions of a check beyond the representatives CI keeps:
more families of one path, a second process where one already runs in CI, an example whose page already runs. CI's
whole run (``.ci/run``: the core, oldest, slow and contract tiers) has a 25-minute budget on its 2-core host, and on
2026-12-07 it took 29; these tests are what left it. ``.ci/run --sweep`` runs them after the other steps
(``python -m pytest -n 2 --dist loadgroup -m sweep tests`` in ``.venv`` with the [ray] extra does the same), and each
entry names what checks the same thing inside CI's run, or the benchmark that covers every family
(``hf-tpu bench vlm_sweep``). A test named in both tables is in the sweep.
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
    "per-family warm-up of image counts (core: the same warm-up in the gemma4 and idefics2 path tests)",
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
    "a launch of 4 ranks (core: llama on 2)",
    "test_trainer_fsdp2_equals_one_process_on_the_whole_batch[llama-4]",
)
_slow(
    "training/test_fsdp.py",
    "a launch of 4 ranks then 2",
    "test_sharded_checkpoint_of_4_ranks_resumes_on_2_and_exports_a_plain_model",
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
# Moved on 2026-12-05 to bring the core tier toward its 10 minutes (it took 1,435 s on an idle 2-core host with
# 1,201 tests); the figures are each test's seconds in that run (JUnit, two workers).
_slow(
    "test_examples.py",
    "an example as a process beyond one (core: simulator_counters.py; each example's APIs have core tests of their own)",
    "test_example_runs_on_the_simulator[generate.py]",  # 44 s
    "test_example_runs_on_the_simulator[encoders.py]",  # 40 s
    "test_example_runs_on_the_simulator[finetune.py]",  # 21 s
    "test_example_runs_on_the_simulator[diffusers_sd3.py]",  # 20 s
    "test_example_runs_on_the_simulator[moe_kernel.py]",  # 16 s
    "test_example_runs_on_the_simulator[device_map.py]",  # 11 s
)
_slow(
    "test_examples.py",
    "a launch of 2 ranks running the example, docs/first_hour.md's command (core: "
    "tests/distributed/test_tensor_parallel.py::test_tp2_matches_tp1)",
    "test_tensor_parallel_example_runs_on_two_simulated_chips",  # 27 s
)
_slow(
    "distributed/test_tensor_parallel.py",
    "a 2-D mesh of 4 ranks, read from the launch of 4 ranks above (core: test_tp2_matches_tp1)",
    "test_tp_over_the_tp_dimension_of_a_2d_mesh",
)
_slow(
    "distributed/test_multihost.py",
    "launches of two simulated hosts (core: tests/distributed/test_launch.py, one host)",
    "test_two_hosts_form_one_run_equal_to_one_host",  # 21 s
    "test_a_dead_host_ends_the_other",  # 11 s
)
_slow(
    "serving/test_serving_tensor_parallel.py",
    "a server on 2 launched ranks (core: tensor parallel in tests/distributed, serving in tests/serving/test_server.py)",
    "test_tp2_server_answers_equal_cpu_greedy_and_sigterm_ends_every_rank",  # 36 s
)
_slow(
    "diffusers/test_diffusers_tp.py",
    "a launch of 2 ranks of a pipeline (core: tensor parallel in tests/distributed, diffusers in tests/diffusers)",
    "test_flux_tp2_image_equals_tp1",  # 19 s
)
_slow(
    "training/test_data_parallel.py",
    "the Trainer's own launch of 2 ranks (core: hf_tpu's helpers and DDP)",
    "test_two_chips_equal_one_chip_with_the_doubled_batch[trainer]",  # 21 s
)
_slow(
    "training/test_fsdp.py",
    "further launches of 2 ranks (core: the Trainer's FSDP2 on llama)",
    "test_trainer_fsdp2_equals_one_process_on_the_whole_batch[mixtral-2]",  # 34 s
    "test_accelerator_loop_with_the_fsdp2_plugin_equals_one_process",  # 24 s
    "test_bf16_and_activation_checkpointing",  # 21 s
    "test_cpu_offload_is_refused_with_the_fix",  # 18 s
)
_slow(
    "sim/test_opinfo.py",
    "PyTorch's OpInfo samples in worker processes (core: the simulator's own op and model tests in tests/sim)",
    "test_opinfo_float32_matches_cpu_or_is_refused_as_on_a_chip",  # 53 s
)
_slow(
    "sim/test_native.py",
    "the device tests again on the Python path, and both paths side by side (core: the native path runs every test)",
    "test_python_path_passes_the_device_tests",  # 31 s
    "test_python_and_native_paths_agree",  # 29 s
)
_slow(
    "transformers/test_transformers_suite_script.py",
    "a run of transformers' own tests through hf_tpu (core: the tree script's test)",
    "test_the_hf_tpu_run_counts_the_tests_its_loop_served",  # 40 s
)
_slow(
    "serving/test_serve_soak.py",
    "a load, however short (core: tests/serving/test_server.py's mixed load)",
    "test_a_short_soak_loses_nothing_compiles_nothing_and_keeps_the_queue_bounded",  # 39 s
)
_slow(
    "serving/test_serving_compile_cache.py",
    "a second process on the compile cache, for the step graphs (core: "
    "tests/transformers/test_compile_cache.py's second process)",
    "test_a_second_process_loads_every_step_graph_and_compiles_nothing",  # 34 s
    "test_hf_tpu_serve_stores_its_step_graphs_and_a_second_server_compiles_none",  # two servers
)
_slow(
    "transformers/test_beam_search.py",
    "a second process on the compile cache, for the beam graphs (core: "
    "tests/transformers/test_compile_cache.py's second process)",
    "test_beam_graphs_come_from_the_persistent_compile_cache_in_a_new_process",  # 25 s
)
_slow(
    "cli/test_warmup_command.py",
    "`hf-tpu warmup` twice as processes (core: tests/transformers/test_compile_cache.py's second process)",
    "test_second_run_compiles_nothing",  # 26 s
)
_slow(
    "transformers/test_moe.py",
    "the MoE bucket warm-up a second time, with the ragged-dot kernel (core: grouped_mm in one process; the kernel in "
    "tests/kernels)",
    "test_moe_fast_path_bucket_warmup_and_compile_cache[ragged_dot_tpu]",  # 42 s
)
_slow(
    "docs/test_docs.py",
    "a page's command that runs a whole CLI process (core: the commands' own tests in tests/cli and tests/diffusers)",
    "test_commands_print_what_the_page_shows[docs/first_hour.md:39]",  # hf-tpu generate, 22 s
    "test_commands_print_what_the_page_shows[docs/first_hour.md:82]",  # hf-tpu diffuse, 19 s
    "test_commands_print_what_the_page_shows[docs/first_hour.md:160]",  # hf-tpu bench sim_forward, 11 s
)
_slow(
    "encoders/test_encoders.py",
    "an encoder family beyond BERT, per head (core: bert with each head)",
    *(f"test_model_call_equals_cpu_for_each_family_and_head[{head}-{family}]"
      for head in ("AutoModel", "AutoModelForSequenceClassification", "AutoModelForTokenClassification")
      for family in ("xlm-roberta", "modernbert", "distilbert", "electra", "deberta-v2", "mpnet")),  # 50 s
)
_slow(
    "encoders/test_encoders.py",
    "encoder families beyond BERT through sentence-transformers, and a mixed corpus through warmed pipelines (core: "
    "bert, and the feature-extraction pipeline's buckets)",
    "test_sentence_transformers_encode_equals_cpu_and_compiles_nothing_after_warmup[mpnet]",  # 11 s
    "test_sentence_transformers_encode_equals_cpu_and_compiles_nothing_after_warmup[deberta-v2]",  # 8 s
    "test_cross_encoder_reranking_equals_cpu_and_compiles_nothing_after_warmup[deberta-v2]",  # 16 s
    "test_warmed_pipelines_compile_nothing_over_a_mixed_corpus",  # 35 s
)
_slow(
    "transformers/test_vision_generate.py",
    "per-family image tests beyond llava (core: llava for each check but the image-count warm-up; qwen2_vl, gemma4 "
    "and idefics2 for their paths)",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[lfm3_vl]",  # 16 s
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[idefics3]",  # 12 s
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[qwen2_vl]",  # 7 s
    "test_warmup_of_images_says_what_it_cannot_warm[lfm3_vl]",  # 12 s
    "test_warmup_of_images_says_what_it_cannot_warm[qwen2_vl]",  # 11 s
    "test_warmup_of_images_says_what_it_cannot_warm[idefics3]",  # 7 s
    "test_greedy_with_images_equals_cpu_from_host_pixels[idefics3]",  # 10 s
    "test_greedy_with_images_equals_cpu_from_host_pixels[lfm3_vl]",  # 7 s
    "test_one_small_copy_each_way_per_decode_step_with_images[lfm3_vl]",  # 10 s
    "test_one_small_copy_each_way_per_decode_step_with_images[idefics3]",  # 8 s
    "test_one_small_copy_each_way_per_decode_step_with_images[qwen2_vl]",  # 6 s
)
_slow(
    "transformers/test_vision_generate.py",
    "the grid path's third family (core: qwen2_vl)",
    "test_qwen3_vl_images_on_the_cached_loop_equal_cpu_and_warmed_sizes_compile_nothing",  # 41 s
)
_slow(
    "transformers/test_beam_search.py",
    "beam settings and variants beyond the representatives (core: one beam setting, the cached form of each check)",
    "test_beam_search_matches_cpu[4-3-never-0.5]",  # 12 s
    "test_beam_search_matches_cpu[3-3-False--1.5]",  # 9 s
    "test_token_type_ids_take_the_beam_loop[no-cache]",  # 7 s
    "test_beam_search_without_a_cache[beam_sample]",  # 6 s
    "test_attentions_and_hidden_states_come_from_the_beam_graphs[no-cache]",  # 6 s
    "test_several_prompt_lengths_in_one_bucket_compile_once",  # 12 s
)
_slow(
    "transformers/test_generation.py",
    "batched greedy on more decoder families (core: llama, gpt2 and t5)",
    "test_greedy_matches_cpu_for_batched_prompts_of_different_lengths[qwen3]",  # 7 s
    "test_greedy_matches_cpu_for_batched_prompts_of_different_lengths[gemma]",  # 5 s
)
_slow(
    "transformers/test_step_outputs.py",
    "per-step outputs of a second family (core: llama)",
    "test_attentions_and_hidden_states_come_from_the_loop_like_cpu[no-cache-gpt2]",  # 6 s
    "test_attentions_and_hidden_states_come_from_the_loop_like_cpu[cache-gpt2]",  # 4 s
    "test_attentions_and_hidden_states_come_from_the_loop_like_cpu[static-gpt2]",  # 3 s
)
_slow(
    "kernels/test_experts.py",
    "the experts forward in the second dtype (core: the first dtype at every routing)",
    "test_experts_forward_matches_float64[random-1-8-dtype1]",
    "test_experts_forward_matches_float64[random-2-4-dtype1]",
    "test_experts_forward_matches_float64[random-8-1-dtype1]",
    "test_experts_forward_matches_float64[one_expert-4-2-dtype1]",  # 12 s together
)
_slow(
    "transformers/test_sampling.py",
    "the chat defaults at more top-k sizes, and seeded sampling in another process (core: top-k 1, the seed in process)",
    "test_chat_defaults_sample_on_the_device_with_one_small_copy_per_step[16]",  # 5 s
    "test_chat_defaults_sample_on_the_device_with_one_small_copy_per_step[64]",  # 5 s
    "test_seeded_sampling_is_the_same_in_another_process",  # 11 s
)
_slow(
    "sim/test_graphsafe_rng.py",
    "processes seeded per process (core: the generator's graph-safe tests in process)",
    "test_the_default_generator_is_seeded_per_process_as_torch_tpu_and_the_cpu_are",  # 10 s
)
_slow(
    "transformers/test_cacheless.py",
    "a model with a cache of its own (core: the cacheless loop's other tests)",
    "test_a_model_with_a_cache_of_its_own_runs_without_one",  # 21 s
)
_slow(
    "transformers/test_cache_layers.py",
    "heavily compressed attention's refusal (core: each layer kind's loop)",
    "test_heavily_compressed_attention_runs_without_a_cache_and_says_why",  # 14 s
)
_slow(
    "transformers/test_host_length.py",
    "more forms of code reading the cache length (core: arange-from-length)",
    "test_code_reading_the_cache_length_runs_the_loop_like_cpu[branch-on-length]",  # 5 s
    "test_code_reading_the_cache_length_runs_the_loop_like_cpu[prompt-first-arange]",  # 3 s
)
_slow(
    "cli/test_generate_command.py",
    "the advised max prompt length as a whole process (core: the other generate command tests)",
    "test_the_max_prompt_len_advised_for_a_long_prompt_warms_up_and_equals_cpu",  # 10 s
)
_slow(
    "cli/test_generate_command.py",
    "two whole sampled runs (core: the greedy run's test; the warm-up of sampling graphs: tests/transformers)",
    "test_a_sampled_run_finds_its_graphs_warm_and_repeats_with_its_seed",  # 2 runs, ~35 s each on a loaded host
)
_slow(
    "cli/test_env.py",
    "`hf-tpu env` in simulated mode, the flag's other places (core: the environment variable)",
    "test_env_reports_simulated_mode[flag-before]",
    "test_env_reports_simulated_mode[flag-after]",  # 6 s together
)
_slow(
    "quantization/test_weight_only.py",
    "int4's logits and greedy tokens (core: int8, and int4's other checks)",
    "test_logits_and_greedy_tokens_equal_cpu_with_the_same_weights[int4]",  # 10 s
)
_slow(
    "transformers/test_compile_cache.py",
    "an entry from another version, in another process (core: the second process, the corrupt entry)",
    "test_an_entry_from_another_version_is_never_used",  # 15 s
)
_slow(
    "transformers/test_vision_generate.py",
    "image paths beyond the representatives: LLaVA-NeXT's tiles, an encoder that is not one graph (core: llava, "
    "qwen2_vl, gemma4, idefics2)",
    "test_llava_next_tiles_equal_cpu_and_a_second_warmed_image_size_compiles_nothing",  # 22 s
    "test_an_image_encoder_that_is_not_one_graph_sends_image_calls_upstream_and_warmup_says_so",  # 12 s
)
_slow(
    "transformers/test_route.py",
    "a model whose cache has no bucketed form (core: the route's other tests)",
    "test_a_model_whose_cache_has_no_bucketed_form_runs_without_one",  # 16 s
)
_slow(
    "transformers/test_speech_generate.py",
    "Whisper with a language and a task (core: Whisper's warm-up and every clip against the CPU)",
    "test_whisper_greedy_with_language_and_task_equals_cpu_from_host_features",  # 13 s
)
_slow(
    "diffusers/test_families.py",
    "diffusers families beyond the representatives (core: SD3, SD and the UNet in tests/diffusers/test_pipelines.py)",
    "test_controlnet_compiled_matches_cpu",  # 11 s
    "test_wan_compiled_matches_cpu[wan2.2]",  # 4 s
)
_slow(
    "diffusers/test_minimax_h3.py",
    "a diffusers family beyond the representatives (core: SD3, SD and the UNet)",
    "test_minimax_h3_modular_compiled_matches_cpu",  # 8 s
)
# Moved again on 2026-12-05 (issue #47: on a fresh clone the core tier took 643 s of pytest for 1,105 tests, over its
# 600); the figures are each test's seconds in tests/durations.json (that run's JUnit, two workers).
_slow(
    "transformers/test_vision_generate.py",
    "the warm-up of image counts on the plain path (core: the same strict warm-up of one and two images in the gemma4 "
    "and idefics2 path tests; llava in each other check)",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[llava]",  # 24 s
)
_slow(
    "serving/test_penalties.py",
    "per-request penalties through the batching manager itself (core: the same penalties, biases and min_tokens per "
    "request in one batch through the server, tests/serving/test_server.py, and the penalties row by row here)",
    "test_penalties_per_request_in_one_batch_match_cpu_with_no_compile_after_warmup",  # 11 s
)
_slow(
    "serving/test_server.py",
    "a decode to the model's whole context, streamed with its usage chunk (core: finish_reason \"length\" at "
    "max_tokens, the first part of the test this was)",
    "test_finish_reason_is_length_at_the_context",  # 14 s with the max_tokens part
)
_slow(
    "transformers/test_beam_search.py",
    "a second beam setting, early stopping True (core: 3 beams returning 2 sequences, early stopping False, and the "
    "beam loop's other checks; early stopping \"never\" is in the slow tier too)",
    "test_beam_search_matches_cpu[2-1-True-1.0]",  # 8 s
)
_slow(
    "transformers/test_compile_cache.py",
    "a damaged entry's second form, a truncated payload (core: the corrupt entry, reported and compiled again)",
    "test_a_damaged_payload_is_reported_and_compiled_again",  # 9 s
)
_slow(
    "transformers/test_compile_cache.py",
    "a process with another checkpoint on the compile cache, after a first one fills it (core: the second process, "
    "test_a_second_process_compiles_nothing_and_matches_cpu, of which this was the third)",
    "test_another_checkpoint_of_the_same_architecture_shares_the_entries",  # its third process took about 8 s
)
_slow(
    "transformers/test_moe.py",
    "the MoE fast path's second process on the compile cache (core: the same test in one process, "
    "test_moe_fast_path_bucket_warmup_in_one_process; a second process in tests/transformers/test_compile_cache.py)",
    "test_moe_fast_path_bucket_warmup_and_compile_cache[grouped_mm]",  # 24 s, of which the second process about 8
)
_slow(
    "transformers/test_step_outputs.py",
    "per-step outputs of a second family, the last gpt2 case (core: llama)",
    "test_attentions_and_hidden_states_come_from_the_loop_like_cpu[sample-gpt2]",  # 5 s
)
_slow(
    "transformers/test_cache_in_and_out.py",
    "the cache in and out on a second family (core: llama, and mistral's sliding window)",
    "test_three_tokens_then_one_more_from_the_cache_equal_four[qwen3]",  # 4 s
)
_slow(
    "transformers/test_model_inputs.py",
    "prompt embeddings on a second family (core: llama)",
    "test_inputs_embeds_on_the_host_generate_like_cpu_on_the_loop[gpt2]",  # 2 s
)
_slow(
    "transformers/test_cacheless.py",
    "two prompt lengths on the cacheless loop with a second family (core: mpt; a model numbering its tokens has a "
    "test of its own)",
    "test_two_prompt_lengths_in_one_bucket_match_cpu_with_no_compile_for_the_second[openai_gpt]",  # 2 s
)
_slow(
    "kernels/test_host_path.py",
    "split weights in the second layout (core: the transposed layout)",
    "test_split_weights_match_the_weight_array[False]",  # 4 s
)
_slow(
    "kernels/test_experts.py",
    "the experts forward in the second dtype at two more routings (core: the first dtype at every routing, the second "
    "at half_empty-2-4)",
    "test_experts_forward_matches_float64[one_expert-1-8-dtype1]",
    "test_experts_forward_matches_float64[half_empty-8-1-dtype1]",  # 4 s together
)
_slow("ray/test_serve_arguments.py", "needs Ray (the [ray] extra), which .ci/run installs for the slow tier")
_slow(
    "serving/test_read_back_cb.py",
    "continuous batching's chunks beyond the representatives (core: the manager's greedy chunks, generate_batch's "
    "and min_tokens' cap, each against CPU; the server's 64-token answer in tests/serving/test_server.py)",
    "test_manager_reads_back_once_per_chunk_and_equals_cpu[sampled]",
    "test_read_back_every_1_is_upstreams_loop",
    "test_a_request_arriving_mid_run_and_one_asking_logprobs",
    "test_requests_waiting_for_a_slot_do_not_stop_chunks",  # about 20 s together
)
_slow(
    "training/test_optimizer.py",
    "the compiled optimizer's eager ops at two depths, two Trainer runs (core: its loss curve against the CPU's with "
    "0 compiles after step 2, for both optim names)",
    "test_eager_ops_per_step_do_not_grow_with_the_parameter_tensors",  # about 17 s
)
_slow(
    "transformers/test_decode_attention.py",
    "generate through the opt-in ragged_kernel form, a model of its own compiled (core: the kernel's reference "
    "against CPU sdpa at batch 1-256 and 512-8192 slots, its Pallas kernel interpreted, in tests/kernels)",
    "test_the_ragged_kernel_form_generates_the_cpus_tokens",  # about 12 s
)


#: (node id prefix, what checks the same inside CI's run): the sweep, out of CI's run (``.ci/run --sweep`` runs it).
SWEEP: list[tuple[str, str]] = []


def _sweep(module: str, reason: str, *tests: str) -> None:
    SWEEP.extend((f"tests/{module}::{test}" if test else f"tests/{module}", reason) for test in tests or ("",))


_sweep(
    "serving/test_server.py",
    "lm-eval's hf backend on the tpu device (generate's graphs compiled, 25-30 s), beside its CPU run (core: the same "
    "evaluation through local-completions against the server, scored against the hf backend on CPU)",
    "test_lm_eval_hf_backend_on_the_tpu_device_scores_as_on_cpu",
)
_sweep(
    "transformers/test_compile_cache.py",
    "two processes on one cache with a graph switch set otherwise (28 s; core: tests/test_env.py, each graph switch's "
    "two values give two namespaces of one cache directory, the second sees none of the first's entries)",
    "test_a_graph_switch_set_otherwise_loads_no_stored_graph",
)
_VLM_SWEPT = ("exaone4_5", "hyperclovax_vision_v2", "lfm3_vl", "qwen2_5_vl", "mistral3", "idefics3")
_sweep(
    "transformers/test_vision_generate.py",
    "image-text families beyond the representatives: `hf-tpu bench vlm_sweep` runs every architecture's images "
    "against the CPU, warms them up, counts compiles, copies and signatures (docs/architectures.md); CI keeps llava "
    "(plain pixels), gemma3 (token types), qwen2_vl (grid), llava_next, idefics2 and gemma4",
    *(f"{test}[{family}]" for family in _VLM_SWEPT for test in (
        "test_greedy_with_images_equals_cpu_from_host_pixels",
        "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs",
        "test_one_small_copy_each_way_per_decode_step_with_images",
        "test_warmup_of_images_says_what_it_cannot_warm",
    )),
    *(f"test_warmup_of_image_counts_leaves_nothing_to_compile[{family}]" for family in _VLM_SWEPT
      if family not in ("exaone4_5", "hyperclovax_vision_v2")),
    "test_grid_model_text_and_untyped_calls_equal_cpu_on_the_cached_loop[qwen2_5_vl]",
)  # fmt: skip
_sweep(
    "transformers/test_vlm_sweep.py",
    "the image-text sweep's slices of families CI tests on their own (tests/transformers/test_vision_generate.py); "
    "CI keeps paligemma's slice",
    "test_slice_verdicts_match_cpu_and_the_docs[gemma3]",
    "test_slice_verdicts_match_cpu_and_the_docs[llava]",
    "test_slice_verdicts_match_cpu_and_the_docs[qwen2_vl]",
)
_sweep(
    "transformers/test_arch_sweep.py",
    "a second MoE slice of the causal-LM sweep (CI keeps afmoe's slice and the others)",
    "test_slice_verdicts_match_cpu_and_the_docs[mixtral]",
)
_sweep(
    "diffusers/test_minimax_h3_tp.py",
    "a third tensor-parallel pipeline (CI: Flux at tp 2, equal to tp 1 and the CPU)",
    "test_minimax_h3_tp4_equals_tp1",
)
_sweep(
    "training/test_fsdp.py",
    "FSDP2 on a mixture of experts (hf_tpu's FSDP2 path has nothing per architecture; CI: Llama on 2 ranks, and on 4 "
    "with the sharded checkpoint resumed on 2)",
    "test_trainer_fsdp2_equals_one_process_on_the_whole_batch[mixtral-2]",
)
_sweep(
    "transformers/test_moe.py",
    "the MoE fast path's second process with grouped_mm (CI: the same with the ragged-dot kernel, and grouped_mm's "
    "warm-up in one process)",
    "test_moe_fast_path_bucket_warmup_and_compile_cache[grouped_mm]",
)
_sweep(
    "transformers/test_compile_cache.py",
    "two more compile-cache processes (CI: a second process compiles nothing and equals the CPU; a corrupt entry is "
    "reported and compiled again; an entry of another version is never used)",
    "test_another_checkpoint_of_the_same_architecture_shares_the_entries",
    "test_a_damaged_payload_is_reported_and_compiled_again",
)
_sweep(
    "transformers/test_beam_search.py",
    "beam graphs from the compile cache in a new process (CI: greedy's and the serving steps' second processes; "
    "the beam graphs' warm-up in one process)",
    "test_beam_graphs_come_from_the_persistent_compile_cache_in_a_new_process",
)
_sweep(
    "cli/test_bench.py",
    "the compile-cache benchmark's quick run (CI: the compile cache's second processes in tests/transformers and "
    "tests/serving, and every benchmark's interface and quick options)",
    "test_compile_cache_quick_figures_are_consistent",
)
_sweep(
    "ray/test_ray_data.py",
    "two Ray nodes against the CPU (CI: the killed actor's Ray Data job, every row equal to the CPU's greedy tokens, "
    "at most one actor compiling and the others loading the compile cache)",
    "test_two_nodes_equal_cpu_greedy_and_the_second_actor_compiles_nothing",
)
_sweep(
    "test_examples.py",
    "examples/ray_batch.py --check-cpu (two simulated VMs, 64 rows against the CPU; CI: the killed actor's Ray Data "
    "job through the same actor class, each row equal to the CPU's; the sweep's two-node test)",
    "test_example_runs_on_the_simulator[ray_batch.py]",
)
_sweep(
    "encoders/test_encoders.py",
    "five more encoder families with each head, and deberta-v2 through sentence-transformers and a cross-encoder "
    "(CI: bert in the core tier, modernbert in the slow tier, each with every head; bert through both pipelines and "
    "mpnet through sentence-transformers; the mixed corpus's warmed pipelines)",
    *(f"test_model_call_equals_cpu_for_each_family_and_head[{head}-{family}]"
      for head in ("AutoModel", "AutoModelForSequenceClassification", "AutoModelForTokenClassification")
      for family in ("xlm-roberta", "distilbert", "electra", "mpnet", "deberta-v2")),
    "test_sentence_transformers_encode_equals_cpu_and_compiles_nothing_after_warmup[deberta-v2]",
    "test_cross_encoder_reranking_equals_cpu_and_compiles_nothing_after_warmup[deberta-v2]",
)  # fmt: skip
_sweep(
    "test_examples.py",
    "examples/encoders.py (CI: docs/encoders.md's blocks, the same pipelines and sentence-transformers calls, and "
    "tests/encoders)",
    "test_example_runs_on_the_simulator[encoders.py]",
)
_sweep(
    "serving/test_serving_compile_cache.py",
    "the batching manager's second process on the compile cache (CI: `hf-tpu serve --compile-cache` twice, the "
    "second server compiling none)",
    "test_a_second_process_loads_every_step_graph_and_compiles_nothing",
)
_sweep(
    "tpu_compile/test_chip_torch_tpu.py",
    "the chip script's serve stage on the simulated device (CI: its generate stage; the server on a unix socket in "
    "tests/serving/test_serve_hardening.py; the stage's records from a chip in docs/chip_v5e_torch_tpu.jsonl)",
    "test_the_serve_stage_loads_a_server_over_a_unix_socket_on_the_simulator",
)
_sweep(
    "tpu_compile/test_chip_torch_tpu.py",
    "the chip script's generate stage on the simulated device (CI: its stage specs, its pack list and its FLOPs "
    "count; hf_tpu's generate against the CPU in tests/transformers; the stage's records from a chip in "
    "docs/chip_v5e_torch_tpu.jsonl)",
    "test_generate_stage_on_the_simulator",
)
_sweep(
    "tpu_compile/test_chip_torch_tpu.py",
    "the chip script's denoiser and train stages on the simulated device (CI: their FLOPs counts against torch's "
    "flop counter, their lean JAX references against diffusers' SD3 transformer and the Llama's loss; the SD3 "
    "pipeline's compile and CPU equality in tests/diffusers, the Trainer on the simulator in tests/training)",
    "test_the_denoiser_and_train_stages_on_the_simulator",
)
_sweep(
    "tpu_compile/test_chip_bench.py",
    "scripts/chip_bench.py's parts on a CPU (CI: its report of the committed records, its donation and KV-write "
    "forms against the lean steps)",
    "test_chip_parts_run_on_a_cpu",
)
_sweep(
    "cli/test_bench.py",
    "two more benchmarks' quick runs, sim_forward and training (CI: generate's quick run, and every benchmark's "
    "interface and quick options)",
    "test_quick_runs_end_to_end_with_consistent_json",
)
_sweep(
    "ray/test_ray_serve.py",
    "hf-tpu serve replicas behind Ray Serve (CI: Ray Data over two simulated VMs, examples/ray_batch.py, the killed "
    "actor; the Ray Serve builder's arguments, tests/ray/test_serve_arguments.py; hf-tpu serve itself in "
    "tests/serving)",
    "test_replicas_behind_one_endpoint_answer_the_openai_client_greedy_equal_to_cpu",
)
_sweep(
    "sim/test_native.py",
    "the simulator's Python path through the device tests (CI: the Python and native paths agree op by op, and the "
    "native path declines to Python where it does not cover an op)",
    "test_python_path_passes_the_device_tests",
)
_sweep(
    "test_examples.py",
    "examples/tp_generate.py on two simulated chips (CI: tensor parallel at tp 2 against tp 1 in the core tier, tp 4 "
    "with the plan fixes, the torch_tpu launch recipe and the tensor-parallel server in the slow tier)",
    "test_tensor_parallel_example_runs_on_two_simulated_chips",
)
_sweep(
    "docs/test_docs.py",
    "docs/serving.md's `hf-tpu serve --simulate` session (its 15 step shapes' warm-up; CI: hf-tpu serve's own tests, "
    "the warm-up line read by tests/serving/test_serving_compile_cache.py, the page's Python blocks)",
    "test_commands_print_what_the_page_shows[docs/serving.md:",
)
_sweep(
    "transformers/test_transformers_suite_script.py",
    "transformers' own tests through scripts/run_transformers_tests.py (a whole pytest of upstream's files; its "
    "figures are in docs/compatibility.md; CI keeps the script's tree assembly)",
    "test_the_hf_tpu_run_counts_the_tests_its_loop_served",
)

_sweep(
    "transformers/test_vision_generate.py",
    "second families of image paths CI keeps one family of: warm-up of image counts (CI: llava's), padded images "
    "dropped on the host (CI: idefics2's, core), Gemma 4's unified checkpoint (CI: gemma4's, core), another image "
    "and another count (CI: llava's), Qwen3-VL's images (CI: Qwen2-VL's grid path, core; Qwen3-VL's graphs lowered "
    "through torch_tpu, contract tier); `hf-tpu bench vlm_sweep` warms every architecture up and counts its compiles",
    "test_qwen3_vl_images_on_the_cached_loop_equal_cpu_and_warmed_sizes_compile_nothing",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[gemma3]",
    "test_warmup_of_image_counts_leaves_nothing_to_compile[qwen2_vl]",
    "test_padded_images_drop_on_the_host_equal_cpu_read_nothing_and_warmed_calls_compile_nothing[smolvlm]",
    "test_gemma4_images_run_the_cached_loop_equal_cpu_and_another_count_and_size_compile_nothing[gemma4_unified]",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[gemma3]",
    "test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs[qwen2_vl]",
)
_sweep(
    "cli/test_bench.py",
    "the generate benchmark's quick run (CI: the bucketed loop's compiles bounded by the buckets touched and equal to "
    "the CPU, tests/transformers/test_generation.py; every benchmark's interface and quick options)",
    "test_generate_quick_buckets_compile_no_more_than_upstream",
)
_sweep(
    "training/test_fsdp.py",
    "Trainer with FSDP2 on 4 ranks (CI: the same on 2 ranks, core; 4 ranks with the sharded checkpoint resumed on 2; "
    "accelerate's FSDP2 plugin in a plain loop)",
    "test_trainer_fsdp2_equals_one_process_on_the_whole_batch[llama-4]",
)
_sweep(
    "diffusers/test_qwen_image_tp.py",
    "a second tensor-parallel pipeline (CI: Flux at tp 2 through the same launcher and diffusers' own "
    "TensorParallelConfig, equal to tp 1 and the CPU; causal LMs at tp 4 with the plan fixes)",
    "test_qwen_image_21_tp4_equals_tp1",
)
_sweep(
    "transformers/test_read_back.py",
    "more rows of the read-back grid (CI: batch 1 greedy with no end and with an early end, sampled with an early "
    "end; batch 4 greedy with some rows ending, sampled with some and with every row ending)",
    "test_generate_reads_back_once_per_k_steps_and_equals_cpu[1-True-none]",
    "test_generate_reads_back_once_per_k_steps_and_equals_cpu[4-False-none]",
    "test_generate_reads_back_once_per_k_steps_and_equals_cpu[4-False-all]",
    "test_generate_reads_back_once_per_k_steps_and_equals_cpu[4-True-none]",
)

_sweep(
    "contract/test_tpu_compile.py",
    "the measured experts choice compiled for a second target (CI: the same on v5e-1, the chip it was measured on)",
    "test_moe_decode_with_the_measured_experts_choice_compiles[v6e-1]",
)

_sweep(
    "test_examples.py",
    "examples whose flow a test of the core tier runs against the CPU: moe_kernel.py (tests/kernels/test_experts.py: "
    "get_kernel, the experts registration, a Qwen3-MoE on the kernel; tests/transformers/test_moe.py), "
    "diffusers_sd3.py (tests/diffusers/test_pipelines.py: SD3 compiled after warm-up), finetune.py "
    "(tests/training/test_trainer.py), device_map.py (tests/device_map); CI keeps generate.py and "
    "simulator_counters.py, and checks that every example has its test (test_every_example_is_covered)",
    "test_example_runs_on_the_simulator[moe_kernel.py]",
    "test_example_runs_on_the_simulator[diffusers_sd3.py]",
    "test_example_runs_on_the_simulator[finetune.py]",
    "test_example_runs_on_the_simulator[device_map.py]",
)


def _prefix(table: list[tuple[str, str]], nodeid: str) -> str | None:
    for prefix, _ in table:
        if nodeid == prefix or (nodeid.startswith(prefix) and ("[" in prefix or nodeid[len(prefix)] in "[:")):
            return prefix
    return None


def slow_prefix(nodeid: str) -> str | None:
    """The entry of :data:`SLOW` that ``nodeid`` falls under, or None."""
    return _prefix(SLOW, nodeid)


def sweep_prefix(nodeid: str) -> str | None:
    """The entry of :data:`SWEEP` that ``nodeid`` falls under, or None."""
    return _prefix(SWEEP, nodeid)


def mark_slow(items, check_stale: bool = True) -> None:
    """Add the ``sweep`` marker to the items :data:`SWEEP` names and the ``slow`` marker to the other items
    :data:`SLOW` names. With ``check_stale``, an entry whose module was collected but which names none of its tests
    (a test renamed or removed) is an error, so that the tables cannot go stale."""
    import pytest

    used = set()
    for item in items:
        swept, slow = sweep_prefix(item.nodeid), slow_prefix(item.nodeid)
        if swept is not None:
            item.add_marker(pytest.mark.sweep)
        elif slow is not None:
            item.add_marker(pytest.mark.slow)
        used.update(p for p in (swept, slow) if p is not None)
    modules = {item.nodeid.split("::", 1)[0] for item in items}
    stale = [p for p, _ in SLOW + SWEEP if check_stale and p not in used and p.split("::", 1)[0] in modules]
    if stale:
        raise pytest.UsageError(f"tests/_tiers.py names tests that were not collected: {stale}; update SLOW or SWEEP")
