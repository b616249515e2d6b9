"""hf-tpu plan's arithmetic and its refusals, without torch-tpu (the compile tier in tests/contract runs the real
lowering and libtpu): the fit, the decode step's projection and floor, the table, the JSON object, the targets."""

from __future__ import annotations

import json

import pytest

from hf_tpu.cli.main import main
from hf_tpu.errors import UserError
from hf_tpu.tpu_compile import TARGETS, UnknownTargetError, target
from hf_tpu.tpu_compile.plan import EXIT_COULD_NOT_PLAN, EXIT_DOES_NOT_FIT, STREAMING, _plan_from, human, plan_generate
from hf_tpu.tpu_compile.programs import LoweringResult, ProgramRecord

GB = 10**9


def _program(name, *, args, out, alias=0, temp, flops, moved, optimal=-9.0):
    return ProgramRecord(name, lowered=True, compiled=True, lower_seconds=1.0, compile_seconds=2.0, flops=flops,
                         bytes_accessed=moved, optimal_seconds=optimal, argument_bytes=args, output_bytes=out,
                         alias_bytes=alias, temp_bytes=temp, code_bytes=1)  # fmt: skip


def _result(programs, **info):
    base = {"weights_bytes": 16 * GB, "kv_cache_bytes": GB // 2, "gathered_embedding_bytes": GB, "model_type": "llama",
            "parameters": 8 * 10**9, "dtype": "bfloat16", "prompt_bucket": 2048}  # fmt: skip
    return LoweringResult(target("v6e-1"), programs, {**base, **info}, {})


def test_fit_counts_weights_cache_and_the_largest_programs_extra():
    prefill = _program("prefill-2048", args=int(16.5 * GB), out=GB // 2, temp=GB, flops=3e13, moved=5e10)
    decode = _program("decode", args=int(16.5 * GB), out=GB // 2, temp=GB // 4, flops=4e10, moved=2e10)
    plan = _plan_from(_result([prefill, decode]), "m", 1, 2048, 256, None)
    assert plan.hbm["temporaries"] == GB + GB // 2  # prefill: temps + the outputs not aliased to an input
    assert plan.hbm["total"] == 16 * GB + GB // 2 + GB + GB // 2
    assert plan.fits and plan.error is None
    summary = plan.decode_summary()
    # the floor (which leaves out the gathered embeddings) at the streaming rate a chip reaches; XLA's bytes
    # accessed over the HBM bandwidth beside it (XLA gave no optimal_seconds)
    assert summary["floor_bytes"] == 15 * GB + GB // 2
    assert summary["projected_ms"] == pytest.approx(15.5 * GB / (target("v6e-1").hbm_bandwidth * STREAMING) * 1e3)
    assert summary["projected_ms_from_bytes_accessed"] == pytest.approx(2e10 / target("v6e-1").hbm_bandwidth * 1e3)
    assert summary["bytes_over_floor"] == pytest.approx(2e10 / (15.5 * GB))
    text = plan.table()
    assert "FITS" in text and "estimate" in text and "decode" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["fits"] is True and set(data["hbm_bytes"]) == {"capacity", "weights", "kv_cache", "temporaries", "total"}
    assert [p["name"] for p in data["programs"]] == ["prefill-2048", "decode"]


def test_with_the_dumped_hlo_the_step_also_says_its_hbm_traffic():
    decode = _program("decode", args=int(16.5 * GB), out=GB // 2, temp=GB // 4, flops=4e10, moved=2e10)
    plain = _plan_from(_result([decode]), "m", 1, 2048, 256, None).decode_summary()
    assert "hbm_bytes" not in plain
    decode.hbm_bytes = 1.6e10  # what hf_tpu.tpu_compile.hlo_bytes found in libtpu's placement
    plan = _plan_from(_result([decode]), "m", 1, 2048, 256, None)
    summary = plan.decode_summary()
    # the HBM traffic exceeds the floor (15.5 GB): the headline streams it at the chip's rate instead
    rate = target("v6e-1").hbm_bandwidth * STREAMING
    assert plain["projected_from"] == "floor_bytes" and summary["projected_from"] == "hbm_bytes"
    assert summary["projected_ms"] == pytest.approx(1.6e10 / rate * 1e3)
    assert summary["projected_ms"] > plain["projected_ms"]
    assert summary["hbm_over_floor"] == pytest.approx(1.6e10 / (15.5 * GB))
    assert summary["projected_ms_from_hbm"] == pytest.approx(summary["projected_ms"])
    assert "of which HBM traffic" in plan.table() and "its HBM traffic at the chip's streaming rate" in plan.table()
    decode.hbm_bytes = 1.0e10  # less than the floor (the chip cannot read less than the weights): the floor stays
    again = _plan_from(_result([decode]), "m", 1, 2048, 256, None).decode_summary()
    assert again["projected_from"] == "floor_bytes" and again["projected_ms"] == plain["projected_ms"]


def test_without_the_hlo_a_batched_plan_says_the_floor_leaves_out_the_cache_copy():
    decode = _program("decode", args=int(16.5 * GB), out=GB // 2, temp=GB // 4, flops=4e10, moved=2e10)
    one = _plan_from(_result([decode]), "m", 1, 2048, 256, None).table()
    eight = _plan_from(_result([decode], batch=8), "m", 8, 2048, 256, None).table()
    assert "--dump-hlo projects" not in one and "copies its KV caches" in eight and "--dump-hlo projects" in eight


def test_a_moe_decode_floor_reads_the_routed_experts_only():
    """A MoE's decode reads the experts its batch routes to: E x (1 - (1 - k/E)^batch) of each layer's E."""
    decode = _program("decode", args=int(11 * GB), out=0, temp=0, flops=1e9, moved=3e10)
    moe = {"weights_bytes": 11 * GB, "kv_cache_bytes": 0, "gathered_embedding_bytes": GB, "experts_bytes": 9 * GB,
           "num_experts": 128, "top_k": 8}  # fmt: skip
    one = _plan_from(_result([decode], **moe), "m", 1, 512, 128, None)
    assert one.decode_floor_bytes() == pytest.approx(10 * GB - 9 * GB * (1 - 8 / 128), rel=1e-9)
    every = _plan_from(_result([decode], **moe), "m", 64, 512, 128, None)
    assert one.decode_floor_bytes() < every.decode_floor_bytes() < 10 * GB
    assert every.decode_floor_bytes() == pytest.approx(10 * GB - 9 * GB * (1 - 8 / 128) ** 64, rel=1e-9)


def test_compute_bound_step_and_a_compiler_estimate_win():
    flops_bound = _program("decode", args=GB, out=0, temp=0, flops=9.18e14, moved=1e6)  # one second of v6e peak
    plan = _plan_from(_result([flops_bound]), "m", 1, 16, 8, None)
    assert plan.step_seconds(flops_bound) == pytest.approx(1.0)
    known = _program("decode", args=GB, out=0, temp=0, flops=1.0, moved=1.0, optimal=0.25)
    assert _plan_from(_result([known]), "m", 1, 16, 8, None).step_seconds(known) == 0.25


def test_a_pipeline_plan_is_its_denoiser_step():
    step = _program("denoiser-1024x1024", args=int(4.2 * GB), out=GB // 8, temp=GB // 2, flops=9.18e13, moved=8e9)
    result = _result([step], weights_bytes=int(15.5 * GB), kv_cache_bytes=0, denoiser_bytes=4 * GB,
                     model_type="StableDiffusion3Pipeline", denoisers=["transformer"], height=1024, width=1024)  # fmt: skip
    plan = _plan_from(result, "sd3", 1, None, None, None)
    plan.kind = "pipeline"
    assert plan.decode_summary() is None
    summary = plan.step_summary()
    assert summary["projected_ms"] == pytest.approx(100.0)  # 0.1 s of v6e's bf16 peak: compute bound
    assert summary["bytes_over_floor"] == pytest.approx(2.0)
    text = plan.table()
    assert "1024x1024, denoiser transformer" in text and "denoiser step" in text and "KV cache" not in text
    assert json.loads(json.dumps(plan.to_dict()))["step"]["floor_bytes"] == 4 * GB


def test_plan_pipeline_wants_a_pipeline_directory(tmp_path):
    from hf_tpu.tpu_compile.plan import plan_pipeline

    with pytest.raises(UserError, match="model_index.json"):
        plan_pipeline(tmp_path)


def test_too_big_is_reported_without_programs():
    result = _result([], weights_bytes=141 * GB, kv_cache_bytes=0, kv_cache_estimate=GB,
                     skipped="the weights and KV cache alone exceed the chip's HBM: nothing was lowered")  # fmt: skip
    plan = _plan_from(result, "m", 1, 2048, 256, None)
    assert not plan.fits and plan.programs == [] and "exceed" in plan.note
    assert "DOES NOT FIT" in plan.table()


def test_a_failed_program_is_a_plan_error():
    broken = ProgramRecord("prefill-16", lowered=True, compiled=False, error="XlaRuntimeError: refused")
    plan = _plan_from(_result([broken]), "m", 1, 16, 8, None)
    assert not plan.fits and "prefill-16 did not compile: XlaRuntimeError: refused" in plan.error
    assert plan.verdict == "could not plan" and plan.exit_status == EXIT_COULD_NOT_PLAN
    assert "refused" in plan.table() and "COULD NOT PLAN" in plan.table()


def test_one_failed_program_of_two_is_not_a_fit():
    """The decode compiled, the prefill did not (not for memory): the run cannot be planned, whatever the decode's
    bytes say."""
    decode = _program("decode", args=int(16.5 * GB), out=GB // 2, temp=GB // 4, flops=4e10, moved=2e10)
    broken = ProgramRecord("prefill-2048", lowered=True, compiled=False, error="JaxRuntimeError: INTERNAL: boom")
    plan = _plan_from(_result([broken, decode]), "m", 1, 2048, 256, None)
    assert not plan.fits and plan.verdict == "could not plan" and plan.exit_status == EXIT_COULD_NOT_PLAN
    assert "prefill-2048" in plan.error and "boom" in plan.error
    assert json.loads(json.dumps(plan.to_dict()))["fits"] is False


# libtpu 0.0.52's words for the Llama-3-8B shape's prefill-2048 on v5e-1 (`hf-tpu plan llama-3-8b-shape --target v5e-1`)
OOM = ("JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
       "required for HLO temporaries (16.63G) exceeds available HBM (15.75G). HLO module: "
       "tt_jit__graphs_L43C0__last_logits_argmax.\nSee https://openxla.org/xla/errors/error_1000 for more details.")


def _eight_b_on_v5e(batch=1):
    """The 8B shape's plan for v5e-1 as recorded: the decode compiled, the prefill refused for HBM."""
    decode = _program("decode", args=16_362_513_152, out=301_990_144, alias=0, temp=13_637_888, flops=35.52e9,
                      moved=29.54e9)  # fmt: skip
    prefill = ProgramRecord("prefill-2048", lowered=True, compiled=False, error=OOM)
    info = {"weights_bytes": 16_060_523_008, "kv_cache_bytes": 301_990_144, "gathered_embedding_bytes": 1_050_673_152,
            "gathered_embedding_parameters": 525_336_576, "parameters": 8_030_261_248,
            "prompt_buckets": [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]}  # fmt: skip
    result = LoweringResult(target("v5e-1"), [prefill, decode], {**_result([]).info, **info}, {})
    return _plan_from(result, "llama-3-8b-shape", batch, 2048, 256, None)


def test_a_program_out_of_hbm_does_not_fit_and_says_what_would():
    plan = _eight_b_on_v5e()
    assert not plan.fits and plan.verdict == "does not fit" and plan.exit_status == EXIT_DOES_NOT_FIT == 3
    assert plan.error is None  # known, not unplanned
    needed, available = 16.63 * 2**30, 15.75 * 2**30
    assert plan.out_of_memory == {"prefill-2048": {"needed": pytest.approx(needed), "available": available}}
    assert plan.hbm["total"] == int(needed) > plan.hbm["capacity"]
    text = plan.table()
    assert "DOES NOT FIT" in text and "prefill-2048 is out of HBM: needs 17.86 GB of 16.91 GB" in text
    tips = "\n".join(plan.suggestions)
    # 16.91 - 16.36 GB left for a prefill whose own bytes are 17.86 - 16.36 GB: 0.367 of 2048 tokens, 752; its bucket
    assert "--max-prompt-len 512 (" in tips and "about 752 would fit" in tips, tips
    assert "--quantization int8" in tips and "about 8.56 GB instead of 16.06 GB" in tips  # the embedding stays bf16
    assert "--target v6e-1" in tips and "--target v5e-4" in tips
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["fits"] is False and data["verdict"] == "does not fit" and data["exit_status"] == 3
    assert data["out_of_memory"]["prefill-2048"]["needed"] == pytest.approx(needed)


def test_the_decode_flops_are_compared_with_the_matrix_products():
    """XLA's count of the 8B decode at batch 1 is 2.37x 2 x parameters: libtpu rewrites each one-row product as
    elementwise ops and counts 5 per weight (tests/contract checks the 2.5x on a plain product)."""
    summary = _eight_b_on_v5e().decode_summary()
    assert summary["matmul_flops"] == 2 * (8_030_261_248 - 525_336_576)
    assert summary["flops_over_matmul"] == pytest.approx(35.52e9 / summary["matmul_flops"])
    assert "2.37x the token's matrix products" in _eight_b_on_v5e().table()


def test_plan_exit_statuses(tmp_path, monkeypatch, capsys):
    from hf_tpu.tpu_compile import plan as plan_module

    (tmp_path / "config.json").write_text("{}")
    fitting = _plan_from(_result([_program("decode", args=GB, out=0, temp=0, flops=1.0, moved=1.0)]), "m", 1, 16, 8,
                         None)  # fmt: skip
    broken = _plan_from(_result([ProgramRecord("decode", lowered=False, error="TypeError: x")]), "m", 1, 16, 8, None)
    monkeypatch.setattr(plan_module, "require_packages", lambda *a: None)  # the recorded plans need no torch-tpu
    for plan, status in ((fitting, 0), (_eight_b_on_v5e(), 3), (broken, 1)):
        monkeypatch.setattr(plan_module, "plan_generate", lambda *a, plan=plan, **k: plan)
        assert main(["plan", str(tmp_path), "--json"]) == status
        assert json.loads(capsys.readouterr().out)["exit_status"] == status
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert "0 fits" in helped and "3 does not fit" in helped and "1 could not plan" in helped


def test_a_missing_package_names_its_extra_and_plans_nothing(tmp_path, monkeypatch, capsys):
    import importlib.util

    (tmp_path / "config.json").write_text("{}")
    real = importlib.util.find_spec
    for absent, extra, flags in (("torchao", "hf-tpu[quant]", ["--quantization", "int8"]),
                                 ("torch_tpu", "hf-tpu[tpu]", [])):  # fmt: skip
        def find_spec(name, *args, absent=absent):
            if name == absent:
                return None
            return object() if name in ("torch_tpu", "libtpu", "jax", "torchao") else real(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        assert main(["plan", str(tmp_path), *flags]) == EXIT_COULD_NOT_PLAN
        out = capsys.readouterr()
        assert out.out == ""  # no plan of 0 bytes
        [line] = out.err.strip().splitlines()
        assert extra in line and "Nothing was planned" in line


def test_targets_and_units():
    assert target("v6e-1").hbm_bytes == 32 * 2**30 and target("v6e-4").topology == "v6e:2x2"
    assert target("tpu7x-4").devices_per_chip == 2 and target("tpu7x-4").hbm_bytes == 96 * 2**30
    assert all(t.chips >= 1 and t.hbm_bandwidth > 0 for t in TARGETS.values())
    with pytest.raises(UnknownTargetError, match="v6e-1"):
        target("v9")
    assert human(16.06e9) == "16.06 GB" and human(302e6) == "302.0 MB" and human(12) == "12 B"


def test_bad_input_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        plan_generate(tmp_path / "nothing-here")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="int8"):
        plan_generate(tmp_path, quantization="int3")
    with pytest.raises(SystemExit):
        main(["plan", str(tmp_path), "--target", "v9"])  # argparse names the choices


def test_the_total_is_the_sum_of_the_lines_above_it_when_libtpu_refused_a_program():
    """The 8B shape on v5e-1: libtpu's 17.86 GB for the refused prefill is more than weights + KV cache + the
    decode's temporaries; a 'more needed' line carries the difference, so that the lines add up to the total."""
    import re

    text = _eight_b_on_v5e().table()
    figures = {}
    for line in text.splitlines():
        found = re.match(r"  (weights|KV cache|temporaries|more needed|total) +([0-9.]+) (GB|MB)", line)
        if found:
            figures[found[1]] = float(found[2]) / (1000 if found[3] == "MB" else 1)
    assert "more needed" in figures and "prefill-2048" in text.split("more needed")[1].splitlines()[0]
    parts = sum(v for k, v in figures.items() if k != "total")
    assert parts == pytest.approx(figures["total"], abs=0.011)  # each figure rounded to 0.01 GB
