"""The kernel on hf_tpu's simulated ``tpu`` device: same results as on CPU, static shapes, no host traffic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax", reason="the ragged-dot kernel runs in JAX: pip install 'hf-tpu[kernels]'")

from ragged_helpers import kernel_ops, make_experts, routing, tiny_moe

import hf_tpu.sim


@pytest.fixture(autouse=True)
def _sim():
    hf_tpu.sim.enable()
    yield


def test_plain_kernels_selects_torch_tpu_on_the_simulator():
    from kernels import get_local_kernel

    from hf_tpu.kernels import RAGGED_DOT_REPO

    assert hasattr(torch.backends, "tpu")  # the simulator exposes it like TorchTPU does
    module = get_local_kernel(RAGGED_DOT_REPO)
    assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")


def test_experts_on_the_simulator_match_cpu_with_static_shapes_and_no_host_traffic(kernel):
    cpu = make_experts(num_experts=8)
    dev = make_experts(num_experts=8).to("tpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    x_dev = x.to("tpu")
    with torch.no_grad():
        index, weights = routing("random", 4, 8, 2, g)
        kernel.experts_forward(dev, x_dev, index.to("tpu"), weights.to("tpu"))  # warm-up: first signatures
        for kind in ("random", "one_expert", "half_empty", "random"):
            index, weights = routing(kind, 4, 8, 2, g)
            index_dev, weights_dev = index.to("tpu"), weights.to("tpu")
            with hf_tpu.sim.stats() as s:
                out = kernel.experts_forward(dev, x_dev, index_dev, weights_dev)
            assert out.device.type == "tpu"
            assert (s.shape_signatures, s.host_syncs, s.h2d_copies, s.d2h_copies) == (0, 0, 0, 0), s.report()
            torch.testing.assert_close(out.cpu(), kernel.experts_forward(cpu, x, index, weights), atol=1e-6, rtol=0)
            with hf_tpu.sim.stats() as loop:
                dev.forward.__wrapped__(dev, x_dev, index_dev, weights_dev)  # transformers' eager loop
            assert loop.host_syncs > 0  # what the kernel avoids: the loop reads the routing on the host


def test_tiny_qwen3_moe_on_the_simulator_matches_cpu(tmp_path):
    from hf_tpu.kernels import use_ragged_dot_experts

    cls, config = tiny_moe("qwen3_moe")
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    name = use_ragged_dot_experts()
    cpu = cls.from_pretrained(tmp_path, experts_implementation="eager").eval()
    dev = cls.from_pretrained(tmp_path, experts_implementation=name).eval().to("tpu")
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = dev(ids.to("tpu")).logits
    assert logits.device.type == "tpu"
    with torch.no_grad():
        torch.testing.assert_close(logits.cpu(), cpu(ids).logits, atol=1e-5, rtol=1e-5)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    torch.testing.assert_close(dev.generate(ids.to("tpu"), **kwargs).cpu(), cpu.generate(ids, **kwargs))


@pytest.fixture
def torch_tpu_bridge(kernel, monkeypatch):
    """A stand-in for TorchTPU's JAX bridge, in the shape of torch_tpu 0.2's API:
    ``torch.tpu.pallas.custom_jax_kernel(fn, name=..., warn_deprecated=False)`` returns a callable taking torch
    tensors. It runs the JAX function on the tensors' host views (each one a whole array: TorchTPU passes no
    tuples); the kernel sees the tensors as non-simulated, as TorchTPU's would. Yields the (name,
    warn_deprecated) of every bridge built."""
    import types

    import jax

    ops = kernel_ops(kernel)
    calls = []

    def custom_jax_kernel(fn, name=None, warn_deprecated=True):
        calls.append((name, warn_deprecated))

        def run(*tensors):
            arrays = [jax.dlpack.from_dlpack(hf_tpu.sim.host_view(t).contiguous()) for t in tensors]
            result = torch.from_dlpack(fn(*arrays))
            out = torch.empty(result.shape, dtype=result.dtype, device="tpu")
            hf_tpu.sim.host_view(out).copy_(result)
            return out

        return run

    monkeypatch.setattr(torch.tpu, "pallas", types.SimpleNamespace(custom_jax_kernel=custom_jax_kernel), raising=False)
    monkeypatch.setattr(ops, "_host_view", lambda t: None)  # as if these were TorchTPU tensors
    monkeypatch.setattr(ops, "_TPU_CALLABLES", {})
    return calls


def test_torch_tpu_branch_hands_the_jax_function_to_torch_tpu_bridge(kernel, torch_tpu_bridge):
    """Real-TPU branch: the JAX function goes to TorchTPU's bridge, built once per (implementation, layout)."""
    g = torch.Generator().manual_seed(0)
    lhs, rhs, sizes = torch.randn(12, 16, generator=g), torch.randn(3, 24, 16, generator=g), torch.tensor([4, 0, 8])
    expected = kernel.ragged_dot(lhs, rhs, sizes, rhs_transposed=True)
    for _ in range(2):  # the bridge callable is built once per (implementation, layout)
        out = kernel.ragged_dot(
            lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu"), rhs_transposed=True, implementation="pallas_interpret"
        )
        assert out.device.type == "tpu"
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch_tpu_bridge == [("ragged_dot_tpu_ragged_dot_pallas_interpret_nk", False)]


def test_torch_tpu_branch_runs_the_fused_experts_through_the_bridge(kernel, torch_tpu_bridge):
    """The fused experts op on the real-TPU branch: the whole layer goes to TorchTPU's bridge as one JAX function
    (weights as whole arrays), and comes back equal to the CPU result."""
    cpu = make_experts(num_experts=8)
    dev = make_experts(num_experts=8).to("tpu")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 32, generator=g)
    index, weights = routing("half_empty", 5, 8, 2, g)
    forward = kernel.make_experts_forward("pallas_interpret")
    with torch.no_grad():
        out = forward(dev, x.to("tpu"), index.to("tpu"), weights.to("tpu"))
        expected = kernel.experts_forward(cpu, x, index, weights)
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch_tpu_bridge == [("ragged_dot_tpu_moe_experts_pallas_interpret_nk", False)]
