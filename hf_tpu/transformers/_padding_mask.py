"""The padding part of transformers' sdpa mask on a ``tpu`` device as a broadcast, not a gather of single elements.

transformers' ``sdpa_mask`` (5.23-5.25) adds a 2D padding mask to the mask function as
``padding_mask[batch_idx, kv_idx]`` with ``batch_idx = arange(batch)[:, None, None, None]`` and ``kv_idx =
arange(kv_length)[None, None, None, :] + kv_offset``: advanced indexing, which lowers to a ``gather`` of one element
per (row, slot). Those indices only ever pick the rows in order and the columns ``kv_offset ... kv_offset +
kv_length - 1``, so the same mask is ``padding_mask[:, kv_offset : kv_offset + kv_length]`` broadcast over the
query positions. Measured on a TPU v5e (docs/planning.md, "Measured on a chip"): in hf_tpu's Llama-3.2-1B-shaped
decode program at batch 64 (a 640-slot cache) that gather of 40,960 elements took 431 us of a 10.3 ms step, where
the lean JAX step it is compared with builds its mask from a comparison.

The patched ``sdpa_mask`` takes that path for a 2D boolean mask on a ``tpu`` device whose rows are the batch (as
upstream's indexing needs) and a static ``kv_offset``, without vmap: it asks upstream for the mask function's own
mask and ands the sliced padding into it, after upstream's own early exits (``None`` where sdpa's ``is_causal`` or
no mask will do), which it evaluates on the same padded mask. Any other call goes to upstream unchanged.
``eager_mask`` calls the module's ``sdpa_mask`` and takes the same path; the ``AttentionMaskInterface`` entry
``"sdpa"`` is replaced too. The result equals upstream's element for element (tests/transformers/test_padding_mask.py).
"""

from __future__ import annotations

import functools

__all__ = ["apply", "takes_broadcast"]


def takes_broadcast(attention_mask, batch_size: int, kv_offset, use_vmap: bool) -> bool:
    """Whether the padding can be taken as a broadcast slice: a 2D bool mask on tpu, a row per batch entry."""
    import torch

    return (
        not use_vmap
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.device.type == "tpu"
        and attention_mask.dim() == 2
        and attention_mask.dtype == torch.bool
        and attention_mask.shape[0] == batch_size
        and isinstance(kv_offset, int)
    )


def apply(feature: str) -> None:
    from transformers import masking_utils

    from hf_tpu._patch import on_revert, original, patch

    upstream = original(masking_utils, "sdpa_mask")
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)

    @functools.wraps(upstream)
    def sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                  mask_function=masking_utils.causal_mask_function, attention_mask=None, local_size=None,
                  allow_is_causal_skip=True, allow_is_bidirectional_skip=False, use_vmap=False, device="cpu",
                  **kwargs):  # fmt: skip
        if not takes_broadcast(attention_mask, batch_size, kv_offset, use_vmap):
            return upstream(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                            mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                            allow_is_causal_skip=allow_is_causal_skip,
                            allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap,
                            device=device, **kwargs)  # fmt: skip
        padding_mask = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if allow_is_causal_skip and masking_utils._ignore_causal_mask_sdpa(
            padding_mask, q_length, kv_length, q_offset, kv_offset, local_size
        ):
            return None
        if allow_is_bidirectional_skip and masking_utils._ignore_bidirectional_mask_sdpa(
            padding_mask, kv_length, local_size
        ):
            return None
        mask = upstream(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=None, local_size=local_size,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=False, device=device,
                        **kwargs)  # fmt: skip
        return mask & padding_mask[:, None, None, kv_offset : kv_offset + kv_length]

    sdpa_mask.__hf_tpu_upstream__ = upstream
    patch(masking_utils, "sdpa_mask", sdpa_mask, feature=feature, package="transformers", versions=">=5.23,<6")
    interface = masking_utils.AttentionMaskInterface
    registered = interface._global_mapping.get("sdpa")
    if registered is upstream:
        interface._global_mapping["sdpa"] = sdpa_mask
        on_revert(feature, lambda: interface._global_mapping.__setitem__("sdpa", upstream))
