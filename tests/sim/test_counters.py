"""Counters, strict mode, memory accounting and OOM, compile counting of the simulated device."""

import gc

import numpy as np
import pytest
import torch

import hf_tpu.sim
from hf_tpu.sim import SimStrictError


def test_transfers_and_syncs_are_counted():
    x = torch.randn(16, 4)
    with hf_tpu.sim.stats() as s:
        t = x.to("tpu")
        y = (t * 2).sum()
        v = y.item()
        lst = t[0].tolist()
        back = t.cpu()
    assert s.h2d_copies == 1 and s.h2d_bytes == x.numel() * 4
    assert s.d2h_copies == 3 and s.d2h_bytes == 4 + 16 + x.numel() * 4
    assert s.host_syncs == 3
    assert v == pytest.approx((x * 2).sum().item(), rel=1e-5) and lst == x[0].tolist()
    assert torch.equal(back, x)
    d = s.as_dict()
    assert d["h2d_copies"] == 1 and "host syncs" in s.report()


def test_print_counts_a_host_sync():
    t = torch.ones(3, device="tpu")
    with hf_tpu.sim.stats() as s:
        text = str(t)
    assert "device='tpu:0'" in text and s.host_syncs >= 1


def test_nested_blocks_and_frozen_values():
    t = torch.ones(3, device="tpu")
    with hf_tpu.sim.stats() as outer:
        t.cpu()
        with hf_tpu.sim.stats() as inner:
            t.cpu()
        assert inner.d2h_copies == 1
        assert outer.d2h_copies == 2  # read live while open
        t.cpu()
    assert (outer.d2h_copies, inner.d2h_copies) == (3, 1)


def test_shape_signatures_count_new_shapes_only():
    a = torch.randn(3, 7, device="tpu")
    with hf_tpu.sim.stats() as s1:
        _ = a * 1.5 + a.sin()
    with hf_tpu.sim.stats() as s2:
        _ = a * 1.5 + a.sin()
    b = torch.randn(5, 7, device="tpu")
    with hf_tpu.sim.stats() as s3:
        _ = b * 1.5 + b.sin()
    assert s1.shape_signatures >= 3
    assert s2.shape_signatures == 0 and s2.ops == s1.ops
    assert s3.shape_signatures == s1.shape_signatures


def _new_signatures(fn) -> int:
    with hf_tpu.sim.stats() as s:
        fn()
    return s.shape_signatures


def test_shape_signatures_key_baked_arguments():
    # ints, int lists, bools and dtypes are compiled into torch_tpu's program: each new value is a new signature,
    # even where every input and output shape is the same
    a = torch.randn(11, 11, device="tpu")
    assert _new_signatures(lambda: a.sum(dim=0)) == 1
    assert _new_signatures(lambda: a.sum(dim=1)) == 1
    assert _new_signatures(lambda: a.sum(dim=0)) == 0
    assert _new_signatures(lambda: a.sum(dim=0, keepdim=True)) == 1
    assert _new_signatures(lambda: a.roll(1, 0)) == 1
    assert _new_signatures(lambda: a.roll(2, 0)) == 1
    assert _new_signatures(lambda: a.cumsum(0, dtype=torch.float64)) >= 1
    assert _new_signatures(lambda: a.cumsum(0, dtype=torch.float64)) == 0
    assert _new_signatures(lambda: a.cumsum(0)) >= 1


def test_shape_signatures_of_factories_key_the_output_shape():
    assert _new_signatures(lambda: torch.arange(1231, device="tpu")) >= 1
    assert _new_signatures(lambda: torch.arange(1237, device="tpu")) >= 1
    assert _new_signatures(lambda: torch.arange(1231, device="tpu")) == 0
    assert _new_signatures(lambda: torch.arange(3, 1234, device="tpu")) >= 1  # start 0 was keyed as a special value
    assert _new_signatures(lambda: torch.arange(5, 1236, device="tpu")) == 0  # same program: start is runtime data


def test_shape_signatures_treat_scalars_as_runtime_values():
    # torch_tpu promotes Scalar arguments to device values: a new value reuses the program, a new type does not;
    # 0, 1 and -1 are keyed (lowerings may specialise on them, e.g. add's alpha == 1)
    a, b = torch.randn(13, 3, device="tpu"), torch.randn(13, 3, device="tpu")
    assert _new_signatures(lambda: a * 1.5) == 1
    assert _new_signatures(lambda: a * 2.5) == 0
    assert _new_signatures(lambda: a * 2) == 1  # an int: another dtype
    assert _new_signatures(lambda: a.add(b, alpha=2.0)) == 1
    assert _new_signatures(lambda: a.add(b, alpha=3.0)) == 0
    assert _new_signatures(lambda: a.clamp(min=0.25)) == 1
    assert _new_signatures(lambda: a.clamp(min=0.5)) == 0
    assert _new_signatures(lambda: torch.full((13, 5), 2.0, device="tpu")) >= 1
    assert _new_signatures(lambda: torch.full((13, 5), 3.0, device="tpu")) == 0


def test_data_dependent_shape_is_a_sync():
    t = torch.tensor([0.0, 1.0, 2.0], device="tpu")
    with hf_tpu.sim.stats() as s:
        nz = t.nonzero()
    assert s.host_syncs == 1 and nz.cpu().flatten().tolist() == [1, 2]


def test_strict_raises_on_host_sync():
    t = torch.ones(3, device="tpu")
    with hf_tpu.sim.strict():
        y = t * 2  # stays on the device
        with pytest.raises(SimStrictError, match="item"):
            y.sum().item()
        with pytest.raises(SimStrictError, match="host"):
            y.cpu()
    assert y.sum().item() == 6.0  # fine outside


def test_strict_host_syncs_off_allows_syncs():
    t = torch.ones(3, device="tpu")
    with hf_tpu.sim.strict(host_syncs=False):
        assert t.sum().item() == 3.0


def test_memory_accounting_and_peak():
    gc.collect()
    base = hf_tpu.sim.memory_allocated()
    hf_tpu.sim.reset_peak()
    with hf_tpu.sim.stats() as s:
        t = torch.empty(1024, 256, device="tpu")  # 1 MiB
        assert hf_tpu.sim.memory_allocated() == base + 1024**2
        u = t + 1
        del t, u
        gc.collect()
    assert hf_tpu.sim.memory_allocated() == base
    assert hf_tpu.sim.max_memory_allocated() >= base + 2 * 1024**2
    assert s.peak_bytes >= base + 2 * 1024**2 and s.live_bytes == base


def test_views_do_not_allocate():
    t = torch.empty(256, 256, device="tpu")
    before = hf_tpu.sim.memory_allocated()
    v = t.view(-1)[10:]
    w = t.transpose(0, 1)
    assert hf_tpu.sim.memory_allocated() == before
    del v, w


def test_out_of_memory():
    gc.collect()
    # Tensors an earlier test in this worker still holds count against the HBM: 2 MiB on top of them.
    base = hf_tpu.sim.memory_allocated()
    hf_tpu.sim.enable(hbm=base + 2 * 1024**2)
    keep = torch.empty(1024, 256, device="tpu")  # 1 MiB
    with pytest.raises(torch.OutOfMemoryError, match=r"out of memory.*tried to allocate 2.00 MiB.* of HBM"):
        torch.empty(2 * 1024, 256, device="tpu")
    with pytest.raises(torch.OutOfMemoryError, match="hbm="):
        torch.randn(2048, 256).to("tpu")
    del keep


def test_compile_counts_and_recompiles():
    torch._dynamo.reset()

    def f(x):
        return torch.nn.functional.silu(x) * 2 + 1

    cf = torch.compile(f, backend="tpu", dynamic=False)
    x3, x4 = torch.randn(3), torch.randn(4)
    with hf_tpu.sim.stats() as s:
        y3 = cf(x3.to("tpu"))
        y3b = cf(x3.to("tpu"))
        y4 = cf(x4.to("tpu"))
    assert s.compiles == 2
    torch.testing.assert_close(y3.cpu(), f(x3))
    torch.testing.assert_close(y3b.cpu(), f(x3))
    torch.testing.assert_close(y4.cpu(), f(x4))
    with hf_tpu.sim.strict():
        cf(x3.to("tpu"))  # cached: no compile, no sync
        with pytest.raises(Exception, match="compile inside hf_tpu.sim.strict"):
            cf(torch.randn(5).to("tpu"))


class _NumpyScaled(torch.nn.Module):
    """NCSN++'s pattern (diffusers' skip blocks keep ``np.sqrt(2.0)`` as an output scale): dynamo traces the numpy
    float as a symbol, AOT autograd must specialize it and restarts dynamo's analysis of the frame."""

    def __init__(self):
        super().__init__()
        self.scale = np.sqrt(2.0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) / self.scale


def test_dynamo_restart_is_not_a_compile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _NumpyScaled()
    x = torch.randn(2, 4)
    expected = model(x)
    compiled = torch.compile(model.to("tpu"), backend="tpu", fullgraph=True, dynamic=False)
    with hf_tpu.sim.stats() as s:
        out = compiled(x.to("tpu"))
    # The backend was entered twice (the first attempt ended in the restart) for one graph dynamo installed.
    assert counters["aot_autograd"]["total"] == 2 and counters["stats"]["unique_graphs"] == 1
    assert s.compiles == 1
    torch.testing.assert_close(out.cpu(), expected)
    with hf_tpu.sim.stats() as again:
        compiled(x.to("tpu"))
    assert again.compiles == 0


def test_compiled_training_step_matches_cpu():
    torch._dynamo.reset()
    lin = torch.nn.Linear(4, 2)
    lin_t = torch.nn.Linear(4, 2)
    lin_t.load_state_dict(lin.state_dict())
    lin_t.to("tpu")
    x = torch.randn(3, 4)
    lin(x).relu().sum().backward()
    step = torch.compile(lambda m, inp: m(inp).relu().sum(), backend="tpu")
    with hf_tpu.sim.stats() as s:
        step(lin_t, x.to("tpu")).backward()
    assert s.compiles == 1
    torch.testing.assert_close(lin_t.weight.grad.cpu(), lin.weight.grad)
