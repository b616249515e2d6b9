"""Per-model generation state: the knobs :func:`configure` sets, the graphs compiled so far, the static caches kept.

Every other generation module reads a model's state through :func:`model_state`; the state lives on the model object
(``model.__dict__["_hf_tpu_generation"]``), so it goes away with the model.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hf_tpu._shared.buckets import DEFAULT_CACHE_MULTIPLE, BucketLadder, default_ladder
from hf_tpu._shared.state import STRICT_EAGER, STRICT_ENV, attached, strict_from_env
from hf_tpu.errors import HfTpuError, InvalidArgumentError
from hf_tpu.transformers._graph_key import public_key

__all__ = [
    "STRICT_EAGER", "STRICT_ENV", "GenerationSettings", "RecompileError", "Route", "compiled_graphs", "configure",
]

# How many decode steps the loops run between two read-backs of the new tokens (hf_tpu.transformers._loops.readback).
READ_BACK_EVERY = 8

# Device types the hf_tpu loop takes over. Tests may widen it to exercise the loop on CPU.
DEVICE_TYPES: set[str] = {"tpu"}

# How many static caches (one per batch/cache-bucket shape) a model keeps allocated between calls.
CACHE_POOL_SIZE = 4

_UNSET: Any = object()


class RecompileError(HfTpuError, RuntimeError):
    """Strict mode: ``generate`` needed a graph that warm-up did not compile."""


class NotCompilableError(HfTpuError, RuntimeError):
    """The model's forward cannot be traced as one static-shape graph (a branch or a shape that depends on a
    tensor's value); ``generate`` takes the next route for it (:func:`hf_tpu.transformers.route.demote`),
    ``warmup`` raises this when none of hf_tpu's loops serves it.

    ``reason``: the reason the route records; ``loop``: the loop whose graph failed (None: the call's inputs
    cannot take the loop, the model's route stays)."""

    reason: str | None = None
    loop: str | None = None


# The loops a generate call can take (hf_tpu.transformers.route), in the order a model is demoted through them.
CACHED, HOST_LENGTH, CACHELESS, UPSTREAM = "cached", "host_length", "cacheless", "upstream"
LOOPS = (CACHED, HOST_LENGTH, CACHELESS, UPSTREAM)


# A call's inputs as the loops lay them out (:class:`Layout`): token ids, ids with images (a vision graph first), an
# encoder-decoder's ids, an encoder taking features (Whisper's).
TEXT, IMAGES, SEQ2SEQ, FEATURES = "text", "images", "seq2seq", "features"


@dataclass(frozen=True)
class Layout:
    """What a ``generate`` call's inputs and outputs look like to hf_tpu's loops, decided with the call's route
    (:func:`hf_tpu.transformers.route.call_route`), so that ``generate`` and the loops read it instead of asking the
    model and the call again.

    Attributes:
        kind: ``"text"``, ``"images"`` (the call has image inputs: a vision graph, merged by the prefill),
            ``"seq2seq"`` (an encoder-decoder's ids) or ``"features"`` (an encoder taking features).
        features: the name of the features input (Whisper's ``"input_features"``; None: token ids).
        vision: whether the model has an image encoder (only then do the loops ask
            :mod:`hf_tpu.transformers._images` anything: a text model's calls never do).
        images: the call's inputs that upstream hands the image encoder (``()``: none).
        rows: the rows of positions the model's rotary embedding reads (3: multimodal rotary positions).
        outputs: the graph features of the outputs asked (``"attentions"``, ``"hidden_states"``).
        continues: whether the call hands a cache of its own to continue from (:mod:`hf_tpu.transformers._cache.
            handoff` copies it in).
    """

    kind: str = TEXT
    features: str | None = None
    vision: bool = False
    images: tuple[str, ...] = ()
    rows: int = 1
    outputs: tuple[str, ...] = ()
    continues: bool = False


@dataclass(frozen=True)
class Route:
    """How ``generate`` runs (:func:`hf_tpu.transformers.explain`), decided once per model and demoted in one place.

    Attributes:
        loop: one of ``"cached"``, ``"host_length"``, ``"cacheless"``, ``"upstream"``.
        reason: why not the cached loop; None for it.
        warn: whether ``generate`` says the reason once in a warning (a cost on a TPU the caller should know).
        without_cache: why hf_tpu's loop without a cache cannot serve the model (None: it can, or it was not needed
            yet; ``without_cache_checked`` tells which), kept with the route as it is checked once per model.
        without_cache_checked: whether ``without_cache`` has been decided.
        host_sampling: (from :func:`~hf_tpu.transformers.explain` only) why the call's logits processors and
            sampling run on the host, one logits row copied back per step (None: in the graph).
        step_by_step: (from :func:`~hf_tpu.transformers.explain` only) why the call's new tokens come back each
            decode step (None: every ``read_back_every`` steps, :mod:`hf_tpu.transformers._loops.readback`).
        beams: (a call's route only) whether the call is beam search or beam sampling, which the loop runs with
            beam's graphs (:mod:`hf_tpu.transformers._loops.beam`).
        layout: (a call's route only) the call's :class:`Layout`.
        read_back: (a call's route only) why the loop's new tokens come back each decode step, as far as the call
            tells before its sampling plan (None: every ``read_back_every`` steps); the loop adds the host path's
            reason (:func:`hf_tpu.transformers._loops.skeleton.read_back`), which ``step_by_step`` says.

    ``layout`` and ``read_back`` are what the loops read, not part of the answer :func:`~hf_tpu.transformers.explain`
    shows (left out of the route's repr and comparisons).
    """

    loop: str
    reason: str | None = None
    warn: bool = False
    without_cache: str | None = None
    without_cache_checked: bool = False
    host_sampling: str | None = None
    step_by_step: str | None = None
    beams: bool = False
    layout: Layout = field(default_factory=Layout, repr=False, compare=False)
    read_back: str | None = field(default=None, repr=False, compare=False)

    @property
    def fast(self) -> bool:
        """Whether one of hf_tpu's compiled loops serves the call (not upstream's)."""
        return self.loop != UPSTREAM

    def __str__(self) -> str:
        return self.loop if self.reason is None else f"{self.loop}: {self.reason}"


@dataclass
class GenerationSettings:
    """Per-model knobs of the hf_tpu generation loop (see :func:`configure`).

    ``buckets``: the ladder prompt lengths round up to (default :func:`~hf_tpu.transformers.buckets.default_ladder`:
    powers of two from 16 to 256, then steps of 256 up to 2048, then eight rungs per octave, up to the model's
    ``max_position_embeddings``). ``cache_multiple``: the static cache holds the padded prompt plus
    ``max_new_tokens``, rounded up to a multiple of this (a power of two below it); None sizes the cache on the
    prompt ladder instead (the earlier behaviour, kept for comparison). ``strict``: after :func:`hf_tpu.warmup`,
    a shape warm-up did not compile raises :class:`RecompileError` instead of compiling (default: the
    ``HF_TPU_STRICT_COMPILE`` environment variable); ``strict="eager"`` also raises when a ``generate`` compiled
    an eager op (torch_tpu's cache missed: a new eager op signature). ``backend``/``fullgraph``: what
    ``torch.compile`` gets (``"tpu"``, ``True``); ``compile=False`` runs the same bucketed loop eagerly.
    ``compile_cache``: a :class:`~hf_tpu.compile_cache.CompileCache` directory, or None (default: the
    ``HF_TPU_COMPILE_CACHE`` environment variable). ``device_sampling``: run the logits processors and the sampler
    in the compiled graph (:mod:`hf_tpu.transformers.sampling`; default); False keeps them on the host, copying the
    last logits row back each step (the earlier behaviour, kept for comparison: ``hf-tpu bench sampling``).
    ``read_back_every``: the decode steps run between two read-backs of the new tokens, which stay on the device in
    between (:mod:`hf_tpu.transformers._loops.readback`; default :data:`READ_BACK_EVERY`); 1 reads them back each step.
    """

    buckets: BucketLadder | None = None
    cache_multiple: int | None = DEFAULT_CACHE_MULTIPLE
    strict: bool | str | None = None
    backend: str | Callable | None = None
    fullgraph: bool = True
    compile: bool = True
    compile_cache: Any = _UNSET
    device_sampling: bool = True
    read_back_every: int = READ_BACK_EVERY


@dataclass
class ModelState:
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    # graph keys ((GraphKind, batch, *shapes): hf_tpu.transformers._graph_key) already compiled (or loaded) for this
    # model, as a set and in order
    compiled: set[tuple] = field(default_factory=set)
    compile_log: list[tuple] = field(default_factory=list)
    loaded: dict = field(default_factory=dict)  # graph key -> callable served by the persistent compile cache
    warmed: bool = False
    caches: OrderedDict = field(default_factory=OrderedDict)
    module_states: list | None = None  # (module, attribute) of state kept on modules (_module_state.py); None: unseen
    # how its generate calls run (hf_tpu.transformers.route): decided at the first call, demoted when a graph fails
    route: Route | None = None
    # why its forward cannot return attentions/hidden states in a graph (found at a first trace), by the outputs the
    # failing graph returned: a frozenset of "attentions"/"hidden_states" -> the reason (a failure found returning
    # attentions says nothing of a call asking for hidden states only: sdpa's forward warns on attentions alone)
    outputs_problems: dict = field(default_factory=dict)
    # why its image encoder cannot be one graph (found at the vision graph's first trace): calls with images then
    # run upstream's loop, calls without keep the model's route
    images_problem: str | None = None
    # (its image layout,) once hf_tpu.transformers._images.image_layout decided it (the layout None: no image encoder)
    image_layout: tuple = ()

    def outputs_problem(self, attentions: bool, hidden_states: bool) -> str | None:
        """Why a call asking for these outputs cannot return them from a graph: a failure found with a subset of
        them (None: none found)."""
        asked = {name for name, on in (("attentions", attentions), ("hidden_states", hidden_states)) if on}
        return next((reason for found, reason in self.outputs_problems.items() if found <= asked), None)

    @property
    def host_length(self) -> bool:
        """Whether the cache's full-attention layers report their length as a host int (the host-length route)."""
        return self.route is not None and self.route.loop == HOST_LENGTH

    def ladder(self, config) -> BucketLadder:
        if self.settings.buckets is None:
            self.settings.buckets = default_ladder(config)
        return self.settings.buckets

    def _strict_setting(self) -> bool | str:
        if self.settings.strict is not None:
            return self.settings.strict
        return strict_from_env()

    @property
    def strict(self) -> bool:
        return bool(self._strict_setting())

    @property
    def strict_eager(self) -> bool:
        """Strict about eager op compiles too (torch_tpu cache misses during a ``generate`` after warm-up)."""
        return self._strict_setting() == STRICT_EAGER


def model_state(model) -> ModelState:
    return attached(model, "_hf_tpu_generation", ModelState)


def configure(
    model,
    *,
    buckets: BucketLadder | list[int] | tuple[int, ...] | None = None,
    cache_multiple: int | None = _UNSET,
    strict: bool | str | None = None,
    backend: str | Callable | None = None,
    fullgraph: bool | None = None,
    compile: bool | None = None,
    compile_cache: Any = _UNSET,
    device_sampling: bool | None = None,
    read_back_every: int | None = None,
) -> GenerationSettings:
    """Set how hf_tpu generates with ``model``; arguments left out (or None) keep their current value.

    ``compile_cache`` takes a directory (``str``/``Path``), a
    :class:`~hf_tpu.compile_cache.CompileCache`, or ``False`` to use none (not even the one
    ``HF_TPU_COMPILE_CACHE`` names). ``cache_multiple=None`` sizes static caches on the prompt ladder.

    Args:
        model: the model whose ``generate`` hf_tpu serves.
        buckets: the prompt ladder (a :class:`BucketLadder` or a list of lengths).
        cache_multiple: the static cache's length rounds up to a multiple of this; None: the prompt ladder.
        strict: True: a graph compile after warm-up raises :class:`RecompileError`; ``"eager"``: an eager op
            compile too.
        backend, fullgraph, compile: what ``torch.compile`` gets (``compile=False`` runs the loop eagerly).
        compile_cache: the persistent compile cache (a directory, a ``CompileCache``, or False for none).
        device_sampling: run the logits processors and sampler in the graph (default True).
        read_back_every: decode steps between two read-backs of the new tokens (default :data:`READ_BACK_EVERY`;
            1: each step).

    Returns:
        The model's :class:`GenerationSettings` after the change.

    Raises:
        ValueError (InvalidArgumentError): a ``cache_multiple`` or ``read_back_every`` that is not a positive int, a
            ``strict`` other than True, False or ``"eager"``, or a ladder that is not increasing positive lengths.

    Example:
        >>> from hf_tpu.transformers import configure                   # doctest: +SKIP
        >>> configure(model, buckets=[32, 128, 512], strict=True)       # doctest: +SKIP
    """
    state = model_state(model)
    if buckets is not None:
        state.settings.buckets = BucketLadder.coerce(buckets)
    if cache_multiple is not _UNSET:
        if cache_multiple is not None and (not isinstance(cache_multiple, int) or cache_multiple < 1):
            raise InvalidArgumentError(f"cache_multiple must be a positive integer or None, got {cache_multiple!r}")
        state.settings.cache_multiple = cache_multiple
    if strict is not None:
        if not isinstance(strict, bool) and strict != STRICT_EAGER:
            raise InvalidArgumentError(
                f"strict must be True, False or {STRICT_EAGER!r} (eager op compiles too), got {strict!r}"
            )
        state.settings.strict = strict
    if backend is not None:
        state.settings.backend = backend
    if fullgraph is not None:
        state.settings.fullgraph = fullgraph
    if compile is not None:
        state.settings.compile = compile
    if device_sampling is not None:
        state.settings.device_sampling = bool(device_sampling)
    if read_back_every is not None:
        if isinstance(read_back_every, bool) or not isinstance(read_back_every, int) or read_back_every < 1:
            raise InvalidArgumentError(
                f"read_back_every must be a positive integer (1: each step), got {read_back_every!r}"
            )
        state.settings.read_back_every = read_back_every
    if compile_cache is not _UNSET:
        from hf_tpu.compile_cache import CompileCache

        state.settings.compile_cache = CompileCache.coerce(compile_cache)
        state.loaded.clear()
    return state.settings


def compiled_graphs(model) -> list[tuple]:
    """The graphs hf_tpu compiled (or loaded from the compile cache) for ``model``, in order:
    ``("prefill", batch, prompt_bucket, cache_bucket)``, ``("decode", batch, cache_bucket)``, and for
    encoder-decoders ``("encoder", batch, encoder_bucket)`` etc.; each kind as its text, a call's variant after a
    ``"+"`` (``"decode+top_k+sample"``: :class:`~hf_tpu.transformers._graph_key.GraphKind`).

    Example:
        >>> model.generate(ids, max_new_tokens=8)             # doctest: +SKIP
        >>> compiled_graphs(model)                            # doctest: +SKIP
        [('prefill', 1, 16, 32), ('decode', 1, 32)]
    """
    return [public_key(key) for key in model_state(model).compile_log]


def cache_bytes(model) -> dict[tuple, int]:
    """The device bytes of each static cache hf_tpu keeps allocated for ``model``, by its key
    ``(batch, cache_bucket, encoder_bucket, dtype, host_length)``: what the KV cache costs in HBM beside the weights.

    Example:
        >>> hf_tpu.warmup(model, max_prompt_len=16, max_new_tokens=8)      # doctest: +SKIP
        >>> cache_bytes(model)                                               # doctest: +SKIP
        {(1, 32, None, torch.float32, False): 16384}
    """
    import torch

    def size(obj, seen: set) -> int:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:
                return 0
            seen.add(id(obj))
            return obj.numel() * obj.element_size()
        if isinstance(obj, (list, tuple)):
            return sum(size(o, seen) for o in obj)
        if isinstance(obj, dict):
            return sum(size(o, seen) for o in obj.values())
        if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            return sum(size(o, seen) for o in vars(obj).values())
        return 0

    return {key: size(cache, set()) for key, cache in model_state(model).caches.items()}


def compile_cache_of(state: ModelState):
    """The model's persistent compile cache (from :func:`configure` or ``HF_TPU_COMPILE_CACHE``), or None."""
    if state.settings.compile_cache is _UNSET:
        from hf_tpu.compile_cache import CompileCache

        state.settings.compile_cache = CompileCache.from_env()
    return state.settings.compile_cache


@contextlib.contextmanager
def device_types(*types: str) -> Iterator[None]:
    """Let the loop take over models on other device types too (tests use it to compare on CPU)."""
    added = [t for t in types if t not in DEVICE_TYPES]
    DEVICE_TYPES.update(added)
    try:
        yield
    finally:
        DEVICE_TYPES.difference_update(added)
