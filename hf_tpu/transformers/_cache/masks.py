"""The 2D attention masks hf_tpu's compiled graphs hand a model with a bucketed static cache: a prefill's
(:func:`prefill_mask`) and a decode step's (:func:`decode_mask`, with the columns a sliding-window ring reads).

The loop's 2D mask has one column per cache position, the positions after the prompt True (the tokens to come). What
a model reads of it differs by layer kind (linear-attention layers want one column per input token, sliding-window
rings one per ring slot, a bidirectional attention must not see the empty slots), so the graphs hand it through
these functions, which run inside the graphs from the cache's device-side counters: no copy per step. How upstream's
sdpa mask then takes the 2D mask's padding on a ``tpu`` device is the patch in
:func:`~hf_tpu.transformers._cache.static.apply_padding_mask`.
"""

from __future__ import annotations

__all__: list[str] = []


def _written(cache, mask, q: int):
    """``mask`` with the cache positions that hold no token once this graph's ``q`` tokens are written set False.

    The loop's mask marks every position after the prompt True (the tokens to come). A causal mask hides them from
    each query anyway; a model whose attention is not causal (an encoder's LM head as a decoder: RoBERTa, BERT,
    ELECTRA with ``is_decoder=False``) builds a bidirectional mask from the 2D mask alone, so without this its
    queries would also read the empty slots, where upstream's growing cache has no keys at all. Runs inside the
    graph, from the device-side counter of the first layer that has one: no copy per step."""
    import torch

    self_cache = getattr(cache, "self_attention_cache", cache)
    kept = (layer for layer in self_cache.layers if getattr(layer, "is_initialized", False))
    counters = (getattr(layer, "cumulative_length", None) for layer in kept)
    counter = next((c for c in counters if isinstance(c, torch.Tensor)), None)
    if counter is None:  # no layer keeps keys (linear attention / SSM only): nothing reads the columns
        return mask
    slots = torch.arange(mask.shape[1], device=mask.device)
    return mask & (slots < counter + q)


def prefill_mask(cache, mask, q: int):
    """The 2D mask a prefill hands the model: the prompt's own ``q`` columns when the cache has linear-attention
    layers (upstream zeroes their padded inputs with a mask of one column per input token), else one column per
    cache position (the keys the attention reads: models that derive a position bias from the mask, such as Bloom's
    alibi, need one column per key; the causal mask reads either form), the positions after the prompt False
    (:func:`_written`)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    self_cache = getattr(cache, "self_attention_cache", cache)
    if any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self_cache.layers):
        return mask[:, :q]
    return _written(cache, mask, q)


def decode_mask(cache, mask):
    """The 2D mask a decode step hands the model: ``mask`` (one column per cache position), followed, when the cache
    has sliding-window rings, by one column per ring slot saying whether the position it holds is a real token.

    The ring layers report ``(window, cache length)`` as their mask sizes, so upstream's sliding mask reads exactly
    these columns; the full-attention layers read the first ``cache length`` ones, those after the token this step
    writes False (:func:`_written`). Runs inside the decode graph (the ring's position is its device-side counter):
    no copy per step."""
    import torch

    ring = next((la for la in getattr(cache, "layers", ()) if getattr(la, "ring", False)), None)
    written = _written(cache, mask, 1)
    if ring is None:
        return written
    window = ring.max_cache_len
    # the ring holds positions counter - window + 1 ... counter (the token this step writes)
    positions = ring.cumulative_length + 1 - window + torch.arange(window, device=mask.device)
    real = mask.index_select(1, positions.clamp(min=0)) & (positions >= 0)
    return torch.cat([written, real], dim=1)
