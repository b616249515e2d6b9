"""The Trainer's optimizer update and gradient clipping as compiled graphs on a TPU (issue #68), against the CPU.

``hf_tpu.enable()`` gives the Trainer :class:`hf_tpu.training.AdamW` and a compiled ``clip_grad_norm_`` on a TPU:
the loss curve under a changing learning rate equals the CPU Trainer's (upstream's AdamW and clipping), nothing
compiles after the warm-up, and the eager ops of a step do not grow with the number of parameter tensors.
"""

from __future__ import annotations

import pytest
import torch
from train_helpers import Losses, examples, tiny_config

from hf_tpu.training import BucketingCollator
from hf_tpu.training.callbacks import StepCounters

COLLATE = {"buckets": (16,), "pad_token_id": 0, "batch_size": 4, "return_attention_mask": False}


def _model(layers: int, device: str, compiled: bool = False):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_config()
    config.num_hidden_layers, config.use_cache = layers, False
    model = LlamaForCausalLM(config).to(device)
    if compiled:
        model.compile(backend="tpu", dynamic=False)
    return model


def _train(model, tmp_path, device: str, steps: int, **overrides):
    from transformers import Trainer, TrainingArguments

    kwargs = {
        "output_dir": str(tmp_path / device), "per_device_train_batch_size": 4, "learning_rate": 3e-3,
        "max_steps": steps, "logging_steps": 1, "report_to": [], "save_strategy": "no", "seed": 0,
        "use_cpu": device == "cpu", "lr_scheduler_type": "linear", "warmup_steps": 2, "max_grad_norm": 0.5,
        "weight_decay": 0.1, "dataloader_pin_memory": False, "disable_tqdm": True,
    }  # fmt: skip
    kwargs.update(overrides)
    losses, counters = Losses(), StepCounters()
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=examples(4 * steps),
                      data_collator=BucketingCollator(**COLLATE), callbacks=[losses, counters])  # fmt: skip
    trainer.train()
    return trainer, losses.values, counters


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_loss_curve_equals_cpu_with_the_compiled_update_and_no_compile_after_warmup(tmp_path, optim):
    from hf_tpu.training import AdamW

    tpu, tpu_losses, counters = _train(_model(2, "tpu"), tmp_path, "tpu", 10, optim=optim)
    cpu, cpu_losses, _ = _train(_model(2, "cpu"), tmp_path, "cpu", 10, optim=optim)
    assert type(tpu.optimizer.optimizer) is AdamW and type(cpu.optimizer.optimizer) is torch.optim.AdamW
    assert len(tpu_losses) == len(cpu_losses) == 10
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-4, atol=1e-4)
    lrs = {group["lr"] for group in tpu.optimizer.param_groups}
    assert lrs == {group["lr"] for group in cpu.optimizer.param_groups}  # the schedule ran on both
    warm = counters.after(2)  # (step 2 refreshes the learning rate tensor for the first time: one new signature)
    assert warm["compiles"] == 0 and warm["shape_signatures"] == 0, counters.steps
    state = tpu.optimizer.optimizer.state[next(tpu.model.parameters())]  # (upstream's keeps "step" on the host)
    assert {k: v.device.type for k, v in state.items()} == dict.fromkeys(("step", "exp_avg", "exp_avg_sq"), "tpu")
    assert int(state["step"]) == 10


def _eager_ops_per_step(tmp_path, layers: int) -> tuple[int, int]:
    model = _model(layers, "tpu", compiled=True)
    tensors = len(list(model.parameters()))
    _, _, counters = _train(model, tmp_path / str(layers), "tpu", 4, logging_steps=100)
    warm = counters.after(2)
    assert warm["compiles"] == 0, counters.steps
    return warm["eager_ops"] // warm["steps"], tensors


def test_eager_ops_per_step_do_not_grow_with_the_parameter_tensors(tmp_path, monkeypatch):
    """With the model compiled, a warm step's eager ops are the same at 2 and 4 layers (21 and 39 parameter
    tensors); with upstream's eager update and clipping (``HF_TPU_OPTIMIZER=eager``) they grow with them."""
    compiled = {layers: _eager_ops_per_step(tmp_path, layers) for layers in (2, 4)}
    assert compiled[4][1] > compiled[2][1]
    assert compiled[4][0] == compiled[2][0], compiled
    monkeypatch.setenv("HF_TPU_OPTIMIZER", "eager")
    eager = {layers: _eager_ops_per_step(tmp_path / "eager", layers) for layers in (2, 4)}
    assert eager[4][0] > eager[2][0] > compiled[2][0], (eager, compiled)


def test_the_switch_and_disable_give_upstreams_optimizer(tmp_path, monkeypatch):
    import hf_tpu
    from hf_tpu.training import AdamW
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], optim="adamw_torch")
    assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is AdamW
    monkeypatch.setenv("HF_TPU_OPTIMIZER", "eager")
    assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is torch.optim.AdamW
    monkeypatch.delenv("HF_TPU_OPTIMIZER")
    hf_tpu.disable("training")
    try:
        assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is torch.optim.AdamW
    finally:
        hf_tpu.enable("training")
    cpu_args = TrainingArguments(output_dir=str(tmp_path), report_to=[], optim="adamw_torch", use_cpu=True)
    assert Trainer.get_optimizer_cls_and_kwargs(cpu_args)[0] is torch.optim.AdamW  # upstream's off the TPU


def test_adamw_in_a_plain_loop_equals_upstreams_and_loads_its_state(monkeypatch):
    """hf_tpu's AdamW on the TPU against torch's on the CPU, 4 steps with clipping and a scheduler; then upstream's
    CPU state dict (step counters on the host) loads into it and training continues equal to upstream's."""
    from hf_tpu.training import AdamW, clip_grad_norm_

    def run(device, opt_class, steps, state=None, weights=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        if weights is not None:
            model.load_state_dict(weights)
        model.to(device)
        opt = opt_class(model.parameters(), lr=1e-2, weight_decay=0.1)
        if state is not None:
            opt.load_state_dict(state)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(device)
        norms = []
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            clip = clip_grad_norm_ if device == "tpu" else torch.nn.utils.clip_grad_norm_
            norms.append(float(clip(model.parameters(), 0.1)))
            opt.step()
            sched.step()
            opt.zero_grad()
        return norms, {k: v.cpu() for k, v in model.state_dict().items()}, opt

    tpu_norms, tpu_weights, _ = run("tpu", AdamW, 4)
    cpu_norms, cpu_weights, cpu_opt = run("cpu", torch.optim.AdamW, 4)
    close = {"rtol": 1e-5, "atol": 1e-6}  # (list ops against upstream's per-tensor CPU loop: rounding only)
    torch.testing.assert_close(tpu_norms, cpu_norms, **close)
    torch.testing.assert_close(tpu_weights, cpu_weights, **close)
    resumed_norms, resumed, _ = run("tpu", AdamW, 2, state=cpu_opt.state_dict(), weights=cpu_weights)
    upstream_norms, upstream, _ = run("cpu", torch.optim.AdamW, 2, state=cpu_opt.state_dict(), weights=cpu_weights)
    torch.testing.assert_close(resumed_norms, upstream_norms, **close)
    torch.testing.assert_close(resumed, upstream, **close)


def test_one_graph_per_bucket_and_a_large_bucket_cut_into_sub_lists_of_one_graph(monkeypatch):
    """The update compiles one graph per bucket (a group's tensors of one shape and dtype), whatever their count; a
    bucket over ``BUCKET_BYTES`` is cut into sub-lists of one length that share a graph. The parameters keep their
    dtype and object (their ``.data`` rebound), and the result equals upstream's AdamW on the CPU."""
    from hf_tpu import sim
    from hf_tpu.training import AdamW, clip_grad_norm_, optim

    shapes = [(4, 8)] * 6 + [(8,)] * 3
    monkeypatch.setattr(optim, "BUCKET_BYTES", 2 * 4 * 8 * 2 * 3)  # (two (4, 8) bfloat16 tensors and their moments)
    assert [len(b) for b in optim._buckets([torch.empty(s, dtype=torch.bfloat16) for s in shapes], 3)] == [2, 2, 2, 3]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes] for _ in range(3)]

    def run(device, opt_class, clip):
        params = [torch.nn.Parameter(w.to(device)) for w in weights]
        opt = opt_class(params, lr=5e-2, weight_decay=0.1)
        compiles = []
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.to(device)
            with sim.stats() as s:
                clip(params, 0.5)
                opt.step()
            compiles.append(s.compiles)
        return params, compiles

    tpu, compiles = run("tpu", AdamW, clip_grad_norm_)
    cpu, _ = run("cpu", torch.optim.AdamW, torch.nn.utils.clip_grad_norm_)
    # the update: one graph for the three (4, 8) sub-lists, one for the (8,) bucket; the clipping: the norm and one per
    # bucket of gradients (its own cut: a gradient and its scaled copy, three to a sub-list: two sub-lists of (4, 8))
    assert compiles == [2 + 3, 0, 0], compiles
    assert all(p.dtype == torch.bfloat16 and p.device.type == "tpu" for p in tpu)
    for p, q in zip(tpu, cpu):  # (bfloat16: upstream's CPU step rounds each intermediate, the graph may not)
        torch.testing.assert_close(p.detach().cpu().float(), q.detach().float(), rtol=2e-2, atol=2e-2)
