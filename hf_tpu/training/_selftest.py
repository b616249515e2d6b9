"""Self-test check of training on the TPU (see :mod:`hf_tpu.selftest`): a few AdamW steps against CPU.

A tiny Llama trains 4 steps on fixed-shape batches (``BucketingCollator``) on the device and on the CPU; the losses
must agree step by step, and after the first step no step may compile anything new (on the simulator: no new eager
shape signature and no graph compile). A 2-step ``transformers.Trainer`` run checks that the model stays on the TPU.
"""

from __future__ import annotations

import tempfile
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check

_STEPS = 4


def _batches():
    import torch

    from hf_tpu.training.collator import BucketingCollator

    g = torch.Generator().manual_seed(0)
    collate = BucketingCollator(buckets=(16,), pad_token_id=0, batch_size=4, return_attention_mask=False)
    rows = [{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in (9, 16, 12, 16) * _STEPS]
    return [collate(rows[i : i + 4]) for i in range(0, len(rows), 4)]


def _train(model, batches, ctx: CheckContext | None, figures: dict[str, Any]) -> list[float]:
    import torch

    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for i, batch in enumerate(batches):

        def step(batch: dict = batch) -> float:
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return float(loss.detach().cpu())

        if ctx is None:
            losses.append(step())
        else:
            with ctx.measure(figures, f"step{i}"):
                losses.append(step())
    return losses


@register_check("training", description="AdamW steps on the device match CPU; no compile after step 1", order=70)
def _training(ctx: CheckContext) -> dict[str, Any]:
    if ctx.info.mode == "none":
        raise SkipCheck("no tpu device (see the runtime check)")
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tpu._patch import enabled
    from hf_tpu.testing import tiny_model

    batches = _batches()
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_train_") as path:
        tiny_model("llama", path, max_position_embeddings=64, use_cache=False)
        expected = _train(AutoModelForCausalLM.from_pretrained(path), batches, None, raw)
        got = _train(AutoModelForCausalLM.from_pretrained(path).to(ctx.device), batches, ctx, raw)
        diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
        figures: dict[str, Any] = {"steps": _STEPS, "max_loss_diff": diff, "cold_step_s": raw["step0_s"]}
        # float32 at the matmul precision in force (a TPU's default, 'medium', is one bfloat16 pass; the simulator
        # computes the same): forward, backward and AdamW, as deep as 2 layers' worth of products
        ctx.compare(torch.tensor(got), torch.tensor(expected), figures, layers=2, what="the losses")
        figures["warm_step_s"] = round(sum(raw[f"step{i}_s"] for i in range(1, _STEPS)) / (_STEPS - 1), 6)
        if ctx.simulated:
            for key in ("compiles", "shape_signatures"):
                figures[f"cold_{key}"] = raw[f"step0_{key}"]
                figures[f"warm_{key}_per_step"] = sum(raw[f"step{i}_{key}"] for i in range(1, _STEPS)) / (_STEPS - 1)
            if figures["warm_compiles_per_step"] or figures["warm_shape_signatures_per_step"]:
                raise CheckFailed(f"steps after the first compiled something new: {raw}")

        from transformers import Trainer, TrainingArguments

        with enabled("training"):
            args = TrainingArguments(
                output_dir=f"{path}/trainer", per_device_train_batch_size=4, max_steps=2, report_to=[],
                save_strategy="no", disable_tqdm=True,
            )  # fmt: skip
            rows = [
                dict(zip(("input_ids", "labels"), (b["input_ids"][r], b["labels"][r])))
                for b in batches
                for r in range(4)
            ]
            trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(path).to(ctx.device), args=args,
                              train_dataset=rows)  # fmt: skip
            trainer.train()
            where = next(trainer.model.parameters()).device
            if where.type != "tpu":
                raise CheckFailed(f"Trainer moved the model to {where}")
            figures["trainer_device"] = str(where)
    return figures
