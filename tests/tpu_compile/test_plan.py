"""hf-tpu plan's arithmetic and its refusals, without torch-tpu (the compile tier in tests/contract runs the real
lowering and libtpu): the fit, the decode step's projection and floor, the table, the JSON object, the targets."""

from __future__ import annotations

import json

import pytest

from hf_tpu.cli.main import main
from hf_tpu.errors import UserError
from hf_tpu.tpu_compile import TARGETS, UnknownTargetError, target
from hf_tpu.tpu_compile.plan import STREAMING, _plan_from, human, plan_generate
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
    assert summary["projected_ms"] == plain["projected_ms"]  # the headline stays the floor's
    assert summary["hbm_over_floor"] == pytest.approx(1.6e10 / (15.5 * GB))
    assert summary["projected_ms_from_hbm"] == pytest.approx(1.6e10 / target("v6e-1").hbm_bandwidth * 1e3)
    assert "of which HBM traffic" in plan.table()


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
    assert not plan.fits and plan.error == "no program compiled"
    assert "refused" in plan.table()


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
