"""The static KV caches of the generation loop: one per (batch, cache length, encoder length, dtype) shape, reset and
reused across calls (at most ``_CACHE_POOL_SIZE`` kept allocated per model), and the check that a model's cache can
be a bucketed static cache at all.
"""

from __future__ import annotations

from hf_tpu.transformers._settings import _CACHE_POOL_SIZE, _ModelState

__all__: list[str] = []

def _cache_for(model, state: _ModelState, batch: int, cache_len: int, encoder_len: int | None):
    """A reset static cache for this shape, reused across calls (at most ``_CACHE_POOL_SIZE`` kept allocated)."""
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    key = (batch, cache_len, encoder_len, model.dtype)
    cache = state.caches.pop(key, None)
    if cache is None:
        while len(state.caches) >= _CACHE_POOL_SIZE:
            state.caches.popitem(last=False)
        config = model.config.get_text_config(decoder=True)
        self_cache = StaticCache(config=config, max_cache_len=cache_len)
        shape = model._get_static_cache_init_shape()
        if shape is None:
            raise NotImplementedError(
                f"hf_tpu cannot size a static cache for {type(model).__name__} ahead of time; "
                "call generate with disable_compile=True to use upstream's loop."
            )
        num_heads, head_dim = shape
        self_cache.early_initialization(batch, num_heads, head_dim, model.dtype, model.device)
        if encoder_len is not None:
            cross = StaticCache(config=config, max_cache_len=encoder_len)
            cross.early_initialization(batch, num_heads, head_dim, model.dtype, model.device)
            cache = EncoderDecoderCache(self_cache, cross)
        else:
            cache = self_cache
    else:
        cache.reset()
    state.caches[key] = cache
    return cache


def _static_cache_problem(model) -> str | None:
    """Why a bucketed static cache does not fit this model (None when it does)."""
    from transformers.cache_utils import StaticCache, StaticLayer

    if not model._supports_default_dynamic_cache():
        return f"{type(model).__name__} keeps its own cache type"
    try:
        probe = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=16)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as exc:  # pragma: no cover
        return f"a static cache cannot be built for it ({exc})"
    kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not StaticLayer}
    if kinds:
        return f"its cache has {', '.join(sorted(kinds))} layers (sliding-window/linear attention is not bucketed yet)"
    if model._get_static_cache_init_shape() is None:
        return "its static cache cannot be sized ahead of time"
    return None

