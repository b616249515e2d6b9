"""The global batches of the data-parallel test, shared by the test (one chip) and its ranks."""

from __future__ import annotations

import torch
from train_helpers import SEQ, Losses, examples

from hf_tpu.training import BucketingCollator

GLOBAL_BATCH = 8
LR = 3e-3


def global_batches(steps: int) -> list[dict]:
    """``steps`` batches of ``GLOBAL_BATCH`` full-length rows (every slice has the same number of tokens)."""
    collate = BucketingCollator(buckets=(SEQ,), pad_token_id=0, return_attention_mask=False)
    data = examples(steps * GLOBAL_BATCH, lengths=(SEQ,), seed=3)
    return [collate(data[i : i + GLOBAL_BATCH]) for i in range(0, len(data), GLOBAL_BATCH)]


def train(model, batches: list[dict], reduce=None, sync=None) -> list[float]:
    """AdamW over ``batches`` on the model's device; ``reduce`` turns a local loss into the global one, ``sync(model)``
    averages the gradients over the ranks."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        if sync is not None:
            sync(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float((reduce(loss) if reduce else loss.detach()).cpu()))
    return losses


def trainer_losses(model, steps: int, world: int, output_dir: str, use_cpu: bool = False) -> list[float]:
    """``steps`` Trainer steps of ``GLOBAL_BATCH`` rows in all (``GLOBAL_BATCH // world`` per process, the Trainer
    shards the batches over the launched ranks), constant learning rate; the logged loss of every step."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", seed=0, use_cpu=use_cpu,
    )  # fmt: skip
    log = Losses()
    collate = BucketingCollator(buckets=(SEQ,), pad_token_id=0, return_attention_mask=False)
    data = examples(steps * GLOBAL_BATCH, lengths=(SEQ,), seed=3)
    Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[log]).train()
    return log.values
