"""ragged-dot-tpu: MoE experts as a grouped matmul (ragged dot) for TPU, as a Hugging Face Hub kernel.

``experts_forward`` plugs into transformers' experts interface::

    from kernels import get_kernel
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    kernel = get_kernel("<org>/ragged-dot-tpu", version=1)
    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", kernel.experts_forward)
    model = AutoModelForCausalLM.from_pretrained(repo, experts_implementation="ragged_dot_tpu")

Unlike the default per-expert loop, whose shapes depend on how many tokens each expert receives (one device
compile per routing on TPU), every shape here depends only on the number of tokens, ``top_k`` and the expert
weights, whatever the routing.

It raises built-in exceptions (``ValueError``, ``RuntimeError``, ``NotImplementedError``, ``ImportError``): it is a
package of its own, loaded by ``kernels`` from the Hub, and imports nothing of hf_tpu.
"""

from __future__ import annotations

import torch

from ._ops import IMPLEMENTATIONS, OP_NAMESPACE, experts_op, ragged_dot, ragged_dot_op

__all__ = [
    "IMPLEMENTATIONS",
    "OP_NAMESPACE",
    "experts_forward",
    "experts_op",
    "make_experts_forward",
    "ragged_dot",
    "ragged_dot_op",
    "route",
]

__version__ = "1.0.0"


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, k) slots by expert. Returns ``(order, group_sizes)``, both of static shape.

    ``order`` (T * top_k,) lists the flattened slots grouped by expert (stable, so tokens keep their order inside
    a group); ``group_sizes`` (num_experts,) int32 counts them. Expert ids ``>= num_experts`` (the sentinels that
    expert parallelism uses for experts on other ranks) sort last and belong to no group.
    """
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    clamped = ids.clamp(max=num_experts).long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, clamped, torch.ones_like(clamped, dtype=torch.int32))
    return order, counts[:num_experts]


def _fusable(module: torch.nn.Module) -> bool:
    """Whether the whole experts layer can run as one JAX program (``experts_op``): transformers' default gate
    (``act(gate) * up`` on the concatenated halves) with SiLU, no biases, no post-expert norm."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    return (
        getattr(module, "has_gate", True)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(apply_gate, "__name__", None) == "_default_apply_gate"
        and type(act).__name__ in ("SiLUActivation", "SiLU")
    )


def make_experts_forward(implementation: str = "auto"):
    """An ``experts_forward`` that runs :func:`ragged_dot` with the given implementation (see its docstring)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")

    def experts_forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """transformers experts interface: (T, H) tokens, (T, k) expert ids and weights -> (T, H)."""
        if _fusable(self):  # routing, both grouped matmuls, gate and combine: one crossing into JAX
            rhs_transposed = not getattr(self, "is_transposed", False)  # (E, out, in) is "not transposed" upstream
            return experts_op(
                hidden_states,
                top_k_index.to(torch.int32),
                top_k_weights,
                self.gate_up_proj,
                self.down_proj,
                rhs_transposed,
                implementation,
            )
        num_experts = self.num_experts
        num_tokens, hidden_dim = hidden_states.shape
        top_k = top_k_index.shape[-1]
        has_gate = getattr(self, "has_gate", True)
        has_bias = getattr(self, "has_bias", False)
        rhs_transposed = not getattr(self, "is_transposed", False)

        order, group_sizes = route(top_k_index, num_experts)
        expert_ids = top_k_index.reshape(-1)[order].clamp(max=num_experts - 1)
        weights = top_k_weights.reshape(-1)[order]
        if getattr(self, "_is_expert_parallel", False):
            weights = weights.masked_fill(top_k_index.reshape(-1)[order] >= num_experts, 0)

        up_w = self.gate_up_proj if has_gate else self.up_proj
        x = hidden_states[order // top_k].to(up_w.dtype)
        h = ragged_dot(x, up_w, group_sizes, rhs_transposed=rhs_transposed, implementation=implementation)
        if has_bias:
            h = h + (self.gate_up_proj_bias if has_gate else self.up_proj_bias)[expert_ids]
        h = self._apply_gate(h) if has_gate else self.act_fn(h)
        h = ragged_dot(
            h.to(self.down_proj.dtype),
            self.down_proj,
            group_sizes,
            rhs_transposed=rhs_transposed,
            implementation=implementation,
        )
        if has_bias:
            h = h + self.down_proj_bias[expert_ids]
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        h = h * weights.unsqueeze(-1).to(h.dtype)
        out = torch.zeros_like(h).index_copy_(0, order, h)
        return out.view(num_tokens, top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

    experts_forward.__name__ = f"ragged_dot_tpu_experts_forward_{implementation}"
    return experts_forward


experts_forward = make_experts_forward("auto")
