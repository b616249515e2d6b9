"""torch-tpu 0.2.0's public torch.tpu submodules on the simulator (hf_tpu/sim/_public_api.py), against the CPU."""

import os

import pytest
import torch
import torch.nn.functional as F

import hf_tpu.sim  # noqa: F401 -- the simulated device


def _ragged_ref(lhs, rhs, sizes):
    out, start = [], 0
    for i, n in enumerate(sizes.tolist()):
        out.append(lhs[start : start + n] @ rhs[i])
        start += n
    return torch.cat(out)


def test_ragged_dot_equals_the_cpu_with_static_shapes():
    g = torch.Generator().manual_seed(0)
    lhs, rhs = torch.randn(10, 8, generator=g), torch.randn(3, 8, 5, generator=g)
    sizes = torch.tensor([3, 0, 7])
    with hf_tpu.sim.stats() as s:
        got = torch.tpu.ops.ragged_dot(lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu"))
    assert got.device.type == "tpu" and s.host_syncs == 0
    torch.testing.assert_close(got.cpu(), _ragged_ref(lhs, rhs, sizes))
    out = torch.empty(10, 5, device="tpu")
    assert torch.tpu.ops.ragged_dot(lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu"), out=out) is out
    torch.testing.assert_close(out.cpu(), _ragged_ref(lhs, rhs, sizes))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_max_pool_and_its_backward_equal_torchs(dims):
    x = torch.randn(2, 3, *([6] * dims), generator=torch.Generator().manual_seed(dims))
    args = ([2] * dims, [2] * dims, [0] * dims, [1] * dims, False)
    pool = getattr(torch.tpu.ops, f"max_pool{dims}d")
    backward = getattr(torch.tpu.ops, f"max_pool{dims}d_backward")
    y = pool(x.to("tpu"), *args)
    ref_x = x.clone().requires_grad_()
    ref = getattr(F, f"max_pool{dims}d")(ref_x, 2)
    ref.backward(torch.ones_like(ref))
    assert torch.equal(y.cpu(), ref.detach())
    assert torch.equal(backward(torch.ones_like(y), x.to("tpu"), *args).cpu(), ref_x.grad)


def test_distributed_names_and_launch_env(monkeypatch):
    for name in ("TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "HF_TPU_SIM_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    torch.tpu.distributed.set_tpu_launch_env()
    assert os.environ["TORCH_TPU_TOPOLOGY"] == "2,2,1"  # the simulated host's 4 devices, as torch_tpu's v6e mesh
    assert len(os.environ["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 4
    assert torch.equal(torch.tpu.distributed.topology_aware_mesh((1,)), torch.tensor([0]))
    with pytest.raises(ValueError, match="world size 1"):
        torch.tpu.distributed.topology_aware_mesh((2, 2))
    f = torch.tpu.distributed.spmd_safe(lambda x: x * 2)
    assert f(3) == 6
    with pytest.raises(RuntimeError, match="TorchTPU device ops backend is not initialized"):
        torch.tpu.distributed.window_num_stripes  # noqa: B018


def test_names_that_need_a_chip_are_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"torch.tpu.ops.splash_sdpa .*splash_attention:splash_sdpa"):
        torch.tpu.ops.splash_sdpa(None, None, None)
    with pytest.raises(NotImplementedError, match="torch.tpu.pallas.get_pallas_mesh"):
        torch.tpu.pallas.get_pallas_mesh()
    a = torch.ones(2, device="tpu")
    assert torch.tpu.ops.optimization_barrier([a])[0] is a
    with torch.tpu.compiler.custom_compiler_options({"xla_optimization_level": "O1"}):
        assert torch.equal((a + 1).cpu(), torch.full((2,), 2.0))
