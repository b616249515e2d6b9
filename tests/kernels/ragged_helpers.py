"""Float64 references, routings and tiny experts modules for the kernels tests."""

from __future__ import annotations

import importlib

import numpy as np
import torch


def ragged_dot_reference(lhs, rhs, group_sizes, rhs_transposed=False) -> np.ndarray:
    """Float64 per-group loop: the definition of ragged dot (rows past the groups are zero)."""
    lhs = np.asarray(lhs, dtype=np.float64)
    rhs = np.asarray(rhs, dtype=np.float64)
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes).tolist()):
        w = rhs[g].T if rhs_transposed else rhs[g]
        out[start : start + size] = lhs[start : start + size] @ w
        start += size
    return out


def routing(kind: str, num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator):
    """(top_k_index, top_k_weights) for a named routing pattern."""
    if kind == "random":
        scores = torch.rand(num_tokens, num_experts, generator=generator)
        index = scores.topk(top_k, dim=-1).indices
    elif kind == "one_expert":  # every token's first choice is expert 3, the rest are fixed neighbours
        index = (torch.arange(top_k) + 3).remainder(num_experts).expand(num_tokens, top_k).contiguous()
    elif kind == "half_empty":  # only the even experts get tokens
        scores = torch.rand(num_tokens, num_experts, generator=generator)
        scores[:, 1::2] = -1
        index = scores.topk(top_k, dim=-1).indices
    else:
        raise ValueError(kind)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    weights = weights / weights.sum(-1, keepdim=True)
    return index, weights


def experts_reference(module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """Float64 per-token loop over the chosen experts of a Qwen3/Mixtral-style experts module."""
    x = hidden_states.double()
    gate_up = module.gate_up_proj.detach().double()
    down = module.down_proj.detach().double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            h = torch.nn.functional.silu(gate) * up
            out[t] += float(top_k_weights[t, j]) * (down[e] @ h)
    return out


def make_experts(num_experts: int, hidden: int = 32, intermediate: int = 16, dtype=torch.float32, seed: int = 0):
    """A transformers Qwen3MoeExperts module with random weights (upstream class, decorated upstream)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts, num_experts_per_tok=2
    )
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) / hidden**0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) / intermediate**0.5)
    return module.to(dtype).eval()


def tiny_moe(family: str):
    """(model class, config) of a tiny Qwen3-MoE or Mixtral with the same expert shapes."""
    import transformers

    from hf_tpu.testing import FAMILIES, tiny_config

    return getattr(transformers, FAMILIES[family][1]), tiny_config(family, vocab_size=256)


def kernel_ops(kernel):
    """The loaded kernel's torch side (``<package>._ops``)."""
    return importlib.import_module(f"{kernel.__name__}._ops")


def jax_kernels(kernel):
    """The loaded kernel's JAX side (``<package>._jax_kernels``)."""
    return importlib.import_module(f"{kernel.__name__}._jax_kernels")
