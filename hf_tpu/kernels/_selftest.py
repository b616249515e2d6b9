"""Self-test check of the ragged-dot MoE experts kernel (see :mod:`hf_tpu.selftest`).

On a TPU VM this is the first run of the Pallas kernel through TorchTPU's JAX bridge; on the simulator it runs the
XLA path on the simulated buffers. Either way the result is compared with transformers' eager experts loop on CPU.

Before running the kernel it checks, and names when they do not hold, the two things a TPU VM can get wrong
that the simulator cannot show:

- ``kernels`` selects the ``torch-tpu`` build variant under ``hf_tpu.enable()`` (plain ``get_local_kernel`` on
  the shipped repository);
- on a real TPU, TorchTPU's public JAX bridge ``torch.tpu.pallas.jax_op`` exists and registers the kernel's ops.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check

_VARIANT = "build/torch-tpu/ragged_dot_tpu/__init__.py"


def _kernels_backend() -> str:
    """kernels' own answer to "which backend is this" (:func:`hf_tpu.kernels.kernels_backend`; only to word an
    error)."""
    from hf_tpu.kernels.loader import kernels_backend

    try:
        return kernels_backend()
    except Exception as exc:  # noqa: BLE001 - only for the message
        return f"unknown ({type(exc).__name__}: {exc})"


def check_variant_selection() -> str:
    """Plain ``kernels.get_local_kernel`` on the shipped repository, with hf_tpu's kernels integration enabled, must
    load the ``torch-tpu`` variant. Returns the variant's name; raises AssertionError naming what kernels chose."""
    from kernels import get_local_kernel

    from hf_tpu._patch import enabled
    from hf_tpu.kernels.loader import RAGGED_DOT_REPO

    with enabled("kernels"):
        try:
            module = get_local_kernel(RAGGED_DOT_REPO)
        except Exception as exc:  # reworded below with kernels' backend
            raise CheckFailed(
                "variant: with hf_tpu.enable(), kernels.get_local_kernel did not select the torch-tpu build variant "
                f"(kernels sees backend {_kernels_backend()!r}): {type(exc).__name__}: {exc}"
            ) from exc
    path = str(module.__file__).replace("\\", "/")
    if not path.endswith(_VARIANT):
        raise CheckFailed(f"variant: kernels loaded {path}, expected the torch-tpu variant ({_VARIANT})")
    return "torch-tpu"


def check_jax_op(kernel) -> list[str]:
    """On TorchTPU: the kernel's ops registered through ``torch.tpu.pallas.jax_op``; returns their names."""
    import importlib

    ops = importlib.import_module(f"{kernel.__name__}._ops")
    try:
        registered = ops.torch_tpu_ops()
    except RuntimeError as exc:
        raise CheckFailed(f"jax_op: {exc}") from exc
    return sorted(op._qualname for op in registered.values())


@register_check(
    "kernels", description="ragged-dot MoE experts kernel (Hub layout) matches the eager loop", quick=False, order=60
)
def _ragged_dot_experts(ctx: CheckContext) -> dict[str, Any]:
    if importlib.util.find_spec("jax") is None:
        if not ctx.simulated:
            raise CheckFailed(
                "jax: not installed, but the kernel runs in JAX and TorchTPU's jax_op needs it: "
                "pip install 'hf-tpu[tpu]' (brings jax; not 'jax[tpu]', whose libtpu pin conflicts with torch-tpu)"
            )
        raise SkipCheck("jax is not installed: pip install 'hf-tpu[kernels]'")
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hf_tpu.kernels.loader import load_ragged_dot_kernel

    figures: dict[str, Any] = {"variant": check_variant_selection()}
    kernel = load_ragged_dot_kernel()
    if not ctx.simulated:
        figures["jax_op"] = check_jax_op(kernel)
    config = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4)
    config._experts_implementation = "eager"
    cpu = Qwen3MoeExperts(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cpu.gate_up_proj.copy_(torch.randn(cpu.gate_up_proj.shape, generator=g) / 128**0.5)
        cpu.down_proj.copy_(torch.randn(cpu.down_proj.shape, generator=g) / 256**0.5)
    dev = ctx.to_device(Qwen3MoeExperts(config).eval())
    dev.load_state_dict(cpu.state_dict())
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
                ctx.compare(out, expected, figures, layers=2, what="the experts' output")
    return figures
