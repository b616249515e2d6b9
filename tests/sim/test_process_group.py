"""The simulated ``tpu_dist`` process group in this process (one rank over a HashStore): every collective acts in
place on the ``tpu`` tensors and its work's future holds the output tensors, as c10d's own backends do (torch's
DistributedDataParallel reads its reduced gradients from there; a future without them crashed its reducer)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hf_tpu.sim
from hf_tpu.sim.process_group import SimulatedTPUProcessGroup


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


def test_average_over_three_ranks_divides_the_sum_by_three():
    """AVG with a world of 3 (ranks as threads over one store; gloo runs SUM, the group divides): every averaging
    collective against the mean computed on the CPU. With one rank the division would change nothing."""
    from concurrent.futures import ThreadPoolExecutor

    hf_tpu.sim.enable()
    world, store = 3, dist.HashStore()
    data = [torch.arange(6.0) * (r + 1) + r for r in range(world)]  # a different tensor per rank
    mean = torch.stack(data).mean(0)

    def rank(r: int) -> dict:
        g = SimulatedTPUProcessGroup(store, r, world, timedelta(seconds=60))
        avg = dist.AllreduceOptions()
        avg.reduceOp = dist.ReduceOp.AVG
        t = data[r].to("tpu")
        _value(g.allreduce([t], avg))
        red = dist.ReduceOptions()
        red.reduceOp, red.rootRank = dist.ReduceOp.AVG, 0
        root = data[r].to("tpu")
        _value(g.reduce([root], red))
        rs = dist.ReduceScatterOptions()
        rs.reduceOp = dist.ReduceOp.AVG
        part = torch.empty(2).to("tpu")
        _value(g._reduce_scatter_base(part, data[r].to("tpu"), rs))
        return {"allreduce": t.cpu(), "reduce": root.cpu(), "scatter": part.cpu()}

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(rank, range(world)))
    for r, got in enumerate(results):
        torch.testing.assert_close(got["allreduce"], mean)
        torch.testing.assert_close(got["scatter"], mean[2 * r : 2 * r + 2])
    torch.testing.assert_close(results[0]["reduce"], mean)  # the root holds the average


def test_premul_sum_is_refused_as_on_a_chip(group):
    """torch-tpu 0.2.0's ProcessGroupTpu: "BuildReduceBody: 'premul_sum' reduction is not supported" (read from the
    wheel); FSDP2 asks for it only after ``set_gradient_divide_factor`` with a factor other than the world size."""
    a, out = torch.arange(4.0).to("tpu"), torch.empty(4).to("tpu")
    rs = dist.ReduceScatterOptions()
    rs.reduceOp = dist.ReduceOp.PREMUL_SUM(0.5)
    with pytest.raises(RuntimeError, match="'premul_sum' reduction is not supported"):
        group._reduce_scatter_base(out, a, rs)
    ar = dist.AllreduceOptions()
    ar.reduceOp = dist.ReduceOp.PREMUL_SUM(0.5)
    with pytest.raises(RuntimeError, match="'premul_sum' reduction is not supported"):
        group.allreduce([a], ar)
