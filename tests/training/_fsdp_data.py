"""The runs of the FSDP2 tests, shared by the test process (one process, the whole batch) and the launched ranks."""

from __future__ import annotations

import torch
from train_helpers import SEQ, Losses, examples

from hf_tpu.training import BucketingCollator

GLOBAL_BATCH = 8
LR = 3e-3
FSDP = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}


def data(steps: int) -> list[dict]:
    """``steps`` global batches of full-length rows (every rank's slice has the same number of tokens)."""
    return examples(steps * GLOBAL_BATCH, lengths=(SEQ,), seed=3)


def collator() -> BucketingCollator:
    return BucketingCollator(buckets=(SEQ,), pad_token_id=0, return_attention_mask=False)


def trainer_args(output_dir: str, steps: int, world: int, use_cpu: bool = False, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, report_to=[],
        seed=0, use_cpu=use_cpu, **{"save_strategy": "no", **extra},
    )  # fmt: skip


def run_trainer(
    model, steps: int, world: int, output_dir: str, use_cpu: bool = False, resume_from_checkpoint=None, **extra
):
    """Train ``model`` with the Trainer for ``steps`` steps of ``GLOBAL_BATCH`` rows in all; returns
    ``(trainer, {"losses", "after_first", "memory"})``: the logged loss of each step, the simulator's counters summed
    over the steps after the first, and :class:`~hf_tpu.training.MemoryReport`'s record of the first step."""
    from transformers import Trainer

    from hf_tpu.training import MemoryReport, StepCounters

    log, counters, memory = Losses(), StepCounters(), MemoryReport()
    trainer = Trainer(
        model=model, args=trainer_args(output_dir, steps, world, use_cpu=use_cpu, **extra),
        train_dataset=data(steps), data_collator=collator(), callbacks=[log, counters, memory],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, {"losses": log.values, "after_first": counters.after(1), "memory": memory.values}


def accelerate_loop(model, steps: int, fsdp: bool = True, cpu: bool = False, memory: dict | None = None) -> list[float]:
    """A plain loop over ``steps`` global batches in order (accelerate gives each rank its slice), AdamW, gradient
    clipping at 1.0: with ``fsdp``, ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))``;
    returns the mean loss over the ranks of every step. ``memory`` (a dict) receives the peak device bytes during
    ``prepare`` (the model is wrapped from the host) and the live bytes after it."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap") if fsdp else None
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=cpu)
    per_rank = GLOBAL_BATCH // accelerator.num_processes
    loader = torch.utils.data.DataLoader(data(steps), batch_size=per_rank, shuffle=False, collate_fn=collator())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    if memory is not None:
        torch.accelerator.reset_peak_memory_stats()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if memory is not None:
        memory.update(peak=torch.accelerator.max_memory_allocated(), live=torch.accelerator.memory_allocated())
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean").cpu()))
    return losses
