"""``transformers.Trainer`` with ``TrainingArguments`` on a TPU-placed model (simulated), against a CPU Trainer.

Also proves the upstream gap that the ``training`` integration closes: without it accelerate moves the model back to
the CPU and the first step fails.
"""

from __future__ import annotations

import pytest
import torch
from train_helpers import Losses, examples

import hf_tpu
from hf_tpu import _patch
from hf_tpu.training import BucketingCollator, TPUTrainingError
from hf_tpu.training.callbacks import StepCounters


def _args(tmp_path, device: str, **overrides):
    from transformers import TrainingArguments

    kwargs = {
        "output_dir": str(tmp_path / device), "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
        "learning_rate": 3e-3, "max_steps": 4, "logging_steps": 1, "report_to": [], "save_strategy": "no",
        "use_cpu": device == "cpu", "seed": 0,
    }  # fmt: skip
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


COLLATE = {"buckets": (16,), "pad_token_id": 0, "batch_size": 4, "return_attention_mask": False}


def _train(load, tmp_path, device: str, *, resume: str | None = None, **overrides):
    from transformers import Trainer

    losses, counters = Losses(), StepCounters()
    trainer = Trainer(
        model=load(device),
        args=_args(tmp_path, device, **overrides),
        train_dataset=examples(32),
        eval_dataset=examples(8, seed=1),
        data_collator=BucketingCollator(**COLLATE),
        callbacks=[losses, counters],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses.values, counters


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """The same 4-step run (accumulation 2, clipping 0.5, a checkpoint every 2 steps) on tpu and on CPU."""
    from transformers import AutoModelForCausalLM

    def load(device):
        return AutoModelForCausalLM.from_pretrained(model_dir).to(device)

    tmp = tmp_path_factory.mktemp("trainer")
    opts = {"gradient_accumulation_steps": 2, "max_grad_norm": 0.5, "save_strategy": "steps", "save_steps": 2}
    return {device: (*_train(load, tmp, device, **opts), tmp) for device in ("tpu", "cpu")}


def test_trainer_on_tpu_matches_cpu_and_compiles_nothing_after_warmup(runs):
    tpu, tpu_losses, counters, _ = runs["tpu"]
    cpu, cpu_losses, _, _ = runs["cpu"]
    assert tpu.args.device.type == "tpu" and next(tpu.model.parameters()).device.type == "tpu"
    assert cpu.args.device.type == "cpu"
    assert len(tpu_losses) == 4
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-4, atol=1e-4)
    assert len(counters.steps) == 4
    warm = counters.after(1)
    assert warm["shape_signatures"] == 0 and warm["compiles"] == 0, counters.steps


def test_trainer_evaluate_on_tpu_matches_cpu(runs):
    ev_tpu, ev_cpu = runs["tpu"][0].evaluate(), runs["cpu"][0].evaluate()
    assert ev_tpu["eval_loss"] == pytest.approx(ev_cpu["eval_loss"], abs=1e-4)


def test_trainer_checkpoint_resume_gives_the_same_losses(runs, load):
    _, full, _, tmp = runs["tpu"]
    ckpt = tmp / "tpu" / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file()
    trainer, resumed, _ = _train(load, tmp / "resume", "tpu", resume=str(ckpt), gradient_accumulation_steps=2,
                                 max_grad_norm=0.5)  # fmt: skip
    assert resumed == pytest.approx(full[2:], abs=1e-5)
    assert next(trainer.model.parameters()).device.type == "tpu"


def test_trainer_bf16_on_tpu_matches_cpu_bf16(load, tmp_path):
    tpu, tpu_losses, _ = _train(load, tmp_path, "tpu", bf16=True, max_steps=2)
    _, cpu_losses, _ = _train(load, tmp_path, "cpu", bf16=True, max_steps=2)
    assert tpu.accelerator.mixed_precision == "bf16"
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=2e-3, atol=2e-3)


def test_upstream_accelerate_default_device_without_the_integration(load, tmp_path):
    """Without the integration, accelerate before 1.16 breaks the Trainer on TPU (its default device is the CPU, so
    the model goes back to the host); accelerate 1.16 asks torch.accelerator and trains on the TPU by itself, and
    hf_tpu then keeps its default device as upstream answers it (told by upstream's answer, not its version)."""
    import accelerate
    from accelerate.state import PartialState
    from packaging.version import Version

    from hf_tpu.training._integration import upstream_knows_the_tpu

    asks_torch_accelerator = Version(Version(accelerate.__version__).base_version) >= Version("1.16")
    assert upstream_knows_the_tpu() is asks_torch_accelerator  # (the simulated TPU is current here)
    PartialState._reset_state()
    hf_tpu.disable("training")
    try:
        if upstream_knows_the_tpu():
            assert PartialState().device == torch.device("tpu")
            trainer, losses, _ = _train(load, tmp_path, "tpu", max_steps=1)
            assert next(trainer.model.parameters()).device.type == "tpu"
            assert losses and all(torch.isfinite(torch.tensor(losses)))
        else:
            assert PartialState().device == torch.device("cpu")
            with pytest.raises(RuntimeError, match="same device"):
                _train(load, tmp_path, "tpu", max_steps=1)
    finally:
        PartialState._reset_state()
        hf_tpu.enable("training")
    # hf_tpu's answer where upstream has none (tpu:0), upstream's own where it names the TPU (accelerate 1.16: tpu)
    assert PartialState().device == (torch.device("tpu") if asks_torch_accelerator else torch.device("tpu", 0))
    assert any(r.target.endswith("default_device") for r in _patch.applied("training"))
    PartialState._reset_state()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"fp16": True}, "bf16=True"),
        ({"optim": "adamw_bnb_8bit"}, "adamw_torch"),
        ({"optim": "paged_adamw_32bit"}, "paged"),
    ],
)
def test_unsupported_arguments_are_refused(load, tmp_path, overrides, match):
    from transformers import Trainer

    with pytest.raises(TPUTrainingError, match=match):
        Trainer(model=load("tpu"), args=_args(tmp_path, "tpu", **overrides), train_dataset=examples(4))


def test_quantized_model_is_refused(load, tmp_path):
    from transformers import BitsAndBytesConfig, Trainer

    model = load("tpu")
    model.config.quantization_config = BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(TPUTrainingError, match="quantized \\(bitsandbytes\\).*bfloat16"):
        Trainer(model=model, args=_args(tmp_path, "tpu"), train_dataset=examples(4))


def test_launched_tpu_ranks_become_one_data_parallel_run(monkeypatch):
    """Under a launcher (WORLD_SIZE > 1) on a TPU, accelerate's backend choice is a data-parallel run over
    tpu_dist (its MULTI_CPU type: a plain DistributedDataParallel); alone, or asked for the CPU, upstream's."""
    import types

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert PartialState._prepare_backend(types.SimpleNamespace()) == (
        "cpu:gloo,tpu:tpu_dist",
        DistributedType.MULTI_CPU,
    )
    ranks = types.SimpleNamespace(device=None, distributed_type=DistributedType.MULTI_CPU, _cpu=False)
    PartialState.set_device(ranks)
    assert ranks.device == torch.device("tpu", 0)
    cpu_ranks = types.SimpleNamespace(device=None, distributed_type=DistributedType.MULTI_CPU, _cpu=True)
    cpu_ranks.local_process_index = 0
    PartialState.set_device(cpu_ranks)  # upstream's own CPU data parallel keeps the CPU
    assert cpu_ranks.device == torch.device("cpu", 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert PartialState._prepare_backend(types.SimpleNamespace()) == (None, DistributedType.NO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert PartialState._prepare_backend(types.SimpleNamespace(), cpu=True)[0] == "gloo"  # upstream's CPU run
    hf_tpu.disable("training")
    try:
        assert PartialState._prepare_backend(types.SimpleNamespace()) == (None, DistributedType.NO)  # every rank alone
    finally:
        hf_tpu.enable("training")


def test_find_unused_parameters_is_upstreams_with_the_native_core_and_off_without(monkeypatch, tmp_path):
    """DDP's reducer allocates pinned memory in C++: the native core's hooks provide it (upstream's default stays, as
    on a chip); on the Python path it defaults to False and an explicit True is refused with the fix."""
    from hf_tpu.sim._counters import STATE
    from hf_tpu.training._integration import _ddp_defaults

    if STATE.native is not None:
        for value in (None, True, False):
            args = _args(tmp_path, "tpu", ddp_find_unused_parameters=value)
            _ddp_defaults(args)
            assert args.ddp_find_unused_parameters is value
    monkeypatch.setattr(STATE, "native", None)
    args = _args(tmp_path, "tpu")
    assert args.ddp_find_unused_parameters is None
    _ddp_defaults(args)
    assert args.ddp_find_unused_parameters is False
    with pytest.raises(TPUTrainingError, match="ddp_find_unused_parameters=False"):
        _ddp_defaults(_args(tmp_path, "tpu", ddp_find_unused_parameters=True))