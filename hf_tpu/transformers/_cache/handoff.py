"""The cache in and out of hf_tpu's loop: ``return_dict_in_generate=True`` returns the call's cache as a transformers
``DynamicCache``, and a cache the caller passes back (``past_key_values=`` on 5.23, ``cache=`` on 5.24+: the name of
:func:`hf_tpu.transformers._upstream.cache_name`) is copied into the bucketed cache.

The bucketed cache is the model's pooled, left-padded static cache (reset by the next call), so it is never handed
out: :func:`returned_cache` copies the slots the call wrote, the bucket's padding left out, into a
``DynamicCache(config=...)`` (a ``StaticCache`` of upstream's length when the call asked for
``cache_implementation="static"``, as upstream's loop returns), exactly what upstream's loop leaves in the cache it
returns (the prompt and every new token but the last), and which the caller can pass to the next ``generate`` or to
``model(...)``. Sliding-window layers (Mistral, Gemma 2/3, ...) come back as upstream's own layers hold them: a
``DynamicSlidingWindowLayer`` with the last ``window - 1`` tokens, a ``StaticSlidingWindowLayer`` with the last
``min(window, length)``, each counting every token seen; the bucketed ring (:mod:`~hf_tpu.transformers._cache.static`)
holds the last ``window`` tokens, more than either keeps.

Continuing (:func:`copy_in`): the call's ``input_ids`` hold the whole sequence (as upstream's continuation takes
them), the cache its first ``L_c`` tokens. The loop plans the call as a prompt of the whole sequence, copies the
cached keys and values into the slots that prompt's tokens take after the bucket's left padding, and runs the
uncached tokens (one, after a ``generate``) through the *decode* graph, one at a time: no prefill, no new graph
kind, and the same computation as the step of one longer call. A sliding-window layer takes the tokens the given
layer still holds (the last ``window - 1`` at least, all a decode step reads), in the ring's last slots. Served: a
``DynamicCache`` or ``StaticCache`` of full-attention and sliding-window layers, layer for layer of the kinds the
model's bucketed cache has. Anything else is routed upstream with a one-time warning naming the reason
(:func:`given_cache_problem`).
"""

from __future__ import annotations

from hf_tpu.errors import InvalidArgumentError

__all__: list[str] = []


def _served_kinds():
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    return (StaticLayer, StaticSlidingWindowLayer)


def attention_kinds_only(model) -> bool:
    """Whether every layer of ``model``'s bucketed cache is full attention or a sliding window (the kinds whose
    tokens :func:`returned_cache` copies out and :func:`copy_in` copies in)."""
    from hf_tpu.transformers._cache.static import layer_plan

    try:
        plan = layer_plan(model.config)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError):
        return False
    return bool(plan) and all(cls in _served_kinds() for cls, _ in plan)


def full_attention_only(model) -> bool:
    """Whether every layer of ``model``'s bucketed cache is full attention (a ``StaticLayer``)."""
    from transformers.cache_utils import StaticLayer

    from hf_tpu.transformers._cache.static import layer_plan

    try:
        plan = layer_plan(model.config)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError):
        return False
    return bool(plan) and all(cls is StaticLayer for cls, _ in plan)


def cached_length(cache) -> int:
    """The number of tokens ``cache`` holds. A cache of linear-attention layers only tracks no length: transformers
    5.24's ``get_seq_length`` raises for it, 5.25's returns its layers' counter; both mean 0 for the empty cache
    upstream's ``generate`` builds, and a cache of such layers holding state is refused before the loop runs
    (:func:`given_cache_problem`)."""
    try:
        return int(cache.get_seq_length())
    except ValueError:
        layers = getattr(cache, "layers", None) or []
        if any(any(getattr(layer, "has_previous_state", {}).values()) for layer in layers):
            raise InvalidArgumentError(
                f"hf_tpu: the {type(cache).__name__} passed holds recurrent state, which the bucketed loop does not "
                "continue from; pass cache_implementation='dynamic' to run upstream's loop with it"
            ) from None
        return 0


def _plain_layers(cache, model) -> bool:
    """Whether ``cache``'s layers are upstream's plain attention layers, a window exactly where ``model``'s cache has
    one."""
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        StaticLayer,
        StaticSlidingWindowLayer,
    )

    from hf_tpu.transformers._cache.static import layer_plan

    layers = getattr(cache, "layers", None)
    plan = layer_plan(model.config)
    if not layers or len(layers) != len(plan):
        return False
    sliding = (DynamicSlidingWindowLayer, StaticSlidingWindowLayer)
    for layer, (cls, _) in zip(layers, plan):
        if type(layer) not in (DynamicLayer, StaticLayer, *sliding):
            return False
        if (type(layer) in sliding) != (cls is StaticSlidingWindowLayer):
            return False
    return True


def given_cache_problem(model, cache, input_len: int | None, mask_len: int | None) -> str | None:
    """Why hf_tpu's loop cannot continue from the ``cache`` a caller passed (None when it can): the reason goes in
    the one-time warning of the call that runs upstream's loop instead."""
    from transformers.cache_utils import Cache

    from hf_tpu.transformers._settings import model_state

    name = type(cache).__name__
    if not isinstance(cache, Cache):
        return f"the cache passed is a {name}, not a transformers Cache"
    if model.config.is_encoder_decoder:
        return f"a {name} passed to an encoder-decoder model is not served by the bucketed loop yet"
    if not attention_kinds_only(model) or not _plain_layers(cache, model):
        return (
            f"a {name} passed in is copied into the bucketed cache only when every layer is full attention or a "
            f"sliding window, of the kinds {type(model).__name__}'s own cache has layer for layer "
            f"({type(model).__name__}'s cache or the one passed has other layer kinds)"
        )
    if model_state(model).host_length:
        return f"a {name} passed in is not copied into a cache that reports a host length (prompt first) yet"
    seen = cached_length(cache)
    if input_len is None:
        return f"a {name} passed in needs input_ids holding the whole sequence (the prompt as embeddings was given)"
    if seen and (input_len <= seen or (mask_len is not None and mask_len != input_len)):
        return (
            f"a {name} holding {seen} tokens needs input_ids (and attention_mask) of the whole sequence, longer "
            f"than the cache ({input_len} ids given)"
        )
    return None


def _layer_tensors(layer, length: int):
    """The keys and values of the last tokens of ``length`` seen that upstream's ``layer`` still holds (all of them
    for full attention; a window keeps the last ones, in order)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

    if isinstance(layer, DynamicSlidingWindowLayer) or (
        isinstance(layer, StaticSlidingWindowLayer) and length > layer.max_cache_len
    ):
        return layer.keys[:, :, -length:], layer.values[:, :, -length:]
    return layer.keys[:, :, :length], layer.values[:, :, :length]


def copy_in(given, cache, start: int) -> int:
    """Copy the ``L_c`` tokens ``given`` holds into ``cache`` (a reset bucketed cache) at slots ``start`` to
    ``start + L_c`` (a ring: the last tokens held, in its last slots), and set every layer's counter after them;
    returns ``L_c``."""
    seen = cached_length(given)
    for source, layer in zip(given.layers, cache.layers):
        keys, values = _layer_tensors(source, seen)
        if getattr(layer, "ring", False):  # slot i holds position start + seen - window + i
            held = min(keys.shape[-2], layer.max_cache_len)
            dest = slice(layer.max_cache_len - held, layer.max_cache_len)
            keys, values = keys[:, :, -held:], values[:, :, -held:]
        else:
            if keys.shape[-2] != seen:  # (a window of a shorter cache than the bucket: cannot happen for upstream's)
                raise InvalidArgumentError(
                    f"hf_tpu: a {type(source).__name__} holding {keys.shape[-2]} of {seen} tokens cannot "
                    "fill a bucketed layer that keeps one slot per token; pass cache_implementation="
                    "'dynamic' to run upstream's loop with it"
                )
            dest = slice(start, start + seen)
        layer.keys[:, :, dest].copy_(keys.to(layer.keys.device, layer.keys.dtype))
        layer.values[:, :, dest].copy_(values.to(layer.values.device, layer.values.dtype))
        layer.cumulative_length.fill_(start + seen)
    return seen


def _tokens_held(layer, start: int, end: int):
    """The keys and values of the last tokens of slots ``start`` to ``end`` that the bucketed ``layer`` holds: every
    token, or for a ring the last ``window`` (it holds the positions before its counter, ``end``)."""
    if getattr(layer, "ring", False):
        held = min(end - start, layer.max_cache_len)
        return layer.keys[:, :, -held:].clone(), layer.values[:, :, -held:].clone()
    return layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone()


def _fill(layer, keys, values, seen: int) -> None:
    """Fill upstream's empty ``layer`` as ``seen`` tokens of which ``keys``/``values`` are the last would leave it
    (a window keeps the last of them and counts them all)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

    layer.update(keys, values)
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = seen
    elif isinstance(layer, StaticSlidingWindowLayer):
        layer.cumulative_length_int = seen


def returned_cache(model, cache, start: int, end: int, static_len: int | None = None):
    """A ``DynamicCache`` holding slots ``start`` to ``end`` of every layer of the bucketed ``cache`` (copies, on the
    model's device; a sliding-window layer as upstream's holds them), or None where the cache has other layer kinds
    than full attention and sliding windows (warned once).

    ``static_len``: the call asked for ``cache_implementation="static"``, for which upstream returns the
    ``StaticCache`` it generated with, ``static_len`` slots long (``max_length - 1``): the same tokens then, in the
    first slots of a ``StaticCache`` of that length (the rest zeros, as upstream leaves them)."""
    from transformers.cache_utils import DynamicCache, StaticCache

    from hf_tpu.transformers._notes import warn_once

    if not attention_kinds_only(model) or getattr(cache, "self_attention_cache", None) is not None:
        name = type(model).__name__
        warn_once(
            f"cache out:{name}",
            f"hf_tpu: return_dict_in_generate=True returns no cache for {name} (its cache has layer kinds other than "
            "full attention and sliding windows, which hf_tpu does not copy out yet); pass "
            "cache_implementation='dynamic' to get upstream's loop and its cache.",
        )
        return None
    config = model.config.get_text_config(decoder=True)  # as upstream's generate builds its cache
    out = DynamicCache(config=config) if static_len is None else StaticCache(config=config, max_cache_len=static_len)
    for source, layer in zip(cache.layers, out.layers):
        _fill(layer, *_tokens_held(source, start, end), end - start)
    return out
