"""The cache shapes a model's own layers write, measured once per model on the ``meta`` device (else the CPU).

A static cache has to be allocated before the first compiled graph runs, with the shapes its attention writes.
The config does not always say them: multi-query attention (Falcon) writes one KV head, multi-latent attention
(DeepSeek-V2/V3) caches a compressed latent, encoder-decoder models (BART, Whisper) may have unequal encoder and
decoder heads, linear-attention/SSM layers write conv and recurrent states whose shapes each family computes its
own way, and the sparse-attention indexer of DeepSeek-V3.2-style models caches keys of its own width.
:func:`cache_shapes` runs the model's class once on the ``meta`` device (no memory, no compute, nothing on the TPU)
with two tokens' embeddings (no ids, no mask: nothing on meta may read a value) and upstream's ``DynamicCache``,
with eager attention, and reads back what each layer cached: per layer ``{"kv": (heads, key dim, value dim, dtype),
"conv": {state: (shape, dtype)}, "recurrent": {...}, "indexer": (key dim, dtype)}`` without the batch dimension (a
dtype of None is the model's own). A layer the forward appended to the cache as a copy of one of its own (Dory's
looped layers) also says which: ``"copy_of": index``. The probe also counts the forward's cache writes
(:func:`layout_problem`): a forward that writes more often than it has layers, or at a layer index outside its
layers, keeps a layout the bucketed cache does not model.
"""

from __future__ import annotations

import copy
import weakref

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers._cache.probe_error import CacheProbeError
from hf_tpu.transformers._upstream import cache_name

__all__: list[str] = []

_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: model -> (the layer index of each ``cache.update`` of the probe's forward, in order; the layers it was given)
_WRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_shapes(layer, model_dtype) -> dict:
    def dtype_of(t):
        return None if t.dtype == model_dtype else t.dtype

    shape: dict = {}
    keys = getattr(layer, "keys", None)
    values = getattr(layer, "values", None)
    if keys is not None and values is not None and getattr(keys, "ndim", 0) == 4:
        shape["kv"] = (int(keys.shape[1]), int(keys.shape[-1]), int(values.shape[-1]), dtype_of(keys))
    for name in ("conv", "recurrent"):
        states = getattr(layer, f"{name}_states", None) or {}
        found = {i: (tuple(s.shape[1:]), dtype_of(s)) for i, s in states.items() if s is not None}
        if found:
            shape[name] = found
    indexer_keys = getattr(layer, "indexer_keys", None)
    if indexer_keys is not None and getattr(indexer_keys, "ndim", 0) == 3:
        shape["indexer"] = (int(indexer_keys.shape[-1]), dtype_of(indexer_keys))
    return shape


def _probe_config(model):
    """The model's config, as the probes build it: eager attention (its masks never read a value; sdpa's mask
    shortcuts do) and shape-static expert routing (no data-dependent op on meta)."""
    config = copy.deepcopy(model.config)
    if getattr(config, "_experts_implementation", None) not in (None, "batched_mm"):
        config._experts_implementation = "batched_mm"
    config._attn_implementation = "eager"
    return config


def _meta_probe(model):
    import torch

    with torch.device("meta"):
        probe = type(model)(_probe_config(model))
    return probe.to(model.dtype).eval()


def _run_probe(model, probe, device: str) -> tuple[list[dict], list[dict] | None]:
    """Run ``probe`` (a copy of ``model`` on ``device``) once on two tokens; the shapes each cache layer got.

    A forward that replaces some of the model's own modules (BigBird swaps its block-sparse attention for full
    attention on a short input or with a cache) runs again: the second run must keep every module, its cache is the
    one measured, and the real model then takes the same step once (:mod:`~hf_tpu.transformers._cache.module_swaps`)."""
    from hf_tpu.transformers._cache import module_swaps as _module_swaps

    text_config = model.config.get_text_config(decoder=True)
    built = dict(probe.named_modules())
    shapes = _forward(model, probe, device, text_config)
    replaced = _replaced_classes(built, probe)
    if replaced:
        shapes = _module_swaps.second_forward_keeps_modules(
            model, probe, replaced, lambda: _forward(model, probe, device, text_config)
        )
        _module_swaps.settle(model, replaced, lambda: _forward(model, model, model.device, text_config))
    return shapes


def _replaced_classes(before: dict, module) -> list[tuple[str, type, type]]:
    """The modules of ``module`` whose class is no longer the one in ``before`` (``dict(module.named_modules())``), as
    ``(name, class before, class after)``: none, unless the forward swapped some
    (:mod:`~hf_tpu.transformers._cache.module_swaps` then settles them)."""
    now = dict(module.named_modules())
    return [
        (name, type(old), type(now[name]))
        for name, old in before.items()
        if name in now and type(now[name]) is not type(old)
    ]


def _forward(model, probe, device: str, text_config) -> tuple[list[dict], list[dict] | None]:
    import torch
    from torch.fx.experimental import _config as fx_config
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    # Embeddings in, not ids: no embedding lookup or pad-token check reads a value on meta. Routing that calls
    # nonzero (an expert loop) gets torch's all-nonzero meta result: the cache shapes never depend on it.
    name = cache_name()  # the installed transformers' name for a forward's cache: a wrong one is silently ignored
    embeds = torch.zeros(1, 2, model.get_input_embeddings().embedding_dim, dtype=model.dtype, device=device)
    with torch.no_grad(), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        if model.config.is_encoder_decoder:
            cache = EncoderDecoderCache(DynamicCache(config=text_config), DynamicCache(config=text_config))
            width = getattr(text_config, "d_model", None) or text_config.hidden_size
            hidden = torch.zeros(1, 2, width, dtype=model.dtype, device=device)
            probe(
                decoder_inputs_embeds=embeds, encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
                **{name: cache}, use_cache=True,
            )  # fmt: skip
            return (
                [_layer_shapes(la, model.dtype) for la in cache.self_attention_cache.layers],
                [_layer_shapes(la, model.dtype) for la in cache.cross_attention_cache.layers],
            )
        positions = torch.arange(2, device=device)[None]
        if not model._supports_default_dynamic_cache():  # it builds its own cache: take the one it returns
            from hf_tpu.transformers._cache.model_classes import extra_shapes

            cache = probe(inputs_embeds=embeds, position_ids=positions, use_cache=True)[name]
            extra = extra_shapes(cache)
            if extra is None:
                raise CacheProbeError(f"{type(cache).__name__} has no bucketed form in hf_tpu")
            shapes = [_layer_shapes(la, model.dtype) for la in cache.layers]
            count = max(len(shapes), len(extra))
            shapes, extra = shapes + [{}] * (count - len(shapes)), extra + [{}] * (count - len(extra))
            return [{**a, **b, "own": type(cache)} for a, b in zip(shapes, extra)], None
        try:
            cache = _counted(model, _sourced(DynamicCache(config=text_config)))
            probe(inputs_embeds=embeds, position_ids=positions, **{name: cache}, use_cache=True)
        except Exception:  # noqa: BLE001 - some models need ids (Gemma 4 derives per-layer inputs from them)
            cache = _counted(model, _sourced(DynamicCache(config=text_config)))
            ids = torch.ones(1, 2, dtype=torch.long, device=device)
            probe(input_ids=ids, position_ids=positions, **{name: cache}, use_cache=True)
        return _with_copies(cache, model.dtype), None


#: The cache methods that write a layer's state, each taking the layer's index as ``layer_idx``.
_WRITERS = ("update", "update_conv_state", "update_recurrent_state", "update_indexer")


def _counted(model, cache):
    """``cache`` whose writing methods record ``(method, layer index)`` of each call, for :func:`layout_problem`."""
    import inspect

    writes: list[tuple[str, int]] = []
    _WRITES[model] = (writes, len(cache.layers))
    for name in _WRITERS:
        method = getattr(cache, name, None)
        try:
            signature = inspect.signature(method) if method is not None else None
        except (TypeError, ValueError):  # pragma: no cover - an odd method
            signature = None
        if signature is None or "layer_idx" not in signature.parameters:
            continue

        def counted(*args, _name=name, _method=method, _signature=signature, **kwargs):
            index = _signature.bind_partial(*args, **kwargs).arguments.get("layer_idx")
            if isinstance(index, int):
                writes.append((_name, index))
            return _method(*args, **kwargs)

        setattr(cache, name, counted)
    return cache


def layout_problem(model) -> str | None:
    """Why the bucketed cache does not model the cache layout ``model``'s forward keeps (None when it does), from what
    the probe's forward did: at most one key/value write per layer, and every write (key/value, conv or recurrent
    state, indexer keys) at an index of the layers the cache was given. A forward that writes more often or elsewhere
    (looped layers writing again at ``layer_idx + offset`` into layers it appends: Dory's ``cache_offset``, Inkling-2
    Loop's) computes on what the bucketed cache would hold differently from upstream's growing cache."""
    try:
        cache_shapes(model)
    except CacheProbeError:
        return None  # (the static-cache check names that problem)
    writes, layers = _WRITES.get(model, ((), 0))
    if not writes or not layers:
        return None
    kv = sum(name == "update" for name, _ in writes)
    outside = sorted({i for _, i in writes if not 0 <= i < layers})
    if kv <= layers and not outside:
        return None
    what = f"its forward writes its cache at {len(writes)} places for {layers} layers ({kv} key/value writes)"
    if outside:
        what += f", at layer indices outside them ({', '.join(map(str, outside))})"
    return (
        f"{type(model).__name__}: {what} (looped layers): hf_tpu's bucketed cache holds each layer's state at the "
        "layer's index and does not model that layout"
    )


_SOURCE = "hf_tpu_probe_source"  # the index of a layer of the probe's cache: a copy of the layer keeps it


def _sourced(cache):
    """``cache`` with each of its layers marked with its index (an attribute, which ``copy.deepcopy`` copies)."""
    for index, layer in enumerate(cache.layers):
        setattr(layer, _SOURCE, index)
    return cache


def _with_copies(cache, model_dtype) -> list[dict]:
    """The shapes of the probed cache's layers, those the forward appended as copies of the cache's own layers (Dory's
    recurrent loops past the first write to copies of the recurrent layers, appended when the cache has only the
    model's layers) with ``"copy_of": index of the layer copied``: the bucketed cache allocates them ahead, so that
    the forward finds them there and appends nothing inside a graph."""
    shapes = [_layer_shapes(la, model_dtype) for la in cache.layers]
    for index, layer in enumerate(cache.layers):
        source = getattr(layer, _SOURCE, index)
        if source != index:
            shapes[index]["copy_of"] = source
    return shapes


def _measure(model) -> tuple[list[dict], list[dict] | None]:
    """The shapes, on the ``meta`` device, or where the model reads a value there (a padding check, an expert
    loop over a routing result), by a real run on the CPU of a copy whose weights take no memory
    (:mod:`~hf_tpu.transformers._cache.probe_cpu`)."""
    from hf_tpu.transformers._cache.probe_cpu import cpu_probe

    try:
        return _run_probe(model, _meta_probe(model), "meta")
    except CacheProbeError:
        raise
    except Exception as on_meta:  # noqa: BLE001 - any failure of a third-party forward on meta: try the CPU
        try:
            with cpu_probe(model, _probe_config(model)) as probe:
                return _run_probe(model, probe, "cpu")
        except CacheProbeError:
            raise
        except Exception as on_cpu:  # noqa: BLE001
            raise CacheProbeError(
                f"measuring the cache shapes of {type(model).__name__} failed on the meta device "
                f"({type(on_meta).__name__}: {_line(on_meta)}) and on the CPU ({type(on_cpu).__name__}: "
                f"{_line(on_cpu)})"
            ) from on_cpu


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def _per_rank(model, shapes: list[dict] | None) -> list[dict] | None:
    """``shapes`` with each layer's KV heads as THIS model's ranks hold them under tensor parallelism.

    The probe builds the model's class from its config, unsharded; a model loaded with ``tp_size=N`` writes the heads
    its plan leaves on each rank (sharded colwise, kept whole, or one selected head with hf_tpu's repeat strategy).
    Upstream's ``get_kv_heads_per_rank`` (as hf_tpu's plan fixes patch it in :mod:`transformers.generation.utils`)
    says how many, from the plan the model was sharded with."""
    tp_size = getattr(model, "_tp_size", None) or 1
    if tp_size <= 1 or shapes is None:
        return shapes
    from transformers.generation import utils as generation_utils

    plan = getattr(model, "tp_plan", None) or {}
    per_rank = []
    for shape in shapes:
        kv = shape.get("kv")
        if kv is not None:
            heads = generation_utils.get_kv_heads_per_rank(plan, kv[0], tp_size)
            if heads is None:
                raise InvalidArgumentError(
                    f"{kv[0]} KV heads cannot be evenly sharded over {tp_size} tensor-parallel ranks"
                )
            shape = {**shape, "kv": (int(heads), *kv[1:])}
        per_rank.append(shape)
    return per_rank


def cache_shapes(model) -> tuple[list[dict], list[dict] | None]:
    """(self-attention layer shapes, cross-attention layer shapes or None), measured once per model (a failure too).

    Raises :class:`CacheProbeError` when the model's class runs neither on the ``meta`` device nor on the CPU."""
    found = _SHAPES.get(model)
    if found is None:
        try:
            self_shapes, cross_shapes = _measure(model)
            try:
                found = (_per_rank(model, self_shapes), _per_rank(model, cross_shapes))
            except ValueError as exc:
                name = type(model).__name__
                raise CacheProbeError(f"the cache of {name} cannot be split over its ranks: {exc}") from exc
        except CacheProbeError as exc:
            found = exc  # remembered too: generate asks on every call, and the CPU fallback builds a whole copy
        _SHAPES[model] = found
    if isinstance(found, CacheProbeError):
        raise CacheProbeError(str(found))
    return found
