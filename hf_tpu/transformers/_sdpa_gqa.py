"""Grouped-query attention on a ``tpu`` device reaches sdpa with its key/value heads, not repeated to the query's.

transformers' ``sdpa_attention_forward`` (5.24) passes ``enable_gqa=True`` only where ``use_gqa_in_sdpa`` says so: on
CUDA only without a mask. Otherwise it calls ``repeat_kv``, which expands the cache's KV heads to the query's
(``expand`` + ``reshape``: 4x for Llama-3-8B's 32 query / 8 KV heads) before every attention. torch_tpu 0.2.0 has a
compiler pass that folds exactly that pattern back into sdpa (``_internal/compile/fx_passes/fold_gqa.py``), but it
matches only ``scaled_dot_product_attention``, ``_scaled_dot_product_fused_attention_overrideable`` and
``_scaled_dot_product_efficient_attention``, while torch_tpu's flash kernel is registered as
``_scaled_dot_product_cudnn_attention`` (hf_tpu/sim/_attention.py): the expansion stays in every compiled graph.

Read from libtpu's optimized decode program of a 4096-wide Llama (docs/planning.md): at a 2304-token cache the
expanded K and V (4 x 4.7 MB per layer) are built in on-chip memory, 47 MB of XLA's ``bytes accessed`` per layer;
at 6400 tokens they no longer fit there and the decode step reads 1.77x its floor from HBM instead of 1.07x. With
the heads passed as they are, torch_tpu's flash kernel takes the 8 KV heads itself (its Mosaic call gets
``bf16[1,8,T,128]``) and the results are bit-identical (measured on a v5e chip: caches and logits, max abs diff 0).

The patched ``use_gqa_in_sdpa`` answers True for key/value tensors on a ``tpu`` device whose head sizes match (as
upstream asks of CUDA), and calls upstream for every other device.
"""

from __future__ import annotations

import functools

from hf_tpu._patch import original, patch

__all__ = ["apply", "gqa_on_tpu"]


def gqa_on_tpu(key, value) -> bool:
    """Whether sdpa should get ``enable_gqa=True`` for this key/value pair: both on a tpu device, same head size."""
    return key.device.type == "tpu" and value.device.type == "tpu" and key.shape[-1] == value.shape[-1]


def apply(feature: str) -> None:
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:  # pragma: no cover - every supported transformers has it
        return
    if not hasattr(sdpa_attention, "use_gqa_in_sdpa"):  # pragma: no cover - a transformers without the hook
        return
    upstream = original(sdpa_attention, "use_gqa_in_sdpa")

    @functools.wraps(upstream)
    def use_gqa_in_sdpa(attention_mask, key, *args, **kwargs):
        value = args[0] if args else kwargs.get("value", key)
        if gqa_on_tpu(key, value):
            return True
        return upstream(attention_mask, key, *args, **kwargs)

    patch(sdpa_attention, "use_gqa_in_sdpa", use_gqa_in_sdpa, feature=feature, package="transformers",
          versions=">=5.23,<6")  # fmt: skip
