"""hf-tpu plan --train without torch-tpu: the traced step computes what torch's own training step computes (on the
CPU, against loss.backward() and torch.optim.AdamW), the plan's arithmetic and labels, and the CLI's refusal when
torch-tpu is missing (the compile tier in tests/contract lowers and compiles the step for real)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from hf_tpu.cli.main import main
from hf_tpu.testing import tiny_config
from hf_tpu.tpu_compile import target
from hf_tpu.tpu_compile._train import BETAS, EPS, LR, WEIGHT_DECAY, trace_step
from hf_tpu.tpu_compile.programs import ProgramRecord
from hf_tpu.tpu_compile.train_plan import TrainPlan


def test_the_traced_step_is_torchs_training_step():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    (_, fwbw, _), (_, adamw, _) = trace_step(model, 2, 8)
    params = [p.detach().clone() for p in model.parameters()]
    loss, *grads = fwbw(*params, ids)

    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)

    zeros = [torch.zeros_like(p) for p in params]
    out = adamw(*params, *grads, *zeros, *zeros, torch.zeros(()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  foreach=False)  # fmt: skip
    optimizer.step()
    n = len(params)
    for new, p in zip(out[:n], model.parameters()):
        torch.testing.assert_close(new, p.detach(), rtol=1e-5, atol=1e-7)
    for m, p in zip(out[n : 2 * n], model.parameters()):
        torch.testing.assert_close(m, optimizer.state[p]["exp_avg"])
    assert float(out[-1]) == 1.0


def _program(name, *, args, out, temp):
    return ProgramRecord(name, lowered=True, compiled=True, lower_seconds=1.0, compile_seconds=2.0, flops=1e12,
                         bytes_accessed=1e9, argument_bytes=args, output_bytes=out, alias_bytes=0, temp_bytes=temp)  # fmt: skip


def test_one_device_from_the_compiler_and_fsdp_by_arithmetic():
    gb = 10**9
    info = {"params_bytes": 16 * gb, "grads_bytes": 16 * gb, "optimizer_bytes": 32 * gb, "largest_layer_bytes": gb // 2,
            "model_type": "llama", "parameters": 8 * 10**9, "dtype": "bfloat16", "batch": 1, "seq_len": 2048}  # fmt: skip
    fwbw = _program("train-forward-backward", args=16 * gb, out=16 * gb, temp=6 * gb)
    opt = _program("optimizer-adamw", args=64 * gb, out=64 * gb, temp=0)
    plan = TrainPlan(target("v6e-8"), "m", 8, [fwbw, opt], info)
    mem = plan.memory()
    assert mem["one_device"]["activations"] == 6 * gb  # the compiler's temporaries of the forward-backward program
    assert mem["one_device"]["total"] == max(16 * gb + 16 * gb + 6 * gb + 32 * gb, 128 * gb)
    fsdp = mem["fsdp"]
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer_state"]) == (2 * gb, 2 * gb, 4 * gb)
    assert fsdp["fsdp_gathered"] == 3 * gb // 2 and fsdp["total"] == 8 * gb + 6 * gb + 3 * gb // 2
    assert plan.fits() == {"one_device": False, "fsdp": True}
    text = plan.table()
    assert "FSDP over 8" in text and "arithmetic" in text and "compiler" in text
    assert plan.to_dict()["memory"]["source"]["arithmetic"].startswith("params")


def test_train_plan_refuses_clearly_without_torch_tpu(tmp_path, capsys, monkeypatch):
    tiny_config("llama").save_pretrained(tmp_path)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)  # this venv has no torch-tpu; be sure of it
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch_tpu", "libtpu", "jax") else real(name, *a))  # fmt: skip
    assert main(["plan", str(tmp_path), "--train", "--target", "v6e-8"]) == 1  # could not plan
    err = capsys.readouterr().err
    assert "needs torch-tpu" in err and "pip install 'hf-tpu[tpu]'" in err and "Nothing was planned" in err


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_gradients():
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    (_, fwbw, _), _ = trace_step(model, 2, 8, torch.bfloat16)
    loss, *grads = fwbw(*[p.detach().clone() for p in model.parameters()], ids)

    half = copy.deepcopy(model).to(torch.bfloat16)  # the reference: the same weights in bf16, eager backward
    expected = half(input_ids=ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss.float(), expected.detach().float())
    for g, p in zip(grads, half.parameters()):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.to(torch.bfloat16), p.grad, rtol=2e-2, atol=1e-3)
