"""Tiny transformers models for tests and examples: built from configs, random weights, saved locally.

No Hub access and a few hundred thousand parameters at most, so TPU code can be tested on a laptop or in CI on
hf_tpu's simulated device (``hf_tpu.sim.enable()``), against the same model on the CPU::

    from hf_tpu.testing import tiny_model

    path = tmp_path / "llama"
    cpu = tiny_model("llama", path)                       # saved with save_pretrained
    tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu")

Every size is a keyword override of the config (``tiny_config("llama", num_key_value_heads=1)``). Diffusers
pipelines have their own builders in :mod:`hf_tpu.diffusers.testing`.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["FAMILIES", "tiny_config", "tiny_model"]

# Shared by the decoder families: 2 layers, hidden 32, 4 heads (head_dim 8), 2 KV heads.
_COMMON = {"vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # family: (config class, model class, defaults besides _COMMON)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_DECODER, "num_key_value_heads": 1, "head_dim": 8}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "decoder_start_token_id": 0},
    ),
    # MoE families with the same expert shapes (hidden 32, expert intermediate 16, 8 experts, top-2)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_DECODER, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_DECODER, "intermediate_size": 16, "head_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
}


def _family(family: str) -> tuple[str, str, dict[str, Any]]:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}") from None


def tiny_config(family: str = "llama", **overrides: Any) -> Any:
    """The config of a tiny ``family`` model (see :data:`FAMILIES`), any field overridden by keyword.

    Example:
        >>> tiny_config("llama", num_key_value_heads=1).num_key_value_heads
        1
    """
    import transformers

    config_class, _, defaults = _family(family)
    return getattr(transformers, config_class)(**{**_COMMON, **defaults, **overrides})


def tiny_model(
    family: str = "llama", path: str | os.PathLike | None = None, *, seed: int = 0, **overrides: Any
) -> Any:
    """A tiny ``family`` model with weights drawn from ``torch.manual_seed(seed)``, in eval mode on the CPU.

    ``path``: also saved there with ``save_pretrained`` (load it back with ``from_pretrained(path, ...)``).
    ``overrides``: config fields (see :func:`tiny_config`); a ``config`` keyword takes a whole config instead.

    Example:
        >>> model = tiny_model("qwen3", tie_word_embeddings=True)
        >>> model.lm_head.weight is model.model.embed_tokens.weight
        True
    """
    import torch
    import transformers

    _, model_class, _ = _family(family)
    config = overrides.pop("config", None)
    if config is not None and overrides:
        raise ValueError(f"tiny_model: pass either config= or config fields ({', '.join(overrides)}), not both")
    config = config if config is not None else tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    if path is not None:
        model.save_pretrained(path)
    return model
