"""Training on the chip: a plain AdamW loop and ``transformers.Trainer`` on a tiny Llama, their losses against the
same run on the CPU (float32 at the device's default matmul precision; the tolerance counts forward and backward)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.chip

STEPS = 4


def _data(n: int = STEPS, batch: int = 4, seq: int = 16):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (batch, seq), generator=g) for _ in range(n)]


def _model_dir(tmp_path):
    from hf_tpu.testing import tiny_model

    tiny_model("llama", tmp_path / "llama", max_position_embeddings=64, use_cache=False)
    return tmp_path / "llama"


def _loop(model, data) -> list[float]:
    import torch

    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in data:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()]


def test_plain_adamw_loop_losses_equal_cpu(tpu, chip, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = _model_dir(tmp_path)
    data = _data()
    want = _loop(AutoModelForCausalLM.from_pretrained(path), data)
    got = _loop(AutoModelForCausalLM.from_pretrained(path).to("tpu"), data)
    chip.close(torch.tensor(got), torch.tensor(want), layers=2 * 4, what="the losses")


def test_trainer_losses_equal_cpu(tpu, chip, needs, tmp_path):
    needs("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    path = _model_dir(tmp_path)
    rows = [{"input_ids": ids[r], "labels": ids[r]} for ids in _data() for r in range(ids.shape[0])]

    class Losses(TrainerCallback):
        def __init__(self):
            self.values = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.values.append(float(logs["loss"]))

    def train(device: str) -> list[float]:
        losses = Losses()
        args = TrainingArguments(
            output_dir=str(tmp_path / device), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=STEPS,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=device == "cpu", seed=0, disable_tqdm=True,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(path).to(device)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[losses])
        trainer.train()
        assert next(trainer.model.parameters()).device.type == device
        return losses.values

    want, got = train("cpu"), train("tpu")
    assert len(got) == len(want) == STEPS
    chip.close(torch.tensor(got), torch.tensor(want), layers=2 * 4, what="the Trainer's losses")
