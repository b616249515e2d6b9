"""scripts/chip_torch_tpu.py: hf_tpu with torch_tpu itself on a chip. Its stage specs, what ``pack`` takes of
torch_tpu, and the ``generate`` stage on the simulated device (the stages that need torch_tpu's runtime run on a chip
only: docs/chip_v5e_torch_tpu.jsonl holds their records)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chip_torch_tpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("chip_torch_tpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_specs():
    s = _script()
    assert s.parse_stage("experts:200:SHAPE=mixtral,TOKENS=1_8_512") == (
        "experts", 200, {"SHAPE": "mixtral", "TOKENS": "1_8_512"})
    assert s.parse_stage("basics") == ("basics", 120, {})
    assert all(s.parse_stage(spec)[0] in s.STAGES for spec in s.DEFAULT_STAGES)
    with pytest.raises(ValueError, match="unknown stage 'expert'"):
        s.parse_stage("expert:10")
    with pytest.raises(ValueError, match="is not ENV=VALUE"):
        s.parse_stage("experts:10:SHAPE")


def test_pack_takes_torch_tpu_for_torch_2_13_only(tmp_path):
    s = _script()
    for rel in ("torch_tpu/__init__.py", "torch_tpu/_internal/compile/tpu_torch_compile_2_13_0.so",
                "torch_tpu/_internal/compile/tpu_torch_compile_2_14_0.so", "torch_tpu/csrc/common/libxla_base.so",
                "torch_tpu/csrc/common/glue_2_11_0/libpywrap_2_11_0_common.so", "torch_tpu/__pycache__/x.pyc",
                "torch_tpu-0.2.0.dist-info/METADATA", "torch-2.13.0.dist-info/METADATA"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert s.torch_tpu_members(tmp_path) == [
        "torch_tpu/__init__.py", "torch_tpu/_internal/compile/tpu_torch_compile_2_13_0.so",
        "torch_tpu/csrc/common/libxla_base.so", "torch_tpu-0.2.0.dist-info/METADATA"]  # fmt: skip


@pytest.mark.slow
def test_generate_stage_on_the_simulator(tmp_path):
    """The generate stage as a chip runs it, on the simulated device: its records say the tokens equal the CPU's, for
    the tiny Llama and for the MoE with the Hub kernel in every graph (its XLA form: the Pallas ones need a chip)."""
    env = dict(os.environ, HF_TPU_SIMULATE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path), "--stages", "generate:900",
                           "generate:900:CASE=moe_kernel,KERNEL_IMPL=xla"], env=env, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    runs = [r for r in records if r["step"] == "generate"]
    cases = [(r["case"], r["batch"]) for r in runs]
    assert cases == [("llama", 1), ("llama", 4), ("moe_kernel", 1), ("moe_kernel", 4)]
    assert all(r["equal"] for r in runs)
    assert {r["experts"] for r in runs if r["case"] == "moe_kernel"} == {"chip_kernel"}


def test_decode_models_are_the_lean_steps_shapes_and_the_lean_stage_runs_jax_alone(tmp_path, monkeypatch):
    """The decode stage's models are the shapes of chip_bench.py's lean JAX steps (the rows' references, measured in
    the same command by the ``lean`` stage); that stage runs in the machine's own JAX (its libtpu, the chip not kept
    from JAX), the torch_tpu stages with libtpu 0.0.52 first and JAX on the CPU."""
    import transformers

    s = _script()
    sys.path.insert(0, str(ROOT / "scripts"))
    import chip_bench

    for name, lean in (("llama", chip_bench.LLAMA_1B), ("qwen3_moe", chip_bench.QWEN3_MOE)):
        config_class, fields = s.DECODE_MODELS[name]
        c = getattr(transformers, config_class)(**fields)
        got = {"vocab": c.vocab_size, "hidden": c.hidden_size, "layers": c.num_hidden_layers,
               "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
               "tied": c.tie_word_embeddings}  # fmt: skip
        if name == "llama":
            got["intermediate"] = c.intermediate_size
        else:
            got.update(intermediate=c.moe_intermediate_size, experts=c.num_experts, top_k=c.num_experts_per_tok)
        assert got == lean, name
    monkeypatch.setattr(s, "CHIP_HOME", tmp_path)
    (tmp_path / "site").mkdir()
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    torch_tpu_env, lean_env = s.stage_env("llama_decode"), s.stage_env("lean")
    assert torch_tpu_env["JAX_PLATFORMS"] == "cpu" and torch_tpu_env["PYTHONPATH"].startswith(str(tmp_path / "libtpu"))
    assert "JAX_PLATFORMS" not in lean_env and lean_env["PYTHONPATH"] == str(ROOT)
    assert s.parse_stage("lean:200:BATCHES=1_64,MODELS=llama+moe") == ("lean", 200, {"BATCHES": "1_64",
                                                                                   "MODELS": "llama+moe"})


def test_the_prefill_flops_are_what_torchs_flop_counter_counts():
    """The prefill stage's FLOPs (its MFU's numerator): the projections and the last token's LM head equal torch's
    count of a forward with one row of logits; eager attention (QK^T and PV as whole products) counts the causal
    triangle twice."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    s = _script()
    config_class, fields = s.SMOKE_MODEL
    config = getattr(transformers, config_class)(**fields)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens = 48
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, tokens)), logits_to_keep=1)
    flops = s.prefill_flops(config, tokens)
    assert flops["total"] == flops["linear"] + flops["attention"] + flops["head"]
    assert counter.get_total_flops() == flops["linear"] + flops["head"] + 2 * flops["attention"]


@pytest.mark.slow
def test_the_serve_stage_loads_a_server_over_a_unix_socket_on_the_simulator(tmp_path):
    """The serve stage as a chip runs it, on the simulated device with the smoke model: the server on a unix socket
    answers every stream of each load with its tokens, compiles nothing after its warm-up, and the second server on
    the same compile cache compiles no graph."""
    env = dict(os.environ, HF_TPU_SIMULATE="1", MODEL="smoke", WORK=str(tmp_path / "work"), STREAMS="1 3", PROMPT="12",
               NEW="8", FLAGS="--slots+4+--kv-cache-gib+0.05+--min-step-tokens+64+--max-batch-tokens+64")  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--out", str(tmp_path / "out"), "--stages", "serve:900"],
                          env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    loads = [r for r in records if r["step"] == "load"]
    assert [(r["streams"], r["answered"], r["tokens"]) for r in loads] == [(1, 1, 8), (3, 3, 24)]
    assert all(r["compiles_after_warmup"] == 0 and r["tokens_per_s"] > 0 for r in loads)
    ready = {r["attempt"]: r for r in records if r["step"] == "ready"}
    assert ready["first"]["graphs_compiled"] == ready["first"]["step_shapes"] > 0
    assert ready["cached"]["graphs_compiled"] == 0
