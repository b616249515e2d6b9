"""Which loop runs a ``generate`` call, decided in one place: :class:`Route`, :func:`explain`.

Four loops can serve a call on a TPU, tried in this order:

* ``"cached"``: hf_tpu's bucketed loop with a static cache (:mod:`hf_tpu.transformers._loops.cached`);
* ``"host_length"``: the same loop with the full-attention layers reporting their length as a host int, for a
  forward that branches on the cache length (:class:`~hf_tpu.transformers._cache.layer_classes.HostLengthLayer`);
* ``"cacheless"``: hf_tpu's loop without a cache (:mod:`hf_tpu.transformers._loops.cacheless`), for ``use_cache=False``,
  a model that keeps no cache, or one whose cached forms cannot run;
* ``"upstream"``: upstream's own loop, unchanged (assisted decoding, a model none of the above serves, beam search
  the beam loop of :mod:`hf_tpu.transformers._loops.beam` cannot serve: a beam call it serves takes the cached route or
  the loop without a cache).

A model's route (what a call with a cache takes) is decided once, from what can be checked before tracing
(:func:`model_route`), kept in the model's state as one :class:`Route`, and demoted in one place when a graph
fails its first trace (:func:`demote`: cached -> host length where it fits -> without a cache where that loop
serves -> upstream). A call's route (:func:`call_route`) is the model's, unless the call asks for something only
upstream's loop does or has no cache; it also carries what the call's path depends on, asked here once so that
``generate`` and the loops read it instead of asking again: the call's :class:`~hf_tpu.transformers._settings.Layout`
(:func:`_layout`: a text model, one without an image encoder, never asks :mod:`hf_tpu.transformers._images`) and why
its tokens would come back each step (:func:`_read_back`). ``generate`` and :func:`hf_tpu.warmup` run their steps
through :func:`attempt`, the one demote-and-retry: a step on the call's route, and where a graph fails its first trace,
the step again on the route the call takes after :func:`demote`. The architecture sweep and the docs read the route;
:func:`explain` is the public question.

Adding a fallback: a loop name here and its place in :func:`demote`'s order; the loop itself is one module of
:mod:`hf_tpu.transformers._loops` registering its spec under that name (its ``custom_generate`` and its warm-up,
which :func:`hf_tpu.transformers.generation.run_loop` and :mod:`hf_tpu.transformers.warmup` look up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from hf_tpu.transformers import _images, _upstream
from hf_tpu.transformers._cache import static
from hf_tpu.transformers._loops import beam, cacheless, skeleton
from hf_tpu.transformers._settings import (
    CACHED,
    CACHELESS,
    DEVICE_TYPES,
    FEATURES,
    HOST_LENGTH,
    IMAGES,
    LOOPS,
    SEQ2SEQ,
    TEXT,
    UPSTREAM,
    Layout,
    NotCompilableError,
    Route,
    model_state,
)
from hf_tpu.transformers._upstream import model_cache_problem, own_generate

__all__ = [
    "CACHED", "CACHELESS", "HOST_LENGTH", "LOOPS", "UPSTREAM", "Route", "attempt", "call_route", "demote", "explain",
    "own_generate",
]  # fmt: skip

def explain(model, **generate_kwargs) -> Route:
    """The route ``model.generate(**generate_kwargs)`` would take now, with its reason.

    Nothing is generated: the arguments go through the same checks ``generate`` makes (the model's own
    ``generation_config`` when none are given). The route can still change at the first trace of a graph
    (a forward that does not trace as one static-shape graph is demoted); after a ``generate`` or
    :func:`hf_tpu.warmup`, ``explain`` says what that found.

    Args:
        model: a ``PreTrainedModel`` with ``GenerationMixin`` (on a ``tpu`` device for one of hf_tpu's loops).
        **generate_kwargs: what the ``generate`` call would get (``input_ids``, ``use_cache``, ``num_beams``,
            ``do_sample``, ...).

    Returns:
        A :class:`Route`: ``route.loop`` is ``"cached"``, ``"host_length"``, ``"cacheless"`` or ``"upstream"``,
        ``route.reason`` says why it is not the cached loop, ``route.host_sampling`` why the logits processors
        and sampling of one of hf_tpu's loops would run on the host (None: in the graph), ``route.step_by_step``
        why its new tokens would come back each decode step (None: every ``read_back_every`` steps).

    Example:
        >>> from hf_tpu.transformers import explain                     # doctest: +SKIP
        >>> explain(model).loop                                         # doctest: +SKIP
        'cached'
        >>> explain(model, num_beams=2, max_time=5.0)                    # doctest: +SKIP
        Route(loop='upstream', reason='beam search with stop_strings/max_time: those stopping criteria run ...', ...)
    """
    own = own_generate(model)
    if own:
        return Route(UPSTREAM, own, warn=False)
    args = {k: generate_kwargs.pop(k) for k in _GENERATE_ARGUMENTS if k in generate_kwargs}
    found = call_route(model, args, dict(generate_kwargs))
    if found.fast and not model.config.is_encoder_decoder and not found.beams:  # (a beam call: never the host path)
        from hf_tpu.transformers._loops.defaults import host_sampling
        from hf_tpu.transformers._loops.skeleton import read_back

        host = host_sampling(model, **generate_kwargs)
        every = model_state(model).settings.read_back_every
        found = replace(found, host_sampling=host, step_by_step=read_back(found, host is not None, every))
    return found


# generate's named arguments (the rest are model kwargs or generation-config fields)
_GENERATE_ARGUMENTS = (
    "inputs", "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
    "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
    "custom_generate",
)  # fmt: skip


def call_route(model, args: dict, kwargs: dict) -> Route:
    """The route of one ``generate`` call: ``args`` its named arguments, ``kwargs`` the rest (generation-config
    fields and model inputs), as ``generate`` binds them."""
    device = getattr(model, "device", None)
    if device is None or device.type not in DEVICE_TYPES:
        return Route(UPSTREAM, "not on a tpu device")
    nested = _upstream.nested_call()
    if nested is not None:  # (the outer call said why it runs upstream's loop)
        return Route(UPSTREAM, nested, warn=False)
    try:
        config, model_kwargs = model._prepare_generation_config(args.get("generation_config"), **kwargs)
    except (ValueError, TypeError, AttributeError):
        return Route(UPSTREAM, "upstream rejects the arguments")  # let upstream raise its own error
    layout = _layout(model, config, model_kwargs)
    asked = (  # what the call asks only upstream's loop does: its arguments, a cache it gives, its model inputs
        _upstream.call_problem(model, args, config)
        or _given_cache_problem(model, args, model_kwargs)
        or _upstream.inputs_problem(model, model_kwargs, layout)
    )
    if asked is not None:
        reason, warn = asked
        return Route(UPSTREAM, reason, warn=warn)
    found = replace(_call_route(model, config, model_kwargs, layout), layout=layout)
    beams = found.loop != UPSTREAM and is_beam_call(config)
    if beams:
        problem = beam.beam_problem(model, args, config, model_kwargs, found)
        if problem is not None:
            reason, warn = problem
            return Route(UPSTREAM, reason, warn=warn)
    outputs = config.output_attentions or config.output_hidden_states
    problem = model_state(model).outputs_problem(bool(config.output_attentions), bool(config.output_hidden_states))
    if outputs and found.loop != UPSTREAM and problem:
        return Route(UPSTREAM, problem, warn=True)
    if config.output_attentions and found.loop in (CACHED, HOST_LENGTH):
        from hf_tpu.transformers._cache.handoff import full_attention_only

        if not full_attention_only(model):  # a window or a state: attention over other key slots than the tokens'
            return Route(
                UPSTREAM,
                f"output_attentions=True: {type(model).__name__}'s cache has layer kinds other than full attention, "
                "whose attention weights hf_tpu's loop does not cut to upstream's shapes",
                warn=True,
            )
    if beams:
        return replace(found, beams=True)
    return replace(found, read_back=_read_back(model, args, config, layout)) if found.fast else found


def _given_cache_problem(model, args: dict, model_kwargs: dict) -> tuple[str, bool] | None:
    """Why a cache the call gives (``past_key_values=`` / ``cache=``) is not copied into the bucketed cache
    (:mod:`hf_tpu.transformers._cache.handoff`), so that upstream's loop runs the call, with a warning; None when the
    call gives none or it is copied in."""
    given = next((model_kwargs[n] for n in _upstream.CACHE_NAMES if model_kwargs.get(n) is not None), None)
    if given is None:
        return None
    from hf_tpu.transformers._cache.handoff import given_cache_problem

    ids = args.get("inputs") if args.get("inputs") is not None else model_kwargs.get("input_ids")
    mask = model_kwargs.get("attention_mask")
    problem = given_cache_problem(
        model, given, None if ids is None else int(ids.shape[-1]), None if mask is None else int(mask.shape[-1])
    )
    if problem is None and model_kwargs.get("inputs_embeds") is not None:
        problem = "a cache passed in with inputs_embeds is not copied into the bucketed cache yet"
    if problem is None and _upstream.numbers_by_cache_length(model):
        problem = f"a cache passed in is not copied into the cache of {type(model).__name__} (prompt first) yet"
    return None if problem is None else (problem, True)


def _vision(model) -> bool:
    """Whether ``model`` has an image encoder (upstream's ``get_image_features``, or a vision tower ``visual``): only
    its calls ask :mod:`hf_tpu.transformers._images` about images, positions in rows, image token types; a text
    model's never do (its answers there would all be no)."""
    base = model.base_model
    return getattr(base, "get_image_features", None) is not None or hasattr(base, "visual")


def _layout(model, config, model_kwargs: dict) -> Layout:
    """The :class:`Layout` of a call with generation config ``config`` and model inputs ``model_kwargs``: asked once
    per call, here, and read by ``generate`` and the loops."""
    vision = _vision(model)
    images = tuple(_images.image_inputs(model, model_kwargs)) if vision else ()
    features = _upstream.encoder_input_name(model)
    if features is not None:
        kind = FEATURES
    elif model.config.is_encoder_decoder:
        kind = SEQ2SEQ
    else:
        kind = IMAGES if images else TEXT
    return Layout(
        kind=kind,
        features=features,
        vision=vision,
        images=images,
        rows=_images.mrope_rows(model) if vision else 1,
        outputs=tuple(name for name in ("attentions", "hidden_states") if getattr(config, f"output_{name}", False)),
        continues=any(model_kwargs.get(name) is not None for name in _upstream.CACHE_NAMES),
    )


def _read_back(model, args: dict, config, layout: Layout) -> str | None:
    """Why the loop's new tokens come back each decode step rather than every ``read_back_every`` steps, as far as
    the call tells before its sampling plan (:mod:`hf_tpu.transformers._loops.readback`): the setting, the outputs
    asked (they come back each step), ``max_time`` (its criterion reads the clock after each token). None: every
    ``read_back_every`` steps, unless the sampling plan takes the host path
    (:func:`hf_tpu.transformers._loops.skeleton.read_back`)."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    if model_state(model).settings.read_back_every <= 1:
        return "read_back_every=1 (hf_tpu.transformers.configure)"
    if layout.outputs:
        return "output_attentions/output_hidden_states come back to the host each step"
    criteria = args.get("stopping_criteria") or ()
    if config.max_time is not None or any(isinstance(c, MaxTimeCriteria) for c in criteria):
        return "max_time: its stopping criterion reads the clock after each token"
    return None


def is_beam_call(config) -> bool:
    """Whether a call with generation config ``config`` is beam search or beam sampling (upstream's modes)."""
    from transformers.generation.configuration_utils import GenerationMode

    return config.get_generation_mode() in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)


def _call_route(model, config, model_kwargs: dict, layout: Layout) -> Route:
    """:func:`call_route` once the call asks for nothing only upstream's loop does."""
    use_cache = bool(config.use_cache)
    given = [k for k in _upstream.PROMPT_INPUTS if model_kwargs.get(k) is not None]
    if given:  # served by the cached loop only: its prefill takes them
        problem = _prompt_inputs_problem(model, given, use_cache)
        if problem is not None:
            reason, warn = problem
            return Route(UPSTREAM, reason, warn=warn)
    if layout.images:  # encoded by a graph of their own, merged by the prefill's forward
        problem = _images.images_problem(model, model_kwargs) or model_state(model).images_problem
        if problem is None and model_kwargs.get("inputs_embeds") is not None:
            problem = "images with inputs_embeds are not supported by the bucketed loop (it merges them into ids)"
        if problem is None and (not use_cache or model_route(model).loop not in (CACHED, HOST_LENGTH)):
            why = model_route(model).reason if use_cache else "use_cache=False"  # (what keeps it off that loop)
            problem = (
                f"images: only hf_tpu's loop with a cache takes them, and this call of {type(model).__name__} cannot "
                f"run it ({why})"
            )
        if problem is None and (_upstream.numbers_by_cache_length(model) or model_state(model).host_length):
            problem = _upstream.prompt_first_inputs(model, ["images"])
        if problem is not None:
            return Route(UPSTREAM, problem, warn=True)
    if not use_cache and not model.config.is_encoder_decoder:  # this call keeps no cache
        model_route(model)  # (the verdict below is kept with it)
        without = _without_cache(model)
        if without is not None:
            return Route(UPSTREAM, without, warn=True)
        if model_route(model).loop == CACHELESS:
            return model_route(model)
        return Route(CACHELESS, "use_cache=False", warn=False)
    return model_route(model)


def model_route(model) -> Route:
    """The route of the model's calls with a cache, decided once (then demoted by :func:`demote` only)."""
    state = model_state(model)
    if state.route is None:
        state.route = _decide(model)
    return state.route


def _decide(model) -> Route:
    claimed = skeleton.claimed_loop(model)  # (a registered loop that claims the model: its own decision, first)
    return Route(claimed) if claimed is not None else _built_in(model)


def _built_in(model) -> Route:
    name = type(model).__name__
    layout = _layout_problem(model)
    if layout is not None:  # neither hf_tpu loop computes what upstream's does: never other tokens
        return _with_verdict(Route(UPSTREAM, layout, warn=True), layout)
    if model.config.is_encoder_decoder:
        problem = static_cache_problem(model)
        return Route(CACHED) if problem is None else Route(UPSTREAM, problem, warn=True)
    if writes_no_cache(model):
        reason = f"{name}'s forward writes nothing into the cache it is given"
        without = _without_cache(model)
        if without is not None:
            return _with_verdict(Route(UPSTREAM, without, warn=True), without)
        return _with_verdict(Route(CACHELESS, reason, warn=False), None)
    problem = static_cache_problem(model)
    if problem is None:
        return Route(CACHED)
    return _after_cached(model, problem)


def _layout_problem(model) -> str | None:
    """Why hf_tpu's loops do not model the cache layout of a decoder-only ``model`` (None when they do): see
    :func:`hf_tpu.transformers._cache.probe.layout_problem`."""
    from hf_tpu.transformers._cache.probe import layout_problem

    if model.config.is_encoder_decoder or model_cache_problem(model):
        return None
    return layout_problem(model)


def writes_no_cache(model) -> bool:
    """True for a decoder-only model whose forward writes nothing into the cache it is given (measured by
    :func:`hf_tpu.transformers._cache.probe.cache_shapes`): its calls take the loop without a cache."""
    from hf_tpu.transformers._cache.probe import CacheProbeError, cache_shapes

    if model.config.is_encoder_decoder or model_cache_problem(model):
        return False  # (a forward that names its cache otherwise ignores the probe's: the cached loop says why)
    try:
        self_shapes, _ = cache_shapes(model)
    except CacheProbeError:
        return False
    return bool(self_shapes) and not any(self_shapes)


def _after_cached(model, reason: str) -> Route:
    """Where a model goes when its cached forms cannot serve it (``reason``): the loop without a cache when it
    serves, else upstream's."""
    if model.config.is_encoder_decoder:  # (no loop without a cache for those)
        return Route(UPSTREAM, reason, warn=True)
    without = _without_cache(model) or cacheless.cache_changes_outputs(model)
    if without is not None:
        return _with_verdict(Route(UPSTREAM, f"{reason}; and without a cache: {without}", warn=True), without)
    return _with_verdict(Route(CACHELESS, reason, warn=True), None)


def _with_verdict(route: Route, without: str | None) -> Route:
    return replace(route, without_cache=without, without_cache_checked=True)


def _without_cache(model) -> str | None:
    """Why the loop without a cache cannot serve ``model`` (None when it can), checked once per model."""
    state = model_state(model)
    known = state.route
    if known is not None and known.without_cache_checked:
        return known.without_cache
    without = cacheless.cacheless_problem(model)
    if known is not None:
        state.route = _with_verdict(known, without)
    return without


def static_cache_problem(model) -> str | None:
    """Why the cached loop cannot serve ``model``, from what can be checked before tracing (None when it can)."""
    if _upstream.numbers_by_cache_length(model):
        other = static.layers_besides_full_attention(model)
        if other:
            return (
                f"{type(model).__name__} takes no position_ids and places tokens by its cache length (absolute "
                f"position embeddings): the bucketed loop puts such a prompt first and its padding after it, which its "
                f"{', '.join(other)} layers cannot hold (a padded tail would enter their window or state)"
            )
    problem = model_cache_problem(model) or static.static_cache_problem(model)
    return f"{type(model).__name__}: {problem}" if problem else None


def _prompt_inputs_problem(model, given: list[str], use_cache: bool) -> tuple[str, bool] | None:
    """Why the cached loop cannot take the prompt inputs ``given`` (embeddings, token types) for ``model``, and
    whether to warn; None when it can."""
    import inspect

    names = ", ".join(given)
    if model.config.is_encoder_decoder:
        return f"{names} on an encoder-decoder model are not supported by the bucketed loop", True
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    missing = [name for name in given if name not in params]
    if missing:
        return "the forward takes no " + ", ".join(missing), False  # upstream's own error (or handling)
    if "inputs_embeds" not in given and (not use_cache or model_route(model).loop == CACHELESS):
        return None  # token types: the loop without a cache takes them too (see _loops.cacheless)
    if model_route(model).loop not in (CACHED, HOST_LENGTH):
        return f"{names}: only hf_tpu's loop with a cache takes them, and {type(model).__name__} cannot run it", True
    if _upstream.numbers_by_cache_length(model) or model_state(model).host_length:
        return _upstream.prompt_first_inputs(model, given), True
    return None


def demote(model, error: NotCompilableError) -> Route:
    """The one place a route changes after ``error`` (a graph of ``error.loop`` failed its first trace, or the
    call's inputs cannot take the loop: ``error.loop`` None): the model's route moves down the order where its own
    loop failed; the call then asks :func:`call_route` again. Returns the model's route."""
    state = model_state(model)
    current = model_route(model)
    loop = getattr(error, "loop", None)
    reason = getattr(error, "reason", None) or str(error)
    if loop is None:
        return current  # this call's inputs only: call_route says so now
    if current.loop not in LOOPS:  # a loop that claimed the model (LoopSpec.claims): a graph of it failed
        built = _built_in(model)
        said = f"the loop {current.loop!r}, which claimed the model, failed: {reason}"
        state.route = replace(built, reason=said if built.reason is None else f"{said}; {built.reason}", warn=True)
        state.caches.clear()
        return state.route
    if loop == CACHELESS:
        if current.loop == CACHELESS:  # the model's own loop failed
            combined = reason if not current.warn else f"{current.reason}; and without a cache: {reason}"
            state.route = _with_verdict(Route(UPSTREAM, combined, warn=True), reason)
        else:  # a use_cache=False call: the model's cached route stays
            state.route = _with_verdict(current, reason)
        return state.route
    if loop == CACHED and current.loop == CACHED:
        from hf_tpu.transformers._cache.static import host_length_fits

        if host_length_fits(model.config):
            state.route = replace(current, loop=HOST_LENGTH, reason=reason, warn=False)
            state.caches.clear()  # their layers report the length on the device
            return state.route
    if current.loop in (CACHED, HOST_LENGTH):
        state.route = _after_cached(model, reason)
        state.caches.clear()
    return state.route


T = TypeVar("T")


def attempt(model, run: Callable[[Route], T], args: dict | None = None, kwargs: dict | None = None,
            route: Route | None = None) -> tuple[T | None, Route]:  # fmt: skip
    """Run one step of hf_tpu's loops (``generate``'s loop, or warm-up's graphs of one shape) on the route of the call
    whose named arguments are ``args`` and other arguments ``kwargs`` (:func:`call_route`; ``route``: that route, when
    the caller asked already), demoting the model where a graph fails its first trace: the one demote-and-retry.

    ``run(route)`` runs the step for ``route``'s loop. Where it raises :class:`NotCompilableError` naming the loop
    whose graph failed, the model moves down its routes (:func:`demote`) and ``run`` runs again on the route the call
    takes then; where the error names no loop (the call's own inputs cannot take it), the model's route stays and
    this call takes upstream's loop.

    Returns:
        ``(result, route)``: what ``run`` returned and the route it ran on; ``(None, route)`` where the call's route
        is (or became) upstream's loop, ``route.reason`` saying why: no step of hf_tpu ran to the end.
    """
    args, kwargs = args or {}, kwargs or {}
    found = route if route is not None else call_route(model, args, kwargs)
    for _ in range(len(LOOPS)):  # each failure moves the model down the routes' order, upstream's loop at its end
        if found.loop == UPSTREAM:
            break
        try:
            return run(found), found
        except NotCompilableError as exc:  # found at the first trace of a graph
            demote(model, exc)
            found = call_route(model, args, kwargs)  # the call asks again, with what the trace found
            if exc.loop is None and found.loop != UPSTREAM:  # pragma: no cover - the inputs cannot take it
                found = Route(UPSTREAM, exc.reason or str(exc), warn=True)
    return None, found
