"""A plain PyTorch training loop on the simulated tpu: AdamW, bf16 autocast, accumulation, clipping, checkpoints.

Every test runs the same loop on CPU in the same process and compares the losses step by step.
"""

from __future__ import annotations

import pytest
import torch
from _reference import without_hf_tpu
from train_helpers import examples

import hf_tpu.sim
from hf_tpu.training import BucketingCollator, load_checkpoint, save_checkpoint


def batches(n_batches: int, batch_size: int = 4, seed: int = 0, mask: bool = True) -> list[dict]:
    collate = BucketingCollator(buckets=(8, 16), pad_token_id=0, batch_size=batch_size, return_attention_mask=mask)
    data = examples(n_batches * batch_size, seed=seed)
    # Sort into buckets the way a length-grouped sampler would: short batches first, then long ones.
    data.sort(key=lambda ex: len(ex["input_ids"]))
    return [collate(data[i : i + batch_size]) for i in range(0, len(data), batch_size)]


def run(model, data, *, accumulate: int = 1, clip: float | None = 1.0, autocast: bool = False, optimizer=None):
    """Train over ``data`` (micro-batches); returns (per-optimizer-step mean losses, optimizer, step counters)."""
    device = next(model.parameters()).device
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, per_step, micro = [], [], []
    for i, batch in enumerate(data):
        batch = {k: v.to(device) for k, v in batch.items()}
        ctx = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if autocast
            else torch.autocast(device.type, enabled=False)
        )
        with hf_tpu.sim.stats() as s:
            with ctx:
                loss = model(**batch).loss / accumulate
            loss.backward()
            micro.append(loss.detach())
            if (i + 1) % accumulate == 0:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
        per_step.append(s.as_dict())
        if (i + 1) % accumulate == 0:
            losses.append(float(torch.stack(micro).sum().cpu()))  # one host sync per optimizer step
            micro = []
    return losses, opt, per_step


def test_adamw_fp32_matches_cpu_and_compiles_nothing_after_warmup(load):
    data = batches(6, mask=False)
    assert {tuple(b["input_ids"].shape) for b in data} == {(4, 8), (4, 16)}
    cpu_losses, _, _ = run(load("cpu"), data)
    tpu_losses, _, steps = run(load("tpu"), data)
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-5, atol=1e-5)
    # Right padding without a mask is the same loss as with it (the collator's return_attention_mask=False).
    masked, _, _ = run(load("cpu"), batches(6, mask=True))
    torch.testing.assert_close(masked, cpu_losses, rtol=1e-5, atol=1e-5)
    # After the first optimizer step, a batch of a shape seen before makes no new eager signature.
    seen, warm = set(), []
    for i, b in enumerate(data):
        if i > 0 and tuple(b["input_ids"].shape) in seen:
            warm.append(i)
        seen.add(tuple(b["input_ids"].shape))
    assert len(warm) >= 3
    assert [steps[i]["shape_signatures"] for i in warm] == [0] * len(warm), steps
    assert sum(s["compiles"] for s in steps) == 0


def test_bf16_autocast_matches_cpu_autocast(load):
    data = batches(3)
    cpu_losses, _, _ = run(load("cpu"), data, autocast=True)
    tpu_losses, _, _ = run(load("tpu"), data, autocast=True)
    fp32_losses, _, _ = run(load("cpu"), data)
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=2e-3, atol=2e-3)
    assert tpu_losses != fp32_losses  # autocast really ran in bf16


def test_gradient_accumulation_and_clipping_match_cpu(load):
    data = batches(4, batch_size=2)
    cpu_losses, _, _ = run(load("cpu"), data, accumulate=2, clip=0.05)
    tpu_losses, _, _ = run(load("tpu"), data, accumulate=2, clip=0.05)
    assert len(tpu_losses) == 2
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-5, atol=1e-5)
    # AdamW's first update barely depends on the gradient's scale; with SGD, clipping must show.
    sgd = {}
    for device, clip in (("tpu", 0.05), ("cpu", 0.05), ("tpu", None)):
        model = load(device)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sgd[device, clip] = run(model, data, accumulate=2, clip=clip, optimizer=opt)[0]
    torch.testing.assert_close(sgd["tpu", 0.05], sgd["cpu", 0.05], rtol=1e-5, atol=1e-5)
    assert abs(sgd["tpu", None][1] - sgd["tpu", 0.05][1]) > 1e-3


def test_checkpoint_resume_gives_the_same_next_loss(load, tmp_path):
    data = batches(4)
    model = load("tpu")
    full, _, _ = run(model, data)
    with without_hf_tpu():  # the uninterrupted run, on the CPU with upstream code only
        cpu_full, _, _ = run(load("cpu"), data)
    torch.testing.assert_close(full, cpu_full, rtol=1e-5, atol=1e-5)

    model = load("tpu")
    _, opt, _ = run(model, data[:2])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ckpt = save_checkpoint(tmp_path / "step-2", model, opt, sched, step=2, note="x")
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "training_state.safetensors").is_file()
    assert not list(ckpt.glob("*.pt")) and not list(ckpt.glob("*.bin"))

    fresh = load("tpu")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    info = load_checkpoint(ckpt, fresh, fresh_opt, torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 1.0))
    assert info == {"step": 2, "note": "x"}
    assert all(p.device.type == "tpu" for p in fresh.parameters())
    state = next(iter(fresh_opt.state.values()))
    assert state["exp_avg"].device.type == "tpu"
    resumed, _, _ = run(fresh, data[2:], optimizer=fresh_opt)
    assert resumed == pytest.approx(full[2:], abs=1e-6)
    torch.testing.assert_close(resumed, cpu_full[2:], rtol=1e-5, atol=1e-5)
    # Weights alone give the same next loss, but not the one after: the optimizer state was needed.
    cold = load("tpu")
    load_checkpoint(ckpt, cold)
    cold_loss, _, _ = run(cold, data[2:])
    assert cold_loss[0] == pytest.approx(full[2], abs=1e-6) and cold_loss[1] != pytest.approx(full[3], abs=1e-6)


def test_compiled_training_step_matches_cpu_and_compiles_once(load):
    data = batches(3, mask=False)[-2:] * 2  # one shape, 4 steps
    assert len({tuple(b["input_ids"].shape) for b in data}) == 1
    cpu_losses, _, _ = run(load("cpu"), data)
    model = load("tpu")
    model.config.use_cache = False  # no DynamicCache in a training forward (dynamo cannot build one on tpu)
    compiled = torch.compile(model, backend="tpu", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, steps = [], []
    for batch in data:
        with hf_tpu.sim.stats() as s:
            loss = compiled(**{k: v.to("tpu") for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        steps.append(s.as_dict())
        losses.append(float(loss.detach().cpu()))
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-4, atol=1e-4)
    assert steps[0]["compiles"] >= 1
    assert [s["compiles"] for s in steps[1:]] == [0, 0, 0]
    assert [s["shape_signatures"] for s in steps[2:]] == [0, 0]


def test_activation_checkpointing_matches_cpu(load):
    data = batches(2, mask=False)
    losses = {}
    for device in ("cpu", "tpu"):
        model = load(device)
        model.config.use_cache = False
        model.activation_checkpointing_enable()
        model.train()
        losses[device] = run(model, data)[0]
    assert model.is_activation_checkpointing
    torch.testing.assert_close(losses["tpu"], losses["cpu"], rtol=1e-5, atol=1e-5)
