"""The kernel on hf_tpu's simulated ``tpu`` device: same results as on CPU, static shapes, no host traffic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax", reason="the ragged-dot kernel runs in JAX: pip install 'hf-tpu[kernels]'")

from ragged_helpers import make_experts, routing

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
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hf_tpu.kernels import use_ragged_dot_experts

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    name = use_ragged_dot_experts()
    cpu = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
    dev = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation=name).eval().to("tpu")
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = dev(ids.to("tpu")).logits
    assert logits.device.type == "tpu"
    with torch.no_grad():
        torch.testing.assert_close(logits.cpu(), cpu(ids).logits, atol=1e-5, rtol=1e-5)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    torch.testing.assert_close(dev.generate(ids.to("tpu"), **kwargs).cpu(), cpu.generate(ids, **kwargs))
