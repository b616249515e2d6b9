"""Pinned host memory and non-blocking copies work on the simulator, as on accelerators (torch_tpu included)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset


def test_pin_memory_copies_and_marks_pinned():
    x = torch.randn(4, 6).t()  # strided: pinning keeps the layout, like torch's _pin_memory
    assert not x.is_pinned()
    p = x.pin_memory()
    assert p.is_pinned() and not x.is_pinned()
    assert torch.equal(p, x) and p.stride() == x.stride() and p.data_ptr() != x.data_ptr()
    assert p.pin_memory() is p  # already pinned: the same tensor (pin_memory's composite asks is_pinned)
    moved = p.to("tpu", non_blocking=True)
    torch.testing.assert_close(moved.cpu(), x)


def test_non_blocking_copy_to_the_host_lands_pinned():
    x = torch.randn(5, 3)
    t = x.to("tpu")
    c = t.to("cpu", non_blocking=True)
    assert c.device.type == "cpu" and c.is_pinned() and torch.equal(c, x)
    assert not t.cpu().is_pinned()  # a blocking copy is ordinary memory
    h = t.to("cpu", torch.float64, non_blocking=True)
    assert h.dtype == torch.float64 and torch.equal(h, x.double())


def test_dataloader_pin_memory():
    data = TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))
    ref = [b for b in DataLoader(data, batch_size=4)]
    got = [b for b in DataLoader(data, batch_size=4, pin_memory=True)]
    assert len(got) == len(ref)
    for (x, y), (rx, ry) in zip(got, ref, strict=True):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_trainer_with_default_arguments_pins_and_trains(tmp_path):
    """transformers' default TrainingArguments has dataloader_pin_memory=True; it runs unchanged."""
    import hf_tpu
    from hf_tpu.testing import tiny_model
    from transformers import Trainer, TrainingArguments

    model = tiny_model("llama").to("tpu")
    ids = torch.randint(3, 128, (8, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    with hf_tpu.enabled():
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], save_strategy="no",
            disable_tqdm=True, seed=0,
        )
        assert args.dataloader_pin_memory is True
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        assert trainer.get_train_dataloader().pin_memory is True
        before = model.model.embed_tokens.weight.detach().cpu()
        out = trainer.train()
    assert next(model.parameters()).device.type == "tpu" and trainer.args.device.type == "tpu"
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert not torch.equal(model.model.embed_tokens.weight.detach().cpu(), before)


def test_factories_with_pin_memory_and_ddp_find_unused_parameters():
    """torch allocates these through the accelerator hooks' pinned allocator, which the native core provides."""
    from hf_tpu.sim._counters import STATE

    if STATE.native is None:
        with pytest.raises(NotImplementedError, match="getPinnedMemoryAllocator"):  # torch's message: documented
            torch.empty(4, pin_memory=True)
        return
    a = torch.empty(1000, pin_memory=True).fill_(2.0)
    b = torch.ones(1000)
    assert a.is_pinned() and not b.is_pinned() and a.is_cpu
    assert torch.equal((a.to("tpu", non_blocking=True) + b.to("tpu")).cpu(), torch.full((1000,), 3.0))
    assert torch.zeros(3, pin_memory=True).is_pinned() and torch.tensor([1.0, 2.0]).pin_memory().is_pinned()


def test_ddp_with_find_unused_parameters_matches_the_cpu(tmp_path):
    """DDP's C++ reducer allocates its used-parameter map with pin_memory=True (the native core's allocator)."""
    import torch.distributed as dist

    from hf_tpu.sim import process_group as sim_backend
    from hf_tpu.sim._counters import STATE

    if STATE.native is None:
        pytest.skip("Python path: DDP(find_unused_parameters=True) is refused by the training integration (tested)")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    sim_backend.register()
    dist.init_process_group(sim_backend.BACKEND_NAME, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref, net = Net(), Net()
        net.load_state_dict(ref.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(net.to("tpu"), find_unused_parameters=True)
        x = torch.randn(3, 4)
        ddp(x.to("tpu")).sum().backward()
        ref(x).sum().backward()
    finally:
        dist.destroy_process_group()
    for p, q in zip(net.used.parameters(), ref.used.parameters()):
        assert torch.allclose(p.grad.cpu(), q.grad)
    assert net.unused.weight.grad is None and ref.unused.weight.grad is None
