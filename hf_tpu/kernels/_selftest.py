"""Self-test check of the ragged-dot MoE experts kernel (see :mod:`hf_tpu.selftest`).

On a TPU VM this is the first run of the Pallas kernel through TorchTPU's JAX bridge; on the simulator it runs the
XLA path on the simulated buffers. Either way the result is compared with transformers' eager experts loop on CPU.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hf_tpu.selftest import CheckContext, SkipCheck, register_check


@register_check(
    "kernels", description="ragged-dot MoE experts kernel (Hub layout) matches the eager loop", quick=False, order=60
)
def _ragged_dot_experts(ctx: CheckContext) -> dict[str, Any]:
    if importlib.util.find_spec("jax") is None:
        raise SkipCheck("jax is not installed: pip install 'hf-tpu[kernels]' (on a TPU VM: 'jax[tpu]')")
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hf_tpu.kernels import load_ragged_dot_kernel

    kernel = load_ragged_dot_kernel()
    config = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4)
    config._experts_implementation = "eager"
    cpu = Qwen3MoeExperts(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cpu.gate_up_proj.copy_(torch.randn(cpu.gate_up_proj.shape, generator=g) / 128**0.5)
        cpu.down_proj.copy_(torch.randn(cpu.down_proj.shape, generator=g) / 256**0.5)
    dev = ctx.to_device(Qwen3MoeExperts(config).eval())
    dev.load_state_dict(cpu.state_dict())
    figures: dict[str, Any] = {}
    x = torch.randn(32, 128, generator=g)
    x_dev = ctx.to_device(x)
    for label in ("cold", "warm", "new_routing"):
        scores = torch.rand(32, 16, generator=g)
        weights, index = scores.topk(4, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        with torch.no_grad():
            expected = cpu(x, index, weights)
            with ctx.measure(figures, label):
                out = kernel.experts_forward(dev, x_dev, ctx.to_device(index), ctx.to_device(weights))
                ctx.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    return figures
