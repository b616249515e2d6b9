"""``hf-tpu plan --train`` end to end on a tiny Llama: one training step traced on the meta device, lowered by
torch-tpu 0.2.0's real front end and compiled by libtpu for a v6e-8 device, with fp32 parameters and bf16 compute
(FSDP2's mixed precision); the plan's figures, and which of them
are the compiler's. The traced step's numerics against torch's own training step are checked on the CPU in
tests/tpu_compile/test_train_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys

from hf_tpu.testing import tiny_config


def test_plan_train_command_compiles_the_step_and_labels_its_sources(tmp_path):
    config = tiny_config("llama")
    config.save_pretrained(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", "plan", str(tmp_path), "--train", "--target", "v6e-8", "--batch", "2",
         "--seq-len", "16", "--dtype", "float32", "--compute-dtype", "bfloat16", "--json"], capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["kind"] == "train" and plan["shards"] == 8 and plan["error"] is None
    programs = {p["name"]: p for p in plan["programs"]}
    assert list(programs) == ["train-forward-backward", "optimizer-adamw"]
    for p in programs.values():
        assert p["lowered"] and p["compiled"], p["error"]
        assert p["flops"] > 0 and p["compile_seconds"] > 0

    info, mem = plan["info"], plan["memory"]
    assert info["compute_dtype"] == "bfloat16" and info["dtype"] == "float32"
    assert info["grads_bytes"] == 4 * info["parameters"]  # fp32 gradients of fp32 parameters, nothing frozen
    assert 0 <= info["params_bytes"] - info["grads_bytes"] <= 1024  # and the buffers (RoPE's inv_freq)
    one, fsdp = mem["one_device"], mem["fsdp"]
    # the compiler's: the gradients come out of the forward-backward program (tile padding makes them no smaller)
    assert one["compiler_gradients_out"] >= info["grads_bytes"]
    fwbw, opt = programs["train-forward-backward"], programs["optimizer-adamw"]
    assert one["activations"] == fwbw["temp_bytes"] > 0
    # the optimizer program reads parameters, gradients and both moments: at least 4x the parameters' bytes
    assert opt["argument_bytes"] >= 4 * info["params_bytes"]
    assert one["total"] >= one["compiler_fwbw_peak"] + info["optimizer_bytes"]
    # FSDP over 8: arithmetic on those figures
    assert fsdp["params"] == info["params_bytes"] // 8 and fsdp["optimizer_state"] == info["optimizer_bytes"] // 8
    assert fsdp["activations"] == one["activations"]
    assert "compiler" in mem["source"] and "arithmetic" in mem["source"]
    assert "compiled program 2 of 2" in proc.stderr  # progress on stderr, the object alone on stdout
