"""Fine-tune the model that ships with hf_tpu on TPU with ``transformers.Trainer`` (a few steps; LoRA optional).

Runs on a TPU VM (torch-tpu installed) or anywhere on the simulated TPU:

    HF_TPU_SIMULATE=1 python examples/finetune.py                 # full fine-tune, bf16 autocast
    HF_TPU_SIMULATE=1 python examples/finetune.py --lora          # LoRA adapters with peft
    HF_TPU_SIMULATE=1 python examples/finetune.py --compare       # also train on CPU and compare losses
    hf-tpu launch --simulate --nproc_per_node=2 examples/finetune.py   # data parallel: 2 chips, 4 rows each

The data is the shipped held-out text (The Tempest, act I), cut into examples of 16-64 tokens and padded to
fixed lengths by ``BucketingCollator`` so that, after the first step of each length, no step compiles anything.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

import hf_tpu
from hf_tpu import runtime
from hf_tpu.assets import default_model_path
from hf_tpu.training import BucketingCollator, StepCounters


class _Losses(TrainerCallback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.values.append(float(logs["loss"]))


def examples(tok, n_tokens: tuple[int, ...] = (16, 32, 48, 64)) -> list[dict]:
    text = (default_model_path() / "heldout.txt").read_text()
    ids = tok(text, verbose=False)["input_ids"]
    out, pos, i = [], 0, 0
    while pos + n_tokens[i % len(n_tokens)] <= len(ids):
        n = n_tokens[i % len(n_tokens)]
        out.append({"input_ids": ids[pos : pos + n]})
        pos, i = pos + n, i + 1
    return out


def train(device: str, args: argparse.Namespace, data: list[dict], eval_data: list[dict], pad_id: int):
    model = AutoModelForCausalLM.from_pretrained(default_model_path())
    model.config.use_cache = False
    if args.lora:
        import peft

        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    losses, counters = _Losses(), StepCounters()
    output_dir = tempfile.mkdtemp(prefix="hf_tpu_finetune_")
    atexit.register(shutil.rmtree, output_dir, ignore_errors=True)  # nothing is saved there (save_strategy="no")
    trainer = Trainer(
        model=model.to(device),
        args=TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            max_steps=args.steps,
            learning_rate=5e-3 if args.lora else 3e-4,
            gradient_accumulation_steps=2,
            max_grad_norm=1.0,
            bf16=True,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=device == "cpu",
            disable_tqdm=True,
            seed=0,
        ),
        train_dataset=data,
        eval_dataset=eval_data,
        # Right padding without a mask: same loss for a causal LM, one set of shapes per bucket.
        data_collator=BucketingCollator(
            buckets=(32, 64), pad_token_id=pad_id, batch_size=4, return_attention_mask=False
        ),
        callbacks=[losses, counters],
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    return losses.values, counters, before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (needs peft)")
    parser.add_argument("--compare", action="store_true", help="run the same training on CPU and compare")
    args = parser.parse_args()

    info = runtime.require_tpu("examples/finetune.py")
    print(f"TPU: {info.mode} ({info.reason})")
    hf_tpu.enable()
    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    tok = AutoTokenizer.from_pretrained(default_model_path())
    data = examples(tok)
    train_data, eval_data = data[8:], data[:8]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    losses, counters, before, after = train("tpu", args, train_data, eval_data, pad_id)
    print(f"tpu  losses per step: {[round(x, 4) for x in losses]}")
    print(f"tpu  eval loss {before:.4f} -> {after:.4f}")
    if info.mode == "simulated":
        warm = counters.after(2)
        print(
            f"tpu  after 2 warm-up steps: {warm['compiles']} compiles, {warm['shape_signatures']} new eager shapes "
            f"in {warm['steps']} steps ({warm['seconds'] / max(warm['steps'], 1):.3f} s/step)"
        )
    if args.compare:
        cpu_losses, _, cpu_before, cpu_after = train("cpu", args, train_data, eval_data, pad_id)
        diff = max(abs(a - b) for a, b in zip(losses, cpu_losses, strict=True))
        print(f"cpu  losses per step: {[round(x, 4) for x in cpu_losses]}")
        print(f"cpu  eval loss {cpu_before:.4f} -> {cpu_after:.4f}")
        print(f"max |tpu - cpu| loss difference: {diff:.2e}")


if __name__ == "__main__":
    main()
