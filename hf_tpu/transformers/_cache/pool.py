"""The static caches of the generation loop: one per (batch, cache length, encoder length, dtype) shape, reset and
reused across calls (at most ``CACHE_POOL_SIZE`` kept allocated per model), and the check that a model's cache can
be a bucketed static cache at all.

Each layer of a cache is the bucketed form of the upstream layer class ``StaticCache`` would build for it
(:mod:`hf_tpu.transformers._cache.layers`), allocated with the shapes the model's layers write
(:mod:`hf_tpu.transformers._cache.probe`).
"""

from __future__ import annotations

from hf_tpu.transformers._settings import CACHE_POOL_SIZE, ModelState

__all__: list[str] = []


def bucketed_cache(model, shapes: list[dict], batch: int, cache_len: int, host_length: bool = False):
    from transformers.cache_utils import Cache, StaticCache

    from hf_tpu.transformers._cache.layers import build_layers

    layers = build_layers(model.config, cache_len, shapes, batch, model.dtype, model.device, host_length)
    own = shapes[0].get("own") if shapes else None
    if own is not None:  # the model's own cache class, in its bucketed form
        from hf_tpu.transformers._cache.model_classes import OWN_CACHES

        return OWN_CACHES[own][1](layers, shapes, batch, model.dtype, model.device)
    cache = StaticCache.__new__(StaticCache)  # a StaticCache to upstream's isinstance checks, with bucketed layers
    Cache.__init__(cache, layers=layers)
    return cache


def cache_for(model, state: ModelState, batch: int, cache_len: int, encoder_len: int | None):
    """A reset static cache for this shape, reused across calls (at most ``CACHE_POOL_SIZE`` kept allocated)."""
    from transformers.cache_utils import EncoderDecoderCache

    from hf_tpu.transformers._cache.probe import cache_shapes

    key = (batch, cache_len, encoder_len, model.dtype, bool(state.host_length))
    cache = state.caches.pop(key, None)
    if cache is None:
        while len(state.caches) >= CACHE_POOL_SIZE:
            state.caches.popitem(last=False)
        self_shapes, cross_shapes = cache_shapes(model)
        cache = bucketed_cache(model, self_shapes, batch, cache_len, bool(state.host_length))
        if encoder_len is not None:
            cache = EncoderDecoderCache(cache, bucketed_cache(model, cross_shapes, batch, encoder_len))
    else:
        cache.reset()
    state.caches[key] = cache
    return cache


def static_cache_problem(model) -> str | None:
    """Why a bucketed static cache does not fit this model (None when it does)."""
    from hf_tpu.transformers._cache.layers import layer_problem
    from hf_tpu.transformers._cache.probe import CacheProbeError, cache_shapes

    if not model._supports_default_dynamic_cache():
        try:
            cache_shapes(model)  # measures the model's own cache: known classes have a bucketed form
        except CacheProbeError:
            return "it keeps its own cache type, which upstream's StaticCache does not replace"
    try:
        unknown = layer_problem(model.config)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as exc:  # pragma: no cover
        return f"upstream's StaticCache cannot be built for it ({exc})"
    if unknown:
        return unknown
    try:
        self_shapes, _ = cache_shapes(model)
    except CacheProbeError as exc:
        return f"its static cache cannot be sized ahead of time: {exc}"
    if self_shapes and not any(self_shapes):
        return (
            "its forward writes nothing into the cache it is given (it recomputes the whole sequence each step): "
            "a static cache cannot serve it"
        )
    return None
