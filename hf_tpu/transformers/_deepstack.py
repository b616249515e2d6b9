"""Deepstack's addition of early vision features at the image tokens, with static shapes.

Qwen3-VL's text model (transformers 5.24 ``_deepstack_process``; the same body in Qwen3-VL-MoE, Qwen3-Omni-MoE,
GraniteDocling and Cohere Compass) adds the features of early vision blocks to the hidden states of the first decoder
layers at the image tokens by indexing with a boolean mask (``hidden_states[mask, :] + embeds``, then an
``index_put``). In a compiled graph the mask's row count depends on the data: torch_tpu 0.2.0 refuses to lower the
image prefill ("nonzero(): cannot record EventSnapshot during an FX trace", the contract tier's Qwen3-VL case).

The replacement scatters the features into zeros of the hidden states' shape at the masked rows (``masked_scatter``,
a static shape, as the image merge itself) and adds that: the same values as upstream's, bit for bit (the image rows
get ``x + e`` as there, the others ``x + 0``, which is ``x``). It is applied to the class that defines the method when
hf_tpu's loop first runs an image prefill of such a model (:func:`apply_to`, from ``_graphs.run_graph``), recorded
under the generation feature and reverted with it.
"""

from __future__ import annotations

from typing import Any

from hf_tpu._patch import patch

__all__ = ["apply_to", "static_deepstack"]

_NAME = "_deepstack_process"


def static_deepstack(self: Any, hidden_states: Any, visual_pos_masks: Any, visual_embeds: Any) -> Any:
    """Upstream's ``_deepstack_process`` without a data-dependent shape: ``visual_embeds`` (one row per ``True`` of
    ``visual_pos_masks``, in order) added to ``hidden_states`` at the masked positions.

    Args:
        self: the text model (unused; the method's signature).
        hidden_states: ``(batch, length, hidden)``.
        visual_pos_masks: ``(batch, length)`` booleans, True at the image tokens.
        visual_embeds: ``(image tokens, hidden)``.

    Returns:
        A new tensor shaped like ``hidden_states``.
    """
    import torch

    mask = visual_pos_masks.to(hidden_states.device)[..., None].expand_as(hidden_states)
    embeds = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    return hidden_states + torch.zeros_like(hidden_states).masked_scatter(mask, embeds)


def apply_to(model: Any) -> bool:
    """Give the class of ``model``'s module that defines ``_deepstack_process`` the static version (once per class,
    recorded under the generation feature); True when the model has deepstack."""
    for module in model.modules():
        owner = next((c for c in type(module).__mro__ if _NAME in c.__dict__), None)
        if owner is not None:
            if owner.__dict__[_NAME] is not static_deepstack:
                patch(owner, _NAME, static_deepstack, feature="generation", package="transformers",
                      versions=">=5.23,<6")  # fmt: skip
            return True
    return False
