"""The static cache of hf_tpu's generation loop: its layout (the bucketed form of each of upstream's cache layer
kinds, and the check that a model's cache can be a bucketed static cache at all, :func:`static_cache_problem`), the
caches built from it (one per (batch, cache length, encoder length, dtype) shape, reset and reused across calls, at
most ``CACHE_POOL_SIZE`` kept allocated per model), what the loops tell its layers on the host (the host length,
prefill or decode), and how upstream's sdpa mask takes the 2D mask's padding on a tpu device
(:func:`apply_padding_mask`, a patch through :mod:`hf_tpu._patch`).

Where a decode step writes its K/V rows is :mod:`~hf_tpu.transformers._cache.writes`; the 2D masks the graphs hand
the model are :mod:`~hf_tpu.transformers._cache.masks`. The padding-mask patch stays here, with what a ``generate``
call runs before its first graph (the route's check, the cache's allocation, the host length): the cache probe's
forward runs the patched mask, and tests/transformers/test_engine_path.py holds that path to a ceiling of files.

The bucketed forms are a registry keyed by upstream's layer class. hf_tpu's loop runs one compiled prefill graph per
(prompt bucket, cache bucket) and one decode graph per cache bucket, so a cache layer may change only tensors inside a
graph, never the Python state dynamo guards on (an int that grows per step would compile a new graph per step).
Upstream's ``StaticCache`` (transformers 5.24) builds its layers from ``config.layer_types`` with
``STATIC_LAYER_TYPE_MAPPING``; ``BUCKETED_LAYERS`` (in :mod:`~hf_tpu.transformers._cache.layer_classes`) maps each of
those classes to its bucketed form:

* full attention (``StaticLayer``): upstream's class (``BucketedStaticLayer``: its own update but for a decode step
  on a ``tpu`` device with large caches, :func:`~hf_tpu.transformers._cache.writes.kv_rows_after`, whose graph
  reads the cache with the new row selected in and leaves the row to
  :func:`~hf_tpu.transformers._cache.writes.write_rows`, written in place after the graph: on torch_tpu by one JAX
  program for every layer with the caches donated), ``cache bucket`` slots written at
  a device-side counter;
* sliding window (``StaticSlidingWindowLayer``, chunked attention too): upstream's layer tracks the window with a
  Python int (a new graph per step until the window fills). The bucketed layer is a ring of ``sliding_window``
  slots when the cache bucket is longer than the window: the prefill attends to the prompt's own states and keeps
  the last ``window`` of them; a decode step shifts the ring by one and attends to it, its padding read from mask
  columns :func:`~hf_tpu.transformers._cache.masks.decode_mask` appends inside the decode graph. A cache bucket no
  longer than the window keeps one slot per position, as upstream does (the sliding mask applies the window);
* linear attention / SSM (``LinearAttentionLayer``: conv and recurrent states of a fixed size): upstream flips
  ``has_previous_state`` inside the forward; here the loop sets it on the host (:func:`set_decoding`): off for the
  prefill graph, on for the decode graph. The left padding of a bucketed prompt leaves the states as the unpadded
  prompt would: upstream's recurrent mask zeroes padded inputs (the loop hands the prefill the prompt's own mask)
  and a zero input on a zero state leaves it zero;
* hybrid layers (``LinearAttentionAndStaticFullAttentionLayer``, ``...SlidingWindowAttentionLayer``): both of the
  above in one layer (the sliding-window one keeps one slot per cache position, no ring);
* indexed attention (``StaticIndexedLayer``: DeepSeek-V3.2-style sparse attention, whose indexer caches one key per
  token besides the attention's own): upstream's own class, its indexer keys ``cache bucket`` slots written at a
  device-side counter of their own, allocated ahead like the KV (the indexer scores every slot; the causal mask it
  is handed hides the empty and padded ones, as it hides them from the attention);
* ``DummyLayer`` (shared-KV or attention-free layers): holds nothing, kept as is.

Some layer kinds can have no bucketed form: :data:`NO_STATIC_FORM` names them, keyed by upstream's layer type, with
the reason generate gives when it runs upstream's loop for them (DeepSeek-V4's heavily compressed attention).

A model that keeps its own cache class (``_supports_default_dynamic_cache()`` False) runs the loop when that class
has a bucketed form in :mod:`~hf_tpu.transformers._cache.model_classes` (MiniMax's), built around these layers.

Each layer is allocated ahead of the first graph with the shapes the model's own attention writes
(:mod:`hf_tpu.transformers._cache.probe`), so multi-query, multi-latent and unequal encoder/decoder attention get
the cache they fill; layers the forward appends to the cache as copies of its own (Dory's looped layers) are
allocated ahead too, after the model's layers, each the bucketed form of the layer it copies. A model whose layers
are all of these kinds needs no change here.
"""

from __future__ import annotations

from typing import Any

from hf_tpu.transformers._cache.writes import kv_rows_after
from hf_tpu.transformers._settings import CACHE_POOL_SIZE, ModelState

__all__: list[str] = []


def bucketed_layers() -> dict[type, type]:
    """Upstream static layer class -> its bucketed form (:mod:`~hf_tpu.transformers._cache.layer_classes`)."""
    from hf_tpu.transformers._cache.layer_classes import BUCKETED_LAYERS

    return BUCKETED_LAYERS


# Upstream's layer kinds (``_layer_type``) that can have no bucketed static form, and why: what upstream's modeling
# code does with the layer that no fixed-size buffer can serve.
NO_STATIC_FORM: dict[str, str] = {
    "heavily_compressed_attention": (
        "its one-token decode step reads every compressed entry the layer returns, unmasked (the compressor builds "
        "a block bias only for a multi-token input), so the layer must return exactly the entries emitted so far, "
        "one more every compress_rate tokens: a fixed-size buffer would let the attention read its empty slots"
    ),
}


def _layer_types(config) -> tuple[list[str], list[dict[str, Any]]]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    return get_layer_types_and_kwargs(config.get_text_config(decoder=True))


def layer_plan(config) -> list[tuple[type, dict[str, Any]]]:
    """``(upstream static layer class, its constructor kwargs)`` per decoder layer, as ``StaticCache`` builds them;
    for a layer kind upstream registers as dynamic only (a modeling file's class that subclasses a dynamic layer,
    as DeepSeek-V4's compressed-attention layers do: ``StaticCache`` cannot be built for it), that dynamic class."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING

    layer_types, per_layer_kwargs = _layer_types(config)
    return [
        (STATIC_LAYER_TYPE_MAPPING.get(t) or DYNAMIC_LAYER_TYPE_MAPPING[t], kw)
        for t, kw in zip(layer_types, per_layer_kwargs)
    ]


def layer_problem(config) -> str | None:
    """Why this config's cache has layers without a bucketed form (None when every layer has one): the layer kinds
    that cannot have one (:data:`NO_STATIC_FORM`) with the reason, then those hf_tpu has no form for yet."""
    registry = bucketed_layers()
    kinds: dict[str, str] = {}  # upstream layer class name -> its layer type
    for (cls, _), layer_type in zip(layer_plan(config), _layer_types(config)[0]):
        if cls not in registry:
            kinds.setdefault(cls.__name__, layer_type)
    parts = [
        f"{name} layers ({t}), which can have no bucketed static form: {NO_STATIC_FORM[t]}"
        for name, t in sorted(kinds.items())
        if t in NO_STATIC_FORM
    ]
    missing = sorted(name for name, t in kinds.items() if t not in NO_STATIC_FORM)
    if missing:
        parts.append(f"{', '.join(missing)} layers, which have no bucketed static form in hf_tpu yet")
    return f"its cache has {'; and '.join(parts)}" if parts else None


def build_layers(
    config, cache_len: int, shapes: list[dict], batch: int, dtype, device, host_length: bool = False
) -> list:
    """The bucketed layers of a ``cache_len`` cache, allocated with the probed ``shapes`` (one dict per layer);
    with ``host_length``, full-attention layers report the host length the loop sets (:func:`set_length`)."""
    import torch

    registry = bucketed_layers()
    if host_length:
        from transformers.cache_utils import StaticLayer

        from hf_tpu.transformers._cache.layer_classes import HostLengthLayer

        registry = {**registry, StaticLayer: HostLengthLayer}
    plan = layer_plan(config)
    for shape in shapes[len(plan) :]:  # layers the forward appends as copies of its own: allocated ahead alike
        if "copy_of" not in shape:
            break
        plan.append(plan[shape["copy_of"]])
    layers = []
    for (cls, kwargs), shape in zip(plan, shapes):
        layer = registry[cls](max_cache_len=cache_len, **kwargs)
        if hasattr(layer, "hf_tpu_rows_after"):  # (a BucketedStaticLayer: its flags in the instance, see set_decoding)
            layer.hf_tpu_rows_after, layer.hf_tpu_rows = False, None
        kv = shape.get("kv")
        if kv is not None:
            heads, k_dim, v_dim, kv_dtype = kv
            kv_dtype = dtype if kv_dtype is None else kv_dtype
            keys = torch.zeros((batch, heads, 0, k_dim), dtype=kv_dtype, device=device)
            values = torch.zeros((batch, heads, 0, v_dim), dtype=kv_dtype, device=device)
            layer.lazy_initialization(keys, values)
        for idx, (state_shape, state_dtype) in shape.get("conv", {}).items():
            state = torch.zeros((batch, *state_shape), dtype=dtype if state_dtype is None else state_dtype)
            layer.lazy_initialization(conv_states=state.to(device), state_idx=idx)
        for idx, (state_shape, state_dtype) in shape.get("recurrent", {}).items():
            state = torch.zeros((batch, *state_shape), dtype=dtype if state_dtype is None else state_dtype)
            layer.lazy_initialization(recurrent_states=state.to(device), state_idx=idx)
        indexer = shape.get("indexer")
        if indexer is not None:
            index_dim, index_dtype = indexer
            index_dtype = dtype if index_dtype is None else index_dtype
            layer.lazy_initialization_indexer(torch.zeros((batch, 0, index_dim), dtype=index_dtype, device=device))
        layers.append(layer)
    return layers


def bucketed_cache(model, shapes: list[dict], batch: int, cache_len: int, host_length: bool = False):
    """A bucketed static cache of ``cache_len`` slots for ``batch`` rows, its layers allocated with the probed
    ``shapes`` (a ``StaticCache`` to upstream, or the bucketed form of the model's own cache class)."""
    from transformers.cache_utils import Cache, StaticCache

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
        reset_cache(cache)
    state.caches[key] = cache
    return cache


def reset_cache(cache) -> None:
    """Upstream's ``cache.reset()`` and the flags a decode step leaves on its full-attention layers
    (``hf_tpu_rows_after``, ``hf_tpu_rows``: dynamo guards on the first, so a prefill must find it False)."""
    cache.reset()
    for layer in getattr(getattr(cache, "self_attention_cache", cache), "layers", ()):
        if "hf_tpu_rows_after" in layer.__dict__:  # (a BucketedStaticLayer: build_layers sets both on the instance)
            layer.hf_tpu_rows_after, layer.hf_tpu_rows = False, None


def static_cache_problem(model) -> str | None:
    """Why a bucketed static cache does not fit this model (None when it does)."""
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


def layers_besides_full_attention(model) -> list[str]:
    """The cache layer classes of ``model`` other than full attention (a sliding window keeps the last tokens, a
    linear-attention/SSM state folds in every token: a padded tail after the prompt would change both)."""
    from transformers.cache_utils import DummyLayer, StaticLayer

    try:
        plan = layer_plan(model.config)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError):
        return []  # the static-cache check names the problem
    return sorted({cls.__name__ for cls, _ in plan if cls not in (StaticLayer, DummyLayer)})


def host_length_fits(config) -> bool:
    """Whether this config's cache can report a host length
    (:class:`~hf_tpu.transformers._cache.layer_classes.HostLengthLayer`): every layer is a full-attention one (the
    loop then puts the prompt first, which a window or a recurrent state could not hold)."""
    from transformers.cache_utils import StaticLayer

    plan = layer_plan(config)
    return bool(plan) and all(cls is StaticLayer for cls, _ in plan)


def set_length(cache, length: int) -> None:
    """Set the host length the ``HostLengthLayer`` layers of ``cache`` report to the model (the tokens cached
    before the next graph's input); a no-op for every other layer."""
    from hf_tpu.transformers._cache.layer_classes import HostLengthLayer

    self_cache = getattr(cache, "self_attention_cache", cache)
    for layer in self_cache.layers:
        if isinstance(layer, HostLengthLayer):
            layer.hf_tpu_length = length


def set_decoding(cache, decoding: bool, rows_after: bool = True) -> None:
    """Tell the layers of ``cache`` whether the next graph decodes (continues from their states) or prefills; a
    decode step of its full-attention layers leaves their cache to
    :func:`~hf_tpu.transformers._cache.writes.write_rows` when :func:`~hf_tpu.transformers._cache.writes.kv_rows_after`
    says so (``rows_after=False``: never, for a loop that reorders the cache in its graphs: beam search)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from hf_tpu.transformers._cache.layer_classes import BucketedStaticLayer

    self_cache = getattr(cache, "self_attention_cache", cache)
    if hasattr(self_cache, "decoding"):  # a model's own cache class (hf_tpu.transformers._cache.model_classes)
        self_cache.decoding = decoding
    after = decoding and rows_after and kv_rows_after(self_cache)
    for layer in self_cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for idx in layer.has_previous_state:
                layer.has_previous_state[idx] = decoding
        if getattr(layer, "ring", False):
            layer.decoding = decoding
        if isinstance(layer, BucketedStaticLayer):
            layer.hf_tpu_rows_after = after


# ---- the padding mask upstream builds from the loop's 2D mask, on a tpu device ----


def _padding_as_slice(attention_mask, batch_size: int, kv_offset, use_vmap: bool) -> bool:
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


def apply_padding_mask(feature: str) -> None:
    """transformers' ``sdpa_mask`` (5.23-5.25) adds a 2D padding mask to the mask function as
    ``padding_mask[batch_idx, kv_idx]`` with ``batch_idx = arange(batch)[:, None, None, None]`` and ``kv_idx =
    arange(kv_length)[None, None, None, :] + kv_offset``: advanced indexing, which lowers to a ``gather`` of one
    element per (row, slot). Those indices only pick the rows in order and the columns ``kv_offset ... kv_offset +
    kv_length - 1``, so the same mask is ``padding_mask[:, kv_offset : kv_offset + kv_length]`` broadcast over the
    query positions. Measured on a TPU v5e (docs/planning.md, "Measured on a chip"): in hf_tpu's Llama-3.2-1B-shaped
    decode program at batch 64 (a 640-slot cache) that gather of 40,960 elements took 431 us of a 10.3 ms step.

    The patched ``sdpa_mask`` takes that path for a 2D boolean mask on a ``tpu`` device whose rows are the batch (as
    upstream's indexing needs) and a static ``kv_offset``, without vmap: upstream's own early exits (``None`` where
    sdpa's ``is_causal`` or no mask will do) on the same padded mask, then upstream's mask of the mask function
    alone and the sliced padding. Any other call goes to upstream unchanged. ``eager_mask`` calls the module's
    ``sdpa_mask`` and takes the same path; the ``AttentionMaskInterface`` entry ``"sdpa"`` is replaced too. The
    result equals upstream's element for element (tests/transformers/test_padding_mask.py)."""
    import functools

    from transformers import masking_utils

    from hf_tpu._patch import on_revert, original, patch

    upstream = original(masking_utils, "sdpa_mask")
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)

    @functools.wraps(upstream)
    def sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                  mask_function=masking_utils.causal_mask_function, attention_mask=None, local_size=None,
                  allow_is_causal_skip=True, allow_is_bidirectional_skip=False, use_vmap=False, device="cpu",
                  **kwargs):  # fmt: skip
        if not _padding_as_slice(attention_mask, batch_size, kv_offset, use_vmap):
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
    if interface._global_mapping.get("sdpa") is upstream:  # (a mask function a user registered stays theirs)
        interface.register("sdpa", sdpa_mask)  # upstream's own registry call, as _decode_attention does
        on_revert(feature, lambda: interface.register("sdpa", upstream))
