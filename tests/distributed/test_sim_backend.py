"""The simulated ``tpu_dist`` process group in this process (one rank over a HashStore): every collective acts in
place on the ``tpu`` tensors and its work's future holds the output tensors, as c10d's own backends do (torch's
DistributedDataParallel reads its reduced gradients from there; a future without them crashed its reducer)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hf_tpu.sim
from hf_tpu.distributed.sim_backend import SimulatedTPUProcessGroup


@pytest.fixture
def group():
    hf_tpu.sim.enable()
    return SimulatedTPUProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=30))


def _value(work):
    work.wait()
    return work.get_future().value()


def test_collectives_return_their_outputs_in_the_future(group):
    a = torch.arange(4.0).to("tpu")
    b = torch.ones(4).to("tpu")
    value = _value(group.allreduce([a, b]))
    assert len(value) == 2 and value[0] is a and value[1] is b
    assert _value(group.broadcast([a]))[0] is a
    out = [[torch.empty(4).to("tpu")]]
    gathered = _value(group.allgather(out, [a]))
    assert gathered[0][0] is out[0][0]
    torch.testing.assert_close(out[0][0].cpu(), a.cpu())
    flat = torch.empty(4).to("tpu")
    assert _value(group._allgather_base(flat, a))[0] is flat
    scattered = torch.empty(4).to("tpu")
    assert _value(group._reduce_scatter_base(scattered, a))[0] is scattered
    torch.testing.assert_close(scattered.cpu(), a.cpu())
    assert _value(group.barrier()) is None


def test_average_divides_by_the_world_in_place(group):
    t = torch.tensor([2.0, 4.0]).to("tpu")
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    (out,) = _value(group.allreduce([t], opts))
    assert out is t and out.device.type == "tpu"
    torch.testing.assert_close(t.cpu(), torch.tensor([2.0, 4.0]))  # one rank: the average is the value
