"""The compile tier: hf_tpu's graphs through torch_tpu's real lowering and libtpu's compiler for v6e-1, no chip.

Each test lowers one kind of graph hf_tpu compiles (built from a tiny config on deferred tpu tensors) in a child
process with torch_tpu's device (hf_tpu.tpu_compile), and compiles it with libtpu for a described v6e chip. The
kinds of graph share one lowering and one compiling process (the ``lowered`` fixture; the two expected to fail run
last in it), the quantized plans another pair (``quantized_plans``), the 30B-shaped MoE one lowering compiled for
two targets; the plan commands and the HLO dump run their own. A test fails when its graph does not lower or
does not compile. Where a program has no custom call, its XLA:CPU result is compared with torch on the CPU in the
same test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_tpu.testing import tiny_config
from hf_tpu.tpu_compile import compile_lowered, lower_and_compile, lower_and_compile_each
from hf_tpu.tpu_compile.plan import plan_generate, plan_generate_each

HERE = Path(__file__).resolve().parent
GENERATE = "hf_tpu.tpu_compile._generate:lower_generate"


@pytest.fixture(autouse=True)
def _entries_importable(monkeypatch):
    """The lowering process imports this folder's entries module."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def _saved(tmp_path, family: str, **overrides) -> str:
    path = tmp_path / family
    tiny_config(family, **overrides).save_pretrained(path)
    return str(path)


def _roformer(root) -> str:
    """RoFormer, which reads its cache length as a number (the host-length route)."""
    from transformers import RoFormerConfig

    path = root / "roformer"
    RoFormerConfig(vocab_size=96, embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=64, is_decoder=True).save_pretrained(path)  # fmt: skip
    return str(path)


def _grouped_entries(root) -> dict[str, dict]:
    """The entries of the tests of one generate call or graph, by test: lowered in one process and compiled in one
    (``lowered``); the two whose lowering is expected to fail come last."""
    llama = _saved(root, "llama")
    qwen3_moe = _saved(root, "qwen3_moe")
    plain = {"model": llama, "max_prompt_len": 16, "max_new_tokens": 8, "dtype": "float32"}
    return {
        "beam": {"entry": GENERATE, "kwargs": {**plain, "num_beams": 3}},
        "greedy": {"entry": GENERATE, "kwargs": plain},
        "processors": {
            "entry": GENERATE,
            "kwargs": {**plain, "generation": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 0}},
        },
        "cacheless": {"entry": GENERATE, "kwargs": {**plain, "generation": {"use_cache": False}}},
        "moe_grouped_mm": {
            "entry": "_tpu_compile_entries:lower_moe_generate",
            "kwargs": {"model": qwen3_moe, "experts_implementation": "grouped_mm"},
        },
        "routing_offsets": {"entry": "_tpu_compile_entries:lower_routing_offsets", "kwargs": {}},
        "host_length": {"entry": GENERATE, "kwargs": {**plain, "model": _roformer(root)}},
        "denoiser": {"entry": "_tpu_compile_entries:lower_sd3_denoiser", "kwargs": {"size": 32}},
        "tp_rank": {"entry": "_tpu_compile_entries:lower_tp_rank_layer", "kwargs": {}},
        "train_forward": {"entry": "_tpu_compile_entries:lower_train_forward", "kwargs": {}},
        "block": {"entry": "_tpu_compile_entries:lower_block", "kwargs": {}},
        "host_reads": {"entry": "_tpu_compile_entries:lower_host_reads", "kwargs": {}},
        "encoder-bert": {"entry": "_tpu_compile_entries:lower_encoder_warmup", "kwargs": {"family": "bert"}},
        "encoder-modernbert": {
            "entry": "_tpu_compile_entries:lower_encoder_warmup",
            "kwargs": {"family": "modernbert"},
        },
        **{
            f"vision-{family}": {"entry": "_tpu_compile_entries:lower_vision_warmup", "kwargs": {"family": family}}
            for family in ("qwen2_vl", "gemma3", "qwen3_vl", "idefics3", "lfm3_vl", "mistral3")
        },
        "kv_write_after": {
            "entry": "_tpu_compile_entries:lower_with_env",
            "kwargs": {"env": {"HF_TPU_KV_WRITE": "after"}, "entry": GENERATE, "kwargs": plain},
        },
        # expected to fail (the lowering asks for the PjRt client): last, so that no entry runs after a failure
        "sampling": {
            "entry": GENERATE,
            "kwargs": {**plain, "generation": {"do_sample": True, "top_k": 5, "temperature": 0.7}},
        },
        "moe_ragged_dot": {  # (and hf_tpu's Hub kernel, registered here, is seen by no later entry)
            "entry": "_tpu_compile_entries:lower_moe_generate",
            "kwargs": {"model": qwen3_moe, "experts_implementation": "ragged_dot_tpu"},
        },
    }


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """``lowered[name]``: the :class:`LoweringResult` of one entry of :func:`_grouped_entries`, as
    ``lower_and_compile(entry, kwargs, "v6e-1")`` returns it alone. The entries share one lowering process (torch_tpu's
    device started once; ``torch._dynamo.reset()`` before each, see ``hf_tpu.tpu_compile._child.lower_each``) and one
    libtpu compiling process (``lower_and_compile_each``): two processes in all instead of two per test. Each entry's
    programs, labels, info, error and eager traffic are its own."""
    entries = _grouped_entries(tmp_path_factory.mktemp("models"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        results = lower_and_compile_each({n: (e["entry"], e["kwargs"]) for n, e in entries.items()}, "v6e-1")
    assert list(results) == list(entries)
    return results


def _all_compiled(result, names: list[str] | None = None):
    assert result.error is None, f"{result.error}\n at {result.where}"
    assert result.programs, "nothing was lowered"
    for p in result.programs:
        assert p.lowered and p.compiled, f"{p.name}: {p.error} [{p.where}]"
        assert p.argument_bytes > 0 and p.bytes_accessed > 0 and p.flops > 0
    if names is not None:
        assert [p.name for p in result.programs] == names


def test_generate_beam_search_graphs(lowered):
    # beam search's graphs (hf_tpu.transformers._beam_graphs): upstream's beam helpers, the cache reorder by beam
    # index and the step's stopping flag lower through torch_tpu and compile with libtpu
    result = lowered["beam"]
    _all_compiled(result)
    kinds = [p.name.split("+", 1)[0] for p in result.programs]
    assert {"beam_prefill", "beam_decode"} <= set(kinds), kinds
    # the warm-up's one copy back: the read-back of the tokens kept on the device (defaults.warm_read_back),
    # nothing else
    assert result.eager["device_to_host"] == 1, result.eager


def test_generate_greedy_prefill_and_decode(lowered):
    result = lowered["greedy"]
    _all_compiled(result, ["prefill-16", "decode"])
    # the prompt's sdpa became torch_tpu's Mosaic flash-attention kernel (one per layer), which libtpu compiled; the
    # decode step's one-token attention is hf_tpu's grouped products (hf_tpu/transformers/_decode_attention.py)
    prefill, decode = result.programs
    assert (prefill.custom_calls, decode.custom_calls) == (2, 0)
    # the decode step reads what the prefill wrote: same weights and cache arguments
    assert decode.argument_bytes == prefill.argument_bytes
    # the padding mask reaches the attention as a slice of the 2D mask, not as a gather of one element per (row,
    # slot) (hf_tpu.transformers._cache.static.apply_padding_mask; 431 us of a batch-64 step on a v5e): the decode
    # step's one gather is the embedding's rows
    assert decode.text.count('"stablehlo.gather"') == 1, decode.text.count('"stablehlo.gather"')
    # the warm-up's one copy back: the read-back of the tokens kept on the device (defaults.warm_read_back),
    # nothing else
    assert result.eager["device_to_host"] == 1, result.eager


def test_a_decode_step_that_leaves_its_rows_to_the_loop_writes_no_cache(lowered):
    """``HF_TPU_KV_WRITE=after`` (``auto`` picks it from 32 MiB of K and V per layer, _cache/writes.py; set in the
    lowering process for this entry alone, ``_tpu_compile_entries.lower_with_env``): through torch_tpu's front end
    the decode program holds no scatter into a cache and returns no updated cache (the copy torch_tpu's undonated
    compile makes of one), but each layer's K and V row and their slot, which scripts/chip_bench.py's
    ``rows_after`` pairs with the cache arguments; libtpu compiles it."""
    import sys

    sys.path.insert(0, str(HERE.parents[1] / "scripts"))
    import chip_bench

    result = lowered["kv_write_after"]
    _all_compiled(result, ["prefill-16", "decode"])
    prefill, decode = result.programs
    assert '"stablehlo.scatter"' in prefill.text and '"stablehlo.scatter"' not in decode.text
    layers = tiny_config("llama").num_hidden_layers
    writes = chip_bench.rows_after(decode.text)
    assert len(writes) == 2 * layers and len({slot for _, _, slot in writes}) == layers, writes
    assert chip_bench.rows_after(prefill.text) == []


def test_generate_with_logits_processors_on_the_device(lowered):
    result = lowered["processors"]
    _all_compiled(result, ["prefill-16", "decode"])
    assert result.info["graph_keys"][1][0].startswith("decode+")  # the processors' variant of the graph


def test_sampling_draws_need_the_device_generator_to_lower(lowered):
    """Sampling's random draw (``rand_like`` from the device generator, graph-safe RNG) lowers only with a PjRt
    client: the chipless stand-in has no device generator, so this graph is reported as not lowered, with why."""
    result = lowered["sampling"]
    assert result.error is not None and "PjRt client" in result.error
    assert not any(p.compiled for p in result.programs)


def test_generate_without_a_cache(lowered):
    result = lowered["cacheless"]
    _all_compiled(result)
    assert all(k[0].startswith("cacheless") for k in result.info["graph_keys"]), result.info["graph_keys"]


def test_generate_moe_grouped_mm(lowered):
    """Qwen3-MoE with transformers' grouped_mm experts: the routing's cumsum lowers to ``chlo.scan``, which the
    compile step passes to libtpu as the equivalent reduce_window (hf_tpu.tpu_compile._xla.normalize)."""
    result = lowered["moe_grouped_mm"]
    _all_compiled(result, ["prefill-16", "decode"])
    assert all("chlo.scan" in p.text and "chlo.ragged_dot" in p.text for p in result.programs)


def test_routing_cumsum_rewrite_equals_torch_on_xla_cpu(lowered):
    result = lowered["routing_offsets"]
    _all_compiled(result, ["routing-offsets"])
    program = result.programs[0]
    assert "chlo.scan" in program.text
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2], dtype=torch.int32)
    scale = torch.tensor([[1.0], [0.5], [-2.0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    import _tpu_compile_entries as entries

    expected = entries.routing_offsets(counts, scale, mask)
    by_shape = {tuple(t.shape): t.numpy() for t in (counts, scale, mask)}
    out = _run_on_cpu(program.text, [by_shape[tuple(shape)] for shape, _ in program.arguments])
    np.testing.assert_array_equal(out[0], expected[0].numpy())
    np.testing.assert_allclose(out[1], expected[1].numpy())
    np.testing.assert_array_equal(out[2], expected[2].numpy())


def test_moe_ragged_dot_kernel_needs_a_chip_to_lower(lowered):
    """hf_tpu's ragged-dot Hub kernel runs its Pallas kernel through torch.tpu.pallas.jax_op, which asks for the PjRt
    client while lowering: reported as not lowered, with that reason."""
    result = lowered["moe_ragged_dot"]
    assert result.error is not None and "PjRt client" in result.error
    assert not any(p.compiled for p in result.programs)


@pytest.fixture(scope="module")
def moe_30b_shaped_lowered(tmp_path_factory):
    """The lowering (not compiled) of generate's warm-up for the Qwen3-30B-A3B-shaped model of the test below, in
    bfloat16, with no experts implementation asked for: done once, compiled for each target by the test (the
    lowering does not depend on the target)."""
    path = _saved(tmp_path_factory.mktemp("moe"), "qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                  num_experts=128, num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, vocab_size=1024)  # fmt: skip
    return lower_and_compile(GENERATE, {"model": path, "max_prompt_len": 16, "max_new_tokens": 8,
                                        "dtype": "bfloat16"}, compile=False)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e-1", "v6e-1"])
def test_moe_decode_with_the_measured_experts_choice_compiles(moe_30b_shaped_lowered, target):
    """The MoE decode program hf_tpu runs on a TPU by default: a Qwen3-30B-A3B-shaped model (one layer of its 128
    experts, top-8, hidden 2048, expert width 768; a small vocabulary) with no experts implementation asked for.
    Warm-up gives it hf_tpu's measured choice (``hf_tpu_measured``), whose one-token form for this shape is the slots
    form (hf_tpu/kernels/experts_v5e.json, measured on a v5e); that decode program lowers through torch_tpu and
    compiles for the target, with no ``ragged_dot`` left in it (transformers' default lowers to one)."""
    from hf_tpu.kernels import experts_forms

    assert experts_forms.choose(2048, 768, 128, 8, 1, forms=experts_forms.DEFAULT_FORMS) == "slots"
    assert not any(p.compiled for p in moe_30b_shaped_lowered.programs)  # (the fixture's: lowered, not compiled)
    result = compile_lowered(moe_30b_shaped_lowered, target)
    assert result.target.name == target
    _all_compiled(result, ["prefill-16", "decode"])
    assert result.info["experts_implementation"] == experts_forms.MEASURED_NAME
    decode = result.programs[-1]
    assert "ragged_dot" not in decode.text


@pytest.fixture(scope="module")
def quantized_plans(tmp_path_factory):
    """``plan_generate`` of one bfloat16 Llama (256 wide) for v6e-1 with each weight quantization (None: plain
    bfloat16), planned once for the two tests below: ``plan_generate_each``, the four lowered in one process and
    compiled in one."""
    path = _saved(tmp_path_factory.mktemp("quantized"), "llama", hidden_size=256, intermediate_size=512, head_dim=64)
    quantizations = (None, "int8", "int4", "fp8")
    plans = plan_generate_each(path, "v6e-1", {
        str(q): {"max_prompt_len": 16, "max_new_tokens": 8, "dtype": "bfloat16", "quantization": q}
        for q in quantizations
    })  # fmt: skip
    return {q: plans[str(q)] for q in quantizations}


def test_generate_bfloat16_and_int8_weights(quantized_plans):
    plain, int8 = quantized_plans[None], quantized_plans["int8"]
    for plan in (plain, int8):
        assert plan.error is None, plan.error
        _all_compiled(type("R", (), {"error": None, "where": None, "programs": plan.programs})())
    assert plan.fits and int8.fits
    # int8 linear weights: fewer bytes than bf16, and fewer bytes moved per decode step
    assert int8.hbm["weights"] < plain.hbm["weights"]
    assert int8.decode_summary()["bytes_accessed"] < plain.decode_summary()["bytes_accessed"]


def test_generate_int4_and_fp8_weights(quantized_plans):
    plans = quantized_plans
    for q in ("int4", "fp8"):
        assert plans[q].error is None and [p.compiled for p in plans[q].programs] == [True, True], plans[q].error
    assert plans["int4"].hbm["weights"] < plans["int8"].hbm["weights"] < plans[None].hbm["weights"]
    # fp8 blocks: one byte per linear weight (the head stays bf16), dequantized inside the graph
    assert plans["fp8"].hbm["weights"] < plans[None].hbm["weights"]


def test_every_private_name_the_lowering_stand_in_replaces_exists_in_the_wheel():
    """The stand-in (hf_tpu._torch_tpu.start_lowering) replaces or reads private torch_tpu names; a wheel that renamed
    one would make it stand in for nothing. Checked without importing torch_tpu's device (the sources are read)."""
    import importlib
    import inspect

    from hf_tpu import _torch_tpu

    for module_name, names in _torch_tpu.LOWERING_NAMES.items():
        module = importlib.import_module(module_name)
        assert [n for n in names if not hasattr(module, n)] == [], module_name
    dynamic = importlib.import_module("torch_tpu._internal.compile.dynamic.dynamic_executable")
    source = inspect.getsource(dynamic.DynamicTpuCompiledExecutable)
    assert [n for n in _torch_tpu.DYNAMIC_NAMES if f"self.{n}" not in source] == []
    # the PCI scan the lowering process answers once (hf_tpu.tpu_compile._child._scan_pci_once), and the count that
    # reads it through the module's global
    hardware = importlib.import_module("torch_tpu._internal.utils.hardware")
    assert "_scan_pci_tpus()" in inspect.getsource(hardware.get_tpu_device_count)


def test_host_length_model_lowers_its_dynamic_decode_through_torch_tpu(lowered):
    """RoFormer reads its cache length as a number (``torch.arange(length, length + n)``): its cached prefill fails
    its first trace, and warm-up moves it to the host-length route, as generate would. Through torch_tpu's real
    front end that decode graph (the length a dynamic size) goes to torch_tpu's dynamic compiler, which takes the
    length as an int32 scalar input; it lowers and libtpu compiles it."""
    result = lowered["host_length"]  # the RoFormer of _roformer
    _all_compiled(result)
    kinds = [k[0] for k in result.info["graph_keys"]]
    assert kinds == ["prefill", "decode"], kinds
    decode = result.programs[-1]
    assert decode.name == "decode" and [[], "int32"] in decode.arguments, decode.arguments  # the length


def test_plan_command_prints_one_json_object(tmp_path):
    path = _saved(tmp_path, "llama")
    proc = subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", "plan", path, "--target", "v6e-1", "--max-prompt-len", "16",
         "--max-new-tokens", "8", "--dtype", "float32", "--json"], capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["target"] == "v6e-1" and plan["fits"] is True
    assert set(plan["hbm_bytes"]) == {"capacity", "weights", "kv_cache", "temporaries", "total"}
    assert [p["name"] for p in plan["programs"]] == ["prefill-16", "decode"]
    for p in plan["programs"]:
        assert {"name", "lowered", "compiled", "error", "compile_seconds", "flops", "bytes_accessed",
                "optimal_seconds", "argument_bytes", "temp_bytes"} <= set(p)  # fmt: skip
    assert "compiled program" in proc.stderr  # progress on stderr, the object alone on stdout
    assert plan["verdict"] == "fits" and plan["exit_status"] == 0 and plan["out_of_memory"] == {}
    decode = plan["decode"]
    assert decode["matmul_flops"] == 2 * (plan["info"]["parameters"] - plan["info"]["gathered_embedding_parameters"])
    assert decode["flops_over_matmul"] == pytest.approx(decode["flops"] / decode["matmul_flops"])


@pytest.mark.slow
def test_plan_command_says_a_program_out_of_hbm_does_not_fit(tmp_path):
    """A model whose weights fit one v5e chip but whose prefill does not (a 1M-wide MLP over 8192 tokens: a 17 GB
    activation): libtpu refuses that program for HBM, and ``hf-tpu plan`` exits 3 naming it, the bytes it needed,
    and a prompt bucket that would fit; the decode alone compiled (before, such a plan printed FITS and exited 0)."""
    path = _saved(tmp_path, "llama", hidden_size=64, intermediate_size=1 << 20, num_hidden_layers=1,
                  max_position_embeddings=16384)  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", "plan", path, "--target", "v5e-1", "--max-prompt-len", "8192",
         "--max-new-tokens", "8", "--json"], capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["fits"] is False and plan["verdict"] == "does not fit" and plan["error"] is None
    assert [(p["name"], p["compiled"]) for p in plan["programs"]] == [("prefill-8192", False), ("decode", True)]
    assert "CompileTimeHbmOom" in plan["programs"][0]["error"]
    oom = plan["out_of_memory"]["prefill-8192"]
    assert oom["needed"] > oom["available"] > 15 * 2**30 and plan["hbm_bytes"]["total"] == int(oom["needed"])
    assert any("--max-prompt-len" in tip for tip in plan["suggestions"]), plan["suggestions"]


_ONE_ROW_PRODUCT = """
import json, jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
device = topologies.get_topology_desc("v5e:1x1", "tpu").devices[0]
out = {}
for rows in (1, 2, 8, 128):
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=SingleDeviceSharding(device))
            for s in ((rows, 4096), (4096, 14336))]
    compiled = jax.jit(lambda x, w: x @ w).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out[rows] = [cost["flops"] / (2 * rows * 4096 * 14336), " convolution(" in compiled.as_text()]
print(json.dumps(out))
"""


def test_libtpu_counts_a_one_row_product_five_times_per_weight():
    """Why a batch-1 decode's FLOPs are ~2.4x 2 x parameters in ``hf-tpu plan`` (docs/planning.md): libtpu compiles
    a bf16 product with one row as elementwise converts, a multiply and a reduction over the weight matrix, and its
    cost analysis counts 5 per weight (2.5x ``2MNK``); with 2 rows or more it is a convolution, counted 2 per weight."""
    from _timeouts import SAFETY_TIMEOUT_S

    from hf_tpu.tpu_compile.programs import child_environment

    proc = subprocess.run([sys.executable, "-c", _ONE_ROW_PRODUCT], capture_output=True, text=True,
                          env=child_environment(), timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ratios["1"] == [pytest.approx(2.5, rel=1e-3), False], ratios  # the reduction adds K - 1 per column
    for rows in ("2", "8", "128"):
        assert ratios[rows] == [pytest.approx(1.0), True], ratios


def test_dumped_hlo_splits_bytes_accessed_into_hbm_and_on_chip(tmp_path):
    """With ``dump_hlo``, libtpu's scheduled HLO of each program is kept and hf_tpu.tpu_compile.hlo_bytes re-derives
    XLA's bytes accessed from it and the part of it that is HBM traffic. On the 4096-wide Llama decode programs of
    docs/planning.md the re-derived total matches libtpu's to 0.01%; on this small model, where tile padding
    dominates, to within 6% (some fused slices are counted differently), hence the 10% here."""
    from hf_tpu.tpu_compile import hlo_bytes

    dump = tmp_path / "hlo"
    model = _saved(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=128)  # fmt: skip
    result = lower_and_compile(GENERATE, {"model": model, "max_prompt_len": 16, "max_new_tokens": 8,
                                          "dtype": "bfloat16"}, "v6e-1", dump_hlo=str(dump))  # fmt: skip
    _all_compiled(result, ["prefill-16", "decode"])
    for program in result.programs:
        assert program.hlo_path == str(dump / f"{program.name}.hlo.txt"), program.hlo_path
        split = hlo_bytes.split(Path(program.hlo_path).read_text())
        assert split.bytes_accessed == pytest.approx(program.bytes_accessed, rel=0.1), program.name
        assert program.hbm_bytes == pytest.approx(split.hbm_bytes)
        assert 0 < program.hbm_bytes < program.bytes_accessed
        assert split.parameters_read_more_than_once() == {}, program.name
    assert sorted(p.name for p in dump.iterdir()) == ["decode.hlo.txt", "libtpu", "prefill-16.hlo.txt"]


def test_diffusers_denoiser_step(lowered):
    result = lowered["denoiser"]
    _all_compiled(result, ["denoiser-32x32"])
    assert result.programs[0].custom_calls > 0  # its joint attention became torch_tpu's flash-attention kernel


def test_plan_pipeline_command_plans_the_denoiser_step(tmp_path):
    """``hf-tpu plan DIR --pipeline``: a saved diffusers pipeline built from its configs with deferred weights,
    compiled as compile_pipeline compiles it and called once; its denoiser step lowers and compiles for v6e-1."""
    from hf_tpu.diffusers.testing import tiny_sd3_pipeline

    path = tmp_path / "sd3"
    tiny_sd3_pipeline(path)
    proc = subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", "plan", str(path), "--pipeline", "--height", "32", "--width", "32",
         "--dtype", "float32", "--target", "v6e-1", "--json"], capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["kind"] == "pipeline" and plan["fits"] is True and plan["decode"] is None
    [program] = plan["programs"]
    assert program["name"] == "denoiser-32x32" and program["lowered"] and program["compiled"], program
    step = plan["step"]
    assert step["programs"] == ["denoiser-32x32"] and step["projected_ms"] > 0 and step["floor_bytes"] > 0
    assert plan["info"]["denoisers"] == ["transformer"]
    assert plan["hbm_bytes"]["weights"] == plan["info"]["weights_bytes"] > step["floor_bytes"]  # every component


def test_tensor_parallel_rank_programs(lowered):
    result = lowered["tp_rank"]
    assert result.error is None, result.error
    assert [p.name for p in result.programs] == ["tp-rank-before-all-reduce", "tp-rank-collective",
                                                 "tp-rank-after-all-reduce"]  # fmt: skip
    assert all(p.lowered and p.compiled for p in result.programs), [p.error for p in result.programs]
    before = result.programs[0]
    assert [s for s, _ in before.arguments] == [[4, 64], [64, 64], [64, 64]]  # the rank's shards: half of 128
    assert before.flops > 0


def test_training_forward_with_its_loss(lowered):
    result = lowered["train_forward"]
    _all_compiled(result, ["train-forward"])


def test_block_numerics_on_xla_cpu_equal_torch(lowered):
    import _tpu_compile_entries as entries

    result = lowered["block"]
    _all_compiled(result, ["block"])
    program = result.programs[0]
    assert program.custom_calls == 0
    gen = torch.Generator().manual_seed(0)
    values = {n: torch.randn(s, generator=gen) * 0.3 for n, s in entries.BLOCK_SHAPES.items()}
    expected = entries.block(**values)
    by_shape = {tuple(v.shape): v for v in values.values()}
    arrays = [by_shape[tuple(shape)].numpy() for shape, _ in program.arguments]  # the module's own argument order
    out = _run_on_cpu(program.text, arrays)
    np.testing.assert_allclose(out[0], expected.numpy(), rtol=1e-5, atol=1e-5)


def _run_on_cpu(text: str, arrays: list) -> list:
    """hf_tpu.tpu_compile._xla.run_on_cpu in a process of its own (JAX on XLA:CPU, torch_tpu not loaded)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        np.savez(os.path.join(tmp, "in.npz"), *arrays)
        Path(tmp, "module.mlir").write_text(text)
        code = (
            "import json, sys, numpy as np\n"
            "from hf_tpu.tpu_compile._xla import run_on_cpu\n"
            f"d = np.load({os.path.join(tmp, 'in.npz')!r}); arrays = [d[f'arr_{{i}}'] for i in range(len(d.files))]\n"
            f"outs = run_on_cpu(open({os.path.join(tmp, 'module.mlir')!r}).read(), arrays)\n"
            f"np.savez({os.path.join(tmp, 'out.npz')!r}, *outs)\n"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        d = np.load(os.path.join(tmp, "out.npz"))
        return [d[f"arr_{i}"] for i in range(len(d.files))]


def test_arch_compile_rows_and_docs_cell():
    from hf_tpu.benchmarks import arch_compile

    rows = arch_compile.measure_many(["gpt2", "mixtral"])
    for arch, row in rows.items():
        assert row["compiled"] and row["step_us"] > 0, row
        assert arch_compile.cell(row).startswith("compiles, ")
    assert arch_compile.cell({"compiled": False, "error": "x | y"}) == "**no**: x \\| y"


def test_plan_refuses_a_model_that_cannot_fit_before_compiling(tmp_path):
    from transformers import LlamaConfig

    path = tmp_path / "llama-70b-shaped"
    LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192).save_pretrained(path)  # fmt: skip
    plan = plan_generate(path, "v6e-1", max_prompt_len=2048, max_new_tokens=256)
    assert not plan.fits and not plan.programs
    assert 139e9 < plan.hbm["weights"] < 143e9  # 70.6B bf16 parameters
    assert "exceed" in plan.note
    assert json.loads(json.dumps(plan.to_dict()))["fits"] is False


def test_chip_programs_script_lowers_and_runs_the_programs(tmp_path):
    """scripts/chip_programs.py: `lower` writes generate's programs (torch_tpu's front end, no chip); `run` compiles
    and times them where JAX has a device. Here on XLA:CPU (a program with a Mosaic call cannot run there, so the
    tiny model takes eager attention), which checks the script's plumbing, not a chip's figures."""
    path = _saved(tmp_path, "llama")
    config = json.loads(Path(path, "config.json").read_text())
    Path(path, "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    script = str(HERE.parents[1] / "scripts" / "chip_programs.py")
    programs, measured = tmp_path / "programs.json", tmp_path / "measured.json"
    subprocess.run([sys.executable, script, "lower", path, str(programs), "--max-prompt-len", "16", "--max-new-tokens",
                    "8", "--dtype", "float32"], check=True)  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    subprocess.run([sys.executable, script, "run", str(programs), "--out", str(measured), "--platform", "cpu",
                    "--repeats", "2"], check=True, env=env)  # fmt: skip
    out = json.loads(measured.read_text())
    assert [p["name"] for p in out["programs"]] == ["prefill-16", "decode"]
    assert all("error" not in p and p["step_seconds_median"] > 0 for p in out["programs"]), out["programs"]
    assert out["facts"]["weights_bytes"] > 0 and out["weights_matvec"]["step_seconds_median"] > 0


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_encoder_bucket_graphs(lowered, family):
    """hf_tpu's bucketed encoder forward (hf_tpu.encoders): warm-up's two bucket graphs lower through torch_tpu and
    compile for v6e-1."""
    result = lowered[f"encoder-{family}"]
    _all_compiled(result, ["encoder-2x16", "encoder-2x32"])


_VISION_FIGURES = ("flops", "bytes_accessed", "argument_bytes", "output_bytes", "temp_bytes", "code_bytes")


@pytest.mark.parametrize(
    "family, names",
    [
        ("qwen2_vl", ["grid_vision", "mm_prefill+mrope", "decode+mrope"]),
        ("qwen3_vl", ["grid_vision", "mm_prefill+mrope", "decode+mrope"]),
        ("gemma3", ["vision", "mm_prefill+token_type_ids", "decode+token_type_ids"]),
        ("idefics3", ["padded_vision", "mm_prefill", "decode"]),
    ],
)
def test_vision_generate_graphs(lowered, family, names):
    """Warm-up's image graphs of a tiny Qwen2-VL (the tower on patch rows keyed by the grid, the host's segment
    bounds constants of the graph; prefill and decode on ids packed with three rows of positions) and a tiny Gemma 3
    (the tower on pixels; the prefill merging the features, with token types) lower through torch_tpu and compile
    for v6e-1. Their image prefill reads nothing on the host: upstream's check of image tokens against features (a
    tensor check, a host read in the graph that torch_tpu refuses to lower) runs on the host ids instead. The figures
    libtpu reports for each program are printed (docs/planning.md quotes them). A tiny Idefics3's: its padding images
    dropped on the host, the ``"padded_vision"`` graph on the real image and its pixel mask (upstream's encoder drops
    them with a boolean-mask index and reads per-row counts back with ``tolist()``, which torch_tpu refuses)."""
    result = lowered[f"vision-{family}"]
    _all_compiled(result, names)
    assert result.eager["device_to_host"] == 0 and result.eager["host_reads"] == 0, result.eager
    vision, prefill, decode = result.programs
    if family.startswith("qwen"):
        assert [[16, 96], "float32"] in vision.arguments, vision.arguments  # 16 patch rows of 3 x 2 x 4 x 4
        assert [[1, 64], "int64"] in prefill.arguments, prefill.arguments  # 16 ids and 3 rows of 16 positions
        assert [[1, 4], "int64"] in decode.arguments, decode.arguments  # one id and its 3 positions
    elif family == "idefics3":
        assert [[1, 3, 16, 16], "float32"] in vision.arguments, vision.arguments  # the real image
        assert [[1, 16, 16], "int64"] in vision.arguments, vision.arguments  # its mask of real pixels
        assert [[4, 32], "float32"] in prefill.arguments, prefill.arguments  # the 4 image tokens' features, a row each
    else:
        assert [[1, 3, 16, 16], "float32"] in vision.arguments, vision.arguments
        assert [[1, 4, 32], "float32"] in prefill.arguments, prefill.arguments  # the 4 image tokens' features
    for p in result.programs:
        print(f"{family} {p.name} v6e-1: " + ", ".join(f"{k}={getattr(p, k)}" for k in _VISION_FIGURES))


def test_torch_tpu_refusing_a_host_read_is_read_as_a_graph_that_cannot_compile(lowered):
    """A graph indexing by a boolean mask, one calling ``.item()`` on a value computed in it and one assigning a row per
    masked position (``x[mask] = rows``): torch_tpu refuses to lower each ("nonzero()/local_scalar_dense()/
    index_put_(): cannot record EventSnapshot during an FX trace", raised out of ``torch.compile`` as
    ``BackendCompilerFailed``), and hf_tpu's loops read that refusal as a graph that cannot be compiled, with the op
    and the source line (``_graphs._not_one_graph``; its route then takes the next loop, named). A masked fill with
    one value or a broadcast row (``x[mask] = 0``: transformers' vocabulary-parallel embedding) lowers and compiles.
    The simulator refuses and accepts the same graphs with the same words (tests/sim/test_compile_defaults.py)."""
    from hf_tpu._torch_tpu import HOST_READ_REFUSED  # (not hf_tpu.sim's: importing it enables the simulator)

    result = lowered["host_reads"]
    assert result.error is None, result.error
    refusals = result.info["refusals"]
    cases = (("mask", "nonzero", "_masked_double"), ("item", "local_scalar_dense", "_item_scaled"),
             ("rows", "index_put_", "_rows_put"))  # fmt: skip
    for name, op, line in cases:
        found = refusals[name]
        assert f"{op}(): {HOST_READ_REFUSED}" in (found["error"] or ""), found
        assert found["reason"].startswith(
            f"torch_tpu refuses graphs that read a device value on the host ({op} at _tpu_compile_entries.py:"
        ), found["reason"]
        assert found["reason"].endswith(f" in {line})"), found["reason"]
    assert refusals["fill"] == {"error": None, "reason": None}, refusals["fill"]
    _all_compiled(result, ["masked-fill"])


@pytest.mark.parametrize("family", ["lfm3_vl", "mistral3"])
def test_vision_graphs_sizing_splits_from_constants_read_nothing_on_the_host(lowered, family):
    """LFM3-VL's tower (a grid per image, the grid's values constants of the vision graph) reads the grid back with
    ``grid_thw.tolist()`` to shape its convolution per image, and Mistral 3's encoder splits its features with
    ``(torch.as_tensor(image_sizes) // ratio).prod(-1).tolist()``: tensors built from constants only, whose values
    hf_tpu folds to eager's numbers while tracing (hf_tpu/transformers/_tolist_fold.py). Traced as reads of device
    values (``aten._local_scalar_dense``), torch_tpu refused to lower LFM3-VL's graph ("cannot record EventSnapshot
    during an FX trace"); folded, its three graphs and Mistral 3's lower and compile for v6e-1 with no eager read."""
    result = lowered[f"vision-{family}"]
    _all_compiled(result, ["vision", "mm_prefill", "decode"])
    assert result.eager["device_to_host"] == 0 and result.eager["host_reads"] == 0, result.eager
    vision = result.programs[0]
    pixels = [[16, 96], "float32"] if family == "lfm3_vl" else [[1, 3, 16, 16], "float32"]
    assert pixels in vision.arguments, vision.arguments
    for p in result.programs:
        print(f"{family} {p.name} v6e-1: " + ", ".join(f"{k}={getattr(p, k)}" for k in _VISION_FIGURES))
