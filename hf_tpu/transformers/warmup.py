"""Warm-up: compile ahead of time every graph ``generate`` will need, so that serving compiles nothing.

After :func:`warmup`, a ``generate`` call whose batch size was warmed, whose prompt fits the largest warmed prompt
bucket and whose ``max_new_tokens`` is at most the warmed one runs on graphs that already exist. With
``strict=True`` (or ``HF_TPU_STRICT_COMPILE=1``), a call that would need a new graph raises
:class:`~hf_tpu.transformers.generation.RecompileError` naming the shape instead of compiling.

With ``cache_dir=PATH`` (or ``HF_TPU_COMPILE_CACHE``), every graph is loaded from the persistent compile cache
(:mod:`hf_tpu.compile_cache`) when an earlier process stored it, and stored there when compiled; the cache's
manifest adds the graphs earlier processes needed beyond this warm-up's range, so a new process warms exactly the
set the model used.

Example:
    >>> import hf_tpu                                                                        # doctest: +SKIP
    >>> report = hf_tpu.warmup(model, max_prompt_len=256, batch_sizes=[1, 4], max_new_tokens=64)   # doctest: +SKIP
    >>> report.graphs                                                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hf_tpu import _torch_tpu
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers import _mm_warmup, _settings, _upstream, route
from hf_tpu.transformers._graph_key import GraphKind, Variant, public_key
from hf_tpu.transformers._loops import beam, cacheless  # noqa: F401 - the loops: each registers its LoopSpec
from hf_tpu.transformers._loops.defaults import own_variant, warm_read_back
from hf_tpu.transformers._loops.skeleton import BEAM, loop_spec, route_spec
from hf_tpu.transformers._settings import UPSTREAM
from hf_tpu.transformers.buckets import BucketLadder

__all__ = ["WarmupReport", "warmup"]


@dataclass
class WarmupReport:
    """What :func:`warmup` did: the graph keys it covered (each kind as its text, as
    :func:`~hf_tpu.transformers.compiled_graphs` gives them), how many of them were new, and how long it took."""

    graphs: list[tuple] = field(default_factory=list)
    new_compiles: int = 0
    from_cache: int = 0
    cache_dir: str | None = None
    cache_problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    prompt_buckets: tuple[int, ...] = ()
    batch_sizes: tuple[int, ...] = ()
    # torch_tpu's own cache during warm-up (torch.tpu._get_cache_stats(); the simulator mirrors it): requests and
    # misses (programs compiled: eager op signatures and graphs, or loaded from its tier 2/3); None without it.
    tpu_cache_requests: int | None = None
    tpu_cache_misses: int | None = None
    # what warm-up compiled no graph for, each with its reason (the model's calls, or its image calls, run upstream's
    # loop: found before or while tracing; hf_tpu.transformers.explain says the same)
    not_warmed: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        tpu = "" if self.tpu_cache_requests is None else (
            f"; torch_tpu cache: {self.tpu_cache_misses} miss(es) of {self.tpu_cache_requests} request(s)"
        )  # fmt: skip
        return (
            f"warm-up: {len(self.graphs)} graphs ({self.new_compiles} newly compiled, {self.from_cache} from the "
            f"compile cache) for batch sizes {list(self.batch_sizes)} and prompt buckets {list(self.prompt_buckets)} "
            f"in {self.seconds:.1f}s{tpu}" + "".join(f"; not warmed: {reason}" for reason in self.not_warmed)
        )


def warmup(
    model,
    max_prompt_len: int = 128,
    batch_sizes: Iterable[int] = (1,),
    max_new_tokens: int = 32,
    *,
    buckets: BucketLadder | Iterable[int] | None = None,
    strict: bool | str | None = None,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    num_beams: int | Iterable[int] | None = None,
    image_sizes: Iterable[tuple[int, int]] | None = None,
    num_images: Iterable[int] = (1,),
    generate_kwargs: dict | None = None,
) -> WarmupReport:
    """Compile the prefill and decode graphs for every prompt bucket up to ``max_prompt_len`` and every batch size.

    ``buckets`` replaces the model's ladder first (see :func:`hf_tpu.transformers.generation.configure`).
    ``strict=True`` makes a later graph compile an error, ``strict="eager"`` an eager op compile too; None keeps the
    current setting (or the environment variable).
    ``progress`` shows a progress bar (tqdm) while compiling. ``cache_dir`` is the persistent compile cache
    (default: the model's, set by ``configure(model, compile_cache=...)``, else ``HF_TPU_COMPILE_CACHE``); graphs
    found there are loaded, not compiled (``report.from_cache``), and the others are stored. ``num_beams`` (one
    or several) also compiles the beam-search graphs of each shape for calls with that many beams and the model's own
    ``generation_config`` otherwise (``batch_sizes`` counts prompts, before their beams).

    Vision-language models (``image_sizes``): for every batch size, every pixel size in ``image_sizes`` and every
    count in ``num_images`` (images per prompt), the vision graph and the image prefill and decode graphs of every
    warmed prompt bucket that holds the images' tokens are compiled too, on ``pixel_values`` of shape
    ``(batch * images, channels, height, width)`` in float32 (what LLaVA's, Gemma 3's and PaliGemma's processors
    return). Models whose encoder takes features (Whisper): ``max_prompt_len`` does not apply (the encoder runs
    on the model's input window, which every clip is padded to); the model's own ``generate`` runs once per batch
    size on silent features of that window with ``generate_kwargs`` (what the served calls pass: ``language=``,
    ``task=``; they set the decoder prompt, which is not bucketed).

    Args:
        model: a model on the TPU (``device_map="tpu"`` or ``.to("tpu")``).
        max_prompt_len: every prompt bucket up to the one holding this length is compiled.
        batch_sizes: the batch sizes to compile for.
        max_new_tokens: the largest ``max_new_tokens`` later calls use (it sizes the caches).
        num_beams: the beam counts of later beam-search calls (None: none).
        buckets, strict, cache_dir: see :func:`~hf_tpu.transformers.configure`.
        progress: show a progress bar.
        image_sizes: ``(height, width)`` pixel sizes of the images later calls pass (None: no image graphs).
        num_images: the numbers of images per prompt to warm, with ``image_sizes``.
        generate_kwargs: for a model whose encoder takes features, the keyword arguments of its ``generate`` calls.

    A model whose forward does not trace as one static-shape graph moves down its routes as ``generate`` moves it
    (:func:`hf_tpu.transformers.route.demote`: host length, then without a cache) and the graphs of the loop it
    lands on are warmed; where that is upstream's loop (found now or before), or its image encoder is not one graph
    (its calls with images run upstream's loop), warm-up compiles no graph for those calls, warns once with the
    reason (``generate`` does not warn it again) and returns: ``report.not_warmed`` and
    :func:`hf_tpu.transformers.explain` say why. A beam count whose calls run upstream's loop is left out so.

    Returns:
        A :class:`WarmupReport`: the graph keys covered, how many were compiled or loaded, and the time taken.
        (``hf_tpu.warmup``, the facade in :mod:`hf_tpu._warmup`, sends an encoder the ``encoders`` integration
        serves to :func:`hf_tpu.encoders.warmup` instead.)

    Raises:
        hf_tpu.runtime.TPUNotAvailableError, ValueError: the model is not on a TPU (the message says how to
            place it), or ``batch_sizes`` holds no positive integer.
        NotCompilableError: the model's class has a ``generate`` of its own (hf_tpu's loops never run for it); or
            the images or features asked for cannot be warmed (no image token in the config, no pixel input, images
            the loop does not take: the reason says why). Not for a forward or image encoder that does not trace
            (above: warned once, in ``report.not_warmed``). Image requests are checked (their vision graphs
            compiled) before any text graph, so these errors, and the ValueError of a size the model's processor
            never returns or of images filling more tokens than ``max_prompt_len``'s bucket, come before the text
            graphs' compiling.

    Example:
        >>> hf_tpu.warmup(model, max_prompt_len=64, batch_sizes=[1], max_new_tokens=16)   # doctest: +SKIP
        WarmupReport(graphs=[('prefill', 1, 16, 32), ('decode', 1, 32), ...], ...)
    """
    from tqdm.auto import tqdm

    state = _placed(model, buckets, strict, cache_dir)
    found = route.explain(model)  # the route of a call with the model's own generation_config
    if found.loop == UPSTREAM:  # no graph of it to compile: said once, as generate says it
        return WarmupReport(batch_sizes=tuple(batch_sizes), not_warmed=[_upstream_note(found.reason)])
    ladder = state.ladder(model.config)
    batch_sizes = _batch_sizes(batch_sizes)
    images = _image_plan(image_sizes, num_images)
    if _upstream.encoder_input_name(model):  # (Whisper's: its own generate on silent features of its window)
        return _warm_calls(model, state, batch_sizes, progress, lambda b: _mm_warmup.warm_features(
            model, b, max_new_tokens, dict(generate_kwargs or {})))  # fmt: skip
    prompt_buckets = ladder.up_to(max_prompt_len)
    notes: list[str] = []
    beam_counts = _beam_counts(model, num_beams, notes)
    variant = own_variant(model)
    plans = _shape_plans(model, state, batch_sizes, prompt_buckets, max_new_tokens, variant)
    image_plans = [(batch, size, count) for batch in batch_sizes for size, count in images]
    report = WarmupReport(prompt_buckets=prompt_buckets, batch_sizes=batch_sizes, not_warmed=notes)
    with _counted(report, state), tqdm(plans, desc="hf_tpu warm-up", unit="shape", disable=not progress) as bar:
        image_plans, images_note = _check_images(model, state, image_plans, prompt_buckets, bar)
        if not _warm_shapes(model, report, bar, variant, beam_counts):
            image_plans, images_note = [], None
        _warm_image_calls(model, state, report, bar, image_plans, images_note, plans, max_new_tokens, variant)
    return report


def _placed(model, buckets, strict, cache_dir):
    """The model's state, once ``buckets``, ``strict`` and ``cache_dir`` are set and the model is found on the TPU
    with hf_tpu's ``generate`` (else the error saying why); a MoE's experts form chosen."""
    from hf_tpu.transformers import generation

    if buckets is not None or strict is not None:
        generation.configure(model, buckets=buckets, strict=strict)
    if cache_dir is not None:
        generation.configure(model, compile_cache=cache_dir)
    device = getattr(model, "device", None)
    if device is None or device.type not in generation.DEVICE_TYPES:
        from hf_tpu.runtime import require_tpu

        require_tpu("hf_tpu.warmup(model)")
        raise InvalidArgumentError(
            f"hf_tpu.warmup needs a model placed on the TPU, but it is on {device}: "
            "load it with device_map='tpu' or call model.to('tpu') first."
        )
    own = _upstream.own_generate(model)
    if own:
        raise generation.NotCompilableError(f"{own}; warm-up has no graph its generate would use")
    state = generation.model_state(model)
    from hf_tpu.kernels.experts_forms import prefer_measured

    prefer_measured(model)  # a MoE on torch_tpu: each bucket's measured-fastest experts form
    return state


def _shape_plans(model, state, batch_sizes, prompt_buckets, max_new_tokens: int, variant: Variant) -> list:
    """The shape plans warm-up covers: every batch size with every prompt bucket (an encoder-decoder's: encoder
    bucket), then those of the compile cache's manifest (what earlier processes needed)."""
    from hf_tpu.transformers import generation

    plans = []
    for batch in batch_sizes:
        for bucket in prompt_buckets:
            if model.config.is_encoder_decoder:
                plans.append(
                    generation.plan_shapes(model, batch, 1, max_new_tokens, encoder_len=bucket, variant=variant)
                )
            else:
                plans.append(generation.plan_shapes(model, batch, bucket, max_new_tokens, variant=variant))
    return plans + [p for p in _manifest_plans(model, state) if p not in plans]


@contextlib.contextmanager
def _counted(report: WarmupReport, state):
    """Warm-up's block: the model not counted as warmed inside it (strict mode refuses new graphs only outside
    warm-up, so a second warm-up, other sampling settings or more batch sizes, compiles what the first did not) and
    left as it was where the block fails; after it, ``report``'s time and counts (graphs compiled, loaded from the
    compile cache, torch_tpu's cache requests and misses)."""
    before, hits_before, tpu_before = len(state.compiled), _cache_hits(), _torch_tpu.cache_stats()
    start = time.perf_counter()
    was_warmed, state.warmed = state.warmed, False
    try:
        yield
    except BaseException:
        state.warmed = was_warmed
        raise
    state.warmed = True
    report.seconds = time.perf_counter() - start
    report.from_cache = _cache_hits() - hits_before
    report.new_compiles = len(state.compiled) - before - report.from_cache
    if tpu_before is not None:
        spent = _torch_tpu.cache_stats() - tpu_before
        report.tpu_cache_requests, report.tpu_cache_misses = spent.requests, spent.misses
    cache = _settings.compile_cache_of(state)
    if cache is not None:
        report.cache_dir, report.cache_problems = str(cache.root), list(cache.problems)


def _warm_shapes(model, report: WarmupReport, bar, variant: Variant, beam_counts: tuple[int, ...]) -> bool:
    """Warm each shape plan of ``bar`` with the route's loop (:func:`_warm_one`) and each beam count's loop; False
    where a trace demoted the model to upstream's loop (said in ``report.not_warmed``: no graph of it to compile)."""
    seq2seq = bool(model.config.is_encoder_decoder)
    for plan in bar:
        shape = f"batch {plan.batch}, {'encoder' if seq2seq else 'prompt'} {plan.encoder_bucket or plan.prompt_bucket}"
        bar.set_postfix_str(f"{shape}, cache {plan.cache_bucket}")
        keys = _warm_one(model, plan, variant)
        if keys is None:  # a trace demoted the model to upstream's loop: no graph of it to compile
            report.not_warmed.append(_upstream_note(route.model_route(model).reason))
            return False
        for beams in beam_counts if not seq2seq else ():
            keys = keys + loop_spec(BEAM).warm(model, plan, variant, num_beams=beams)
        _add_keys(report, keys)
    return True


def _warm_image_calls(model, state, report: WarmupReport, bar, image_plans, images_note, plans, max_new_tokens,
                      variant: Variant) -> None:  # fmt: skip
    """Warm the image requests :func:`_check_images` checked, until image calls are found to run upstream's loop
    (said in ``report.not_warmed``; where an image prefill's trace demoted the model, its text ``plans`` are warmed
    again for its new route)."""
    notes = report.not_warmed
    for images in image_plans:
        bar.set_postfix_str(f"batch {images.batch}, {images.count} image(s) of {images.size[0]}x{images.size[1]}")
        loop = route.model_route(model).loop
        keys = _warm_images(model, state, notes, images, max_new_tokens, variant)
        if keys is None:  # image calls run upstream's loop (said in notes): no image graph to compile
            if route.model_route(model).loop not in (loop, UPSTREAM):  # (the image prefill demoted the model)
                for plan in plans:  # its text calls' graphs are the new route's
                    _add_keys(report, _warm_one(model, plan, variant) or ())
            return
        _add_keys(report, keys)
    # every checked request warmed: where the next one found image calls run upstream's loop (its image encoder not
    # one graph), said now, after their graphs, as it always was
    if images_note is not None:
        notes.append(_upstream_note(images_note, images=True))


def _batch_sizes(batch_sizes) -> tuple[int, ...]:
    """``batch_sizes`` as a tuple of distinct ints, in order (none, or one below 1: the error)."""
    batch_sizes = tuple(dict.fromkeys(int(b) for b in batch_sizes))
    if not batch_sizes or min(batch_sizes) < 1:
        raise InvalidArgumentError(f"batch_sizes must hold positive integers, got {batch_sizes!r}")
    return batch_sizes


def _image_plan(image_sizes, num_images) -> list[tuple[tuple[int, int], int]]:
    """The ``(size, count)`` pairs of warm-up's image graphs (empty without ``image_sizes``)."""
    if image_sizes is None:
        return []
    try:
        sizes = [tuple(int(n) for n in size) for size in image_sizes]
        counts = tuple(dict.fromkeys(int(n) for n in num_images))
    except (TypeError, ValueError):
        sizes, counts = [], ()
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes) or not counts or min(counts) < 1:
        raise InvalidArgumentError(
            f"image_sizes must hold (height, width) pairs of positive integers and num_images positive integers, "
            f"got {image_sizes!r} and {num_images!r}"
        )
    return [(size, count) for size in dict.fromkeys(sizes) for count in counts]


def _warm_calls(model, state, batch_sizes, progress: bool, warm) -> WarmupReport:
    """Warm-up by calls: ``warm(batch)`` per batch size (a model whose encoder takes features), timed and counted as
    :func:`warmup` counts its graphs."""
    from tqdm.auto import tqdm

    report = WarmupReport(batch_sizes=batch_sizes)
    with _counted(report, state):
        for batch in tqdm(batch_sizes, desc="hf_tpu warm-up", unit="batch size", disable=not progress):
            _add_keys(report, warm(batch))
    return report


def _add_keys(report: WarmupReport, keys) -> None:
    """Add the graph keys ``keys`` to ``report.graphs`` (as hf_tpu shows them: kinds as text), each once."""
    for key in keys:
        shown = public_key(key)
        if shown not in report.graphs:
            report.graphs.append(shown)


def _warm_one(model, plan, variant: Variant) -> list[tuple] | None:
    """Warm ``plan`` with the loop of the route a call with the model's own ``generation_config`` takes, through
    :func:`hf_tpu.transformers.route.attempt` as ``generate`` runs its loop: where a graph does not trace, the model
    moves to its next route and that loop's graphs are warmed. Returns the keys, None where the model's route became
    upstream's loop (no graph to compile)."""
    def run(found) -> list[tuple]:
        keys = route_spec(found).warm(model, plan, variant)  # (the warm-up the route's loop registered)
        warm_read_back(model, plan.batch)  # (the eager ops that keep the tokens on the device between read-backs)
        return keys

    keys, found = route.attempt(model, run)
    return None if found.loop == UPSTREAM else keys


def _check_images(model, state, image_plans, prompt_buckets, bar) -> tuple[list, str | None]:
    """:func:`hf_tpu.transformers._mm_warmup.check_images` for each ``(batch, size, count)`` of ``image_plans`` in
    turn (a request that cannot be warmed raises) until image calls are found to run upstream's loop (the image
    encoder is not one graph, found now or before warm-up): the
    :class:`~hf_tpu.transformers._mm_warmup.ImageWarmup` of the requests checked before, and that reason (None
    where none was found), which :func:`warmup` notes once after warming them, where warming each request in turn
    found it. :func:`warmup` checks them before any text graph: a request it cannot serve (a size the processor never
    returns, more tokens than the largest bucket holds) fails at once, not after the text graphs' minutes of
    compiling."""
    from hf_tpu.transformers._settings import NotCompilableError

    checked = []
    for batch, size, count in image_plans:
        if state.images_problem is not None:
            return checked, state.images_problem
        bar.set_postfix_str(f"batch {batch}, {count} image(s) of {size[0]}x{size[1]}: vision")
        try:
            checked.append(_mm_warmup.check_images(model, batch, size, count, prompt_buckets))
        except NotCompilableError:
            if state.images_problem is None:  # (the images asked for cannot be warmed: the reason says why)
                raise
    return checked, state.images_problem


def _warm_images(model, state, notes: list[str], images, max_new_tokens, variant):
    """The vision graph's keys (:func:`_check_images` compiled it) and
    :func:`hf_tpu.transformers._mm_warmup.warm_image_prefills`'s, or None (the reason added to ``notes``, said once)
    where image calls run upstream's loop: the forward merging the images is not one graph, or a trace of the image
    prefill demoted the model (:func:`warmup` then warms the text plans again for its new route)."""
    from hf_tpu.transformers._settings import NotCompilableError

    try:
        return images.vision_keys + _mm_warmup.warm_image_prefills(model, images, max_new_tokens, variant)
    except NotCompilableError as exc:
        if getattr(exc, "loop", None) is not None:  # the image prefill's trace: the model's route moves down
            route.demote(model, exc)
            notes.append(_upstream_note(f"{exc.reason} (the image prefill); its route is now "
                                        f"{route.model_route(model).loop!r}", images=True))  # fmt: skip
            return None
        if state.images_problem is None:  # (the images asked for cannot be warmed: the reason says why)
            raise
    notes.append(_upstream_note(state.images_problem, images=True))
    return None


def _beam_counts(model, num_beams, notes: list[str]) -> tuple[int, ...]:
    """The beam counts to warm (``num_beams``: None, an int or several), each checked against the route a beam call
    with the model's own ``generation_config`` takes (a beam call hf_tpu's beam loop cannot serve has no graph:
    left out, its reason added to ``notes``)."""
    if num_beams is None:
        return ()
    counts = (num_beams,) if isinstance(num_beams, int) else tuple(num_beams)
    counts = tuple(dict.fromkeys(int(n) for n in counts))
    if not counts or min(counts) < 2:
        raise InvalidArgumentError(f"num_beams must hold integers of at least 2 (beam search), got {num_beams!r}")
    served = []
    for count in counts:
        found = route.explain(model, num_beams=count)
        if found.loop == UPSTREAM:
            notes.append(_upstream_note(f"num_beams={count}: {found.reason}"))
        else:
            served.append(count)
    return tuple(served)


def _upstream_note(reason: str, images: bool = False) -> str:
    """What warm-up leaves out where ``generate`` runs upstream's loop for ``reason``; warned once (with the key
    ``generate``'s own warning of that reason takes, so the pair says it once)."""
    from hf_tpu.transformers._notes import warn_once

    calls = "calls with images" if images else "calls"
    note = f"{reason}; generate runs upstream's loop for such {calls}, so warm-up has no graph to compile for them"
    warn_once(reason, f"hf_tpu: {note}")
    return note


def _cache_hits() -> int:
    """Graphs loaded from a compile cache so far in this process (counted by :mod:`hf_tpu.compile_cache`)."""
    from hf_tpu import compile_cache

    return compile_cache.HITS[0]


def _manifest_plans(model, state) -> list:
    """Shape plans for the graphs the model's compile-cache manifest lists (what earlier processes needed)."""
    from hf_tpu.transformers import generation
    from hf_tpu.transformers._graphs import cache_namespace

    cache = _settings.compile_cache_of(state)
    if cache is None or not state.settings.compile:
        return []
    space = cache_namespace(cache, model, state)
    if space is None:
        return []
    plans = []
    default = own_variant(model)
    for entry in space.manifest():
        if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
            continue
        text, *dims = entry
        try:  # (the manifest holds kinds as text, written by this or an earlier process: read back here only)
            kind = GraphKind.parse(text)
        except ValueError:
            continue
        base = kind.base
        if kind.variant != default or not all(isinstance(d, int) for d in dims):
            continue
        if base == "prefill" and len(dims) == 3:
            batch, prompt, cache_len = dims
            plans.append(generation.ShapePlan(batch, prompt, prompt, cache_len))
        elif base == "cacheless_prefill" and len(dims) == 2:  # the loop without a cache: its buffer's length
            batch, length = dims
            plans.append(generation.ShapePlan(batch, 1, 1, length))
        elif base == "seq2seq_prefill" and len(dims) == 4:
            batch, encoder, prompt, cache_len = dims
            plans.append(generation.ShapePlan(batch, prompt, prompt, cache_len, encoder))
    return plans
