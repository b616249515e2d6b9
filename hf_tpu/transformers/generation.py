"""``model.generate()`` on a TPU: static cache, bucketed shapes, compiled prefill and decode, host-side bookkeeping.

Upstream transformers (5.24) can already run ``generate`` on a ``tpu`` device and compile the decode step with the
``"tpu"`` backend when a static cache is used, but on a TPU three things stay expensive:

* every distinct prompt length is a new static-cache length and a new prefill shape, hence new compiles;
* the prefill runs eagerly, op by op, so each new prompt length also compiles every op it touches;
* each decode step sends ``input_ids``, ``position_ids`` and a 4D mask to the device and brings the full logits row
  back (measured on the simulator: 3 host->device and 2 device->host copies per step).

hf_tpu keeps upstream's ``generate`` (argument handling, logits processors, stopping criteria, streamers, output
classes) and plugs its own decoding loop in through upstream's ``custom_generate`` hook. The loop:

* pads the prompt on the left to a *prompt bucket* and sizes the static cache to the padded prompt plus the new
  tokens, rounded to a multiple of 128 (:func:`plan_shapes`), so compiles are bounded by the rungs
  touched;
* runs prefill and decode as ``torch.compile`` graphs (backend ``"tpu"``, static shapes, full graph);
* keeps the growing tensors (the sequence, the 2D mask) on the host; the padded mask goes to the device once per
  call, each decode step's input (next tokens and their positions) is built on the device from the last step's
  tokens, and the new tokens come back every K decode steps in one copy (:mod:`hf_tpu.transformers._loops.readback`,
  K = ``read_back_every``, 8): the logits processors, warpers and the sampler run in the graph
  (:mod:`hf_tpu.transformers.sampling`); only a processor without a device form, or ``output_scores``, brings the
  last logits row back instead, each step;
* returns the output on the device the inputs came from.

Generation without a cache runs a loop of its own (:mod:`hf_tpu.transformers._loops.cacheless`). Anything neither loop
covers (assisted decoding, beam search :mod:`hf_tpu.transformers._loops.beam` cannot serve, attentions and hidden
states of an encoder-decoder model, a user cache it cannot copy in (:mod:`hf_tpu.transformers._cache.handoff`: the
cache in and out), a model that fails the checks of the loop without a cache, ...) runs upstream's code unchanged,
with a warning that names the cost on a TPU.

Where a change belongs (this module is the public entry point and re-exports the public names):

* :mod:`hf_tpu.transformers.route`: the call's route, decided once (its loop, its
  :class:`~hf_tpu.transformers._settings.Layout`), which the loops read;
* :mod:`hf_tpu.transformers._settings`: per-model state and :func:`configure`;
* :mod:`hf_tpu.transformers._loops.skeleton`: shape planning (:func:`plan_shapes`, public as
  :mod:`hf_tpu.transformers.shapes`), :mod:`~hf_tpu.transformers.buckets` the ladders;
* :mod:`hf_tpu.transformers._cache.static`: the static caches, built per layer kind with the shapes
  :mod:`~hf_tpu.transformers._cache.probe` measures (their K/V writes in :mod:`~hf_tpu.transformers._cache.writes`,
  the masks the graphs hand the model in :mod:`~hf_tpu.transformers._cache.masks`);
* :mod:`hf_tpu.transformers._graphs`: the compiled graphs and :func:`run_graph` (strict mode, the persistent compile
  cache of :mod:`hf_tpu.compile_cache`);
* :mod:`hf_tpu.transformers._loops`: the loops, one module each (its docstring says which serves which route and
  where a new one goes): :mod:`~hf_tpu.transformers._loops.skeleton` what every loop does around its graphs,
  :mod:`~hf_tpu.transformers._loops.cached` the decoding loop and the warm-up of one shape
  plan, :mod:`~hf_tpu.transformers._loops.cacheless` the loop without a cache (``use_cache=False``, a model that
  keeps none or whose cache the loop above cannot run: the whole sequence recomputed each step in one graph per
  bucket), :mod:`~hf_tpu.transformers._loops.beam` beam search;
* :mod:`hf_tpu.transformers.sampling`: logits processors, warpers and sampling inside the graphs;
* :mod:`hf_tpu.transformers._step_outputs`: ``output_attentions`` / ``output_hidden_states`` from the graphs, cut to
  upstream's shapes;
* :mod:`hf_tpu.transformers._images`: a vision-language call's images (the vision graph; the prefill's forward merges
  them); an encoder taking features (Whisper's) is :func:`_encode_features` here;
* :mod:`hf_tpu.transformers._upstream`: what upstream's ``generate`` and forward take (the names it passes a cache
  by), when upstream's ``generate`` runs instead, and why.

Example:
    >>> import hf_tpu, torch                                                    # doctest: +SKIP
    >>> hf_tpu.enable("generation")                                             # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path).to("tpu")            # doctest: +SKIP
    >>> hf_tpu.warmup(model, max_prompt_len=128, batch_sizes=[1], max_new_tokens=32)   # doctest: +SKIP
    >>> out = model.generate(**tok("Hello", return_tensors="pt"), max_new_tokens=32)   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

from hf_tpu import _torch_tpu
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers import _images
from hf_tpu.transformers._graph_key import GraphKind
from hf_tpu.transformers._graphs import PENALTY, run_graph
from hf_tpu.transformers._loops import beam, cacheless  # noqa: F401 - the loops: each registers its LoopSpec
from hf_tpu.transformers._loops.cached import warm_plan
from hf_tpu.transformers._loops.defaults import default_variant
from hf_tpu.transformers._loops.readback import ReadBacks, read_backs
from hf_tpu.transformers._loops.skeleton import (
    LADDER_FIX, ShapePlan, fill_id, ladder_figures, plan_shapes, route_spec,
)  # fmt: skip
from hf_tpu.transformers._notes import WARNED, warn_once
from hf_tpu.transformers._settings import (
    DEVICE_TYPES,
    IMAGES,
    STRICT_EAGER,
    STRICT_ENV,
    GenerationSettings,
    NotCompilableError,
    RecompileError,
    Route,
    cache_bytes,
    compiled_graphs,
    configure,
    device_types,
    model_state,
)
from hf_tpu.transformers._upstream import inputs_on_model_device, running, upstream_generate
from hf_tpu.transformers.buckets import BucketOverflowError
from hf_tpu.transformers.route import UPSTREAM, attempt, call_route, explain

__all__ = [
    "STRICT_EAGER",
    "STRICT_ENV",
    "BucketOverflowError",
    "GenerationSettings",
    "NotCompilableError",
    "ReadBacks",
    "RecompileError",
    "Route",
    "ShapePlan",
    "cache_bytes",
    "compiled_graphs",
    "configure",
    "default_variant",
    "eager_decode_step",
    "explain",
    "generate",
    "ladder_figures",
    "plan_shapes",
    "read_backs",
    "timed_host_steps",
]

# Re-exported for the modules and tests that reach the loop's internals through this module.
_INTERNALS = (DEVICE_TYPES, PENALTY, WARNED, device_types, warm_plan)


def _to_host(value):
    return value.to("cpu") if hasattr(value, "to") and getattr(value, "device", None) is not None else value


def _pad_right(tensor, length: int, value: int):
    import torch.nn.functional as F

    return F.pad(tensor, (0, length - tensor.shape[1]), value=value)


def _output_to(result, device):
    import torch

    if isinstance(result, torch.Tensor):
        return result.to(device)
    if hasattr(result, "sequences") and isinstance(result.sequences, torch.Tensor):
        result.sequences = result.sequences.to(device)
    return result


def entry(upstream: Callable) -> Callable:
    """The function ``hf_tpu.enable()`` installs as ``GenerationMixin.generate`` (:mod:`~hf_tpu.transformers.
    _integration`): :func:`generate`, under upstream's name, docstring and signature (``functools.wraps``), keeping
    upstream's own in ``__hf_tpu_upstream__`` (what enabling again wraps)."""

    @functools.wraps(upstream)
    def generate_on_tpu(self, *args, **kwargs):
        return generate(self, *args, **kwargs)

    generate_on_tpu.__hf_tpu_upstream__ = upstream
    return generate_on_tpu


def generate(self, *args, **kwargs):
    """``GenerationMixin.generate`` with the hf_tpu loop on TPU-placed models (installed by ``hf_tpu.enable()``).

    Same arguments and results as upstream. On a ``tpu`` device, greedy search and sampling run the bucketed,
    compiled loop; everything else (and every other device) runs upstream's code unchanged.

    Example:
        >>> hf_tpu.enable("generation")                                   # doctest: +SKIP
        >>> model.to("tpu").generate(input_ids, max_new_tokens=16)       # doctest: +SKIP
    """
    import torch

    upstream = upstream_generate()
    bound = inspect.signature(upstream).bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    extra_kwargs = dict(arguments.pop("kwargs", {}))
    _check_compile_config(self, arguments, extra_kwargs)
    asked = (dict(arguments), dict(extra_kwargs))
    route = call_route(self, *asked)
    if route.loop == UPSTREAM:
        return _run_upstream(self, route, upstream, args, kwargs)
    if getattr(self.config, "_experts_implementation", None) == "grouped_mm":  # a MoE left at transformers' default
        from hf_tpu.kernels.experts_forms import prefer_measured

        prefer_measured(self)  # on torch_tpu: each bucket's measured-fastest experts form

    inputs = arguments.pop("inputs", None)
    layout = route.layout  # (what the call's inputs are, decided with its route)
    features = layout.features  # an encoder taking features (Whisper's input_features), not ids
    name = features or "input_ids"
    if inputs is None:
        inputs = extra_kwargs.pop(name, None)
    embeds = extra_kwargs.get("inputs_embeds")
    if features is not None:
        if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
            reason = f"generate got no {name} as a floating-point tensor"
            return _run_upstream(self, Route(UPSTREAM, reason, warn=True), upstream, args, kwargs)
        out_device, input_ids = inputs.device, None
    elif inputs is None and isinstance(embeds, torch.Tensor) and not self.config.is_encoder_decoder:
        out_device, input_ids = embeds.device, None  # the prompt as embeddings: upstream prepares the (no) ids
    elif inputs is None and _bos_prompt(self, arguments, extra_kwargs) is not None:
        # no prompt: upstream starts from the bos id on the model's device, where its result comes back
        out_device, input_ids = self.device, _bos_prompt(self, arguments, extra_kwargs)
    elif not isinstance(inputs, torch.Tensor) or inputs.ndim != 2:
        reason = "the inputs are not a 2D tensor of ids" if inputs is not None else "generate got no input ids"
        return _run_upstream(self, Route(UPSTREAM, reason, warn=True), upstream, args, kwargs)
    else:
        out_device = inputs.device
        input_ids = inputs.to("cpu")
    state = model_state(self)
    before = _torch_tpu.cache_stats() if state.warmed and state.strict_eager else None
    # inputs_embeds too: upstream builds the call's special tokens, logits processors and stopping criteria on the
    # prompt's device, and hf_tpu's loop keeps the sequence and runs those on the host (embeddings on the tpu are
    # read back once per call; the loop sends them to the device again for the prefill)
    # (and a grid model's image grids and token types: upstream's generate numbers the positions from them)
    host = ("image_grid_thw", "mm_token_type_ids") if layout.vision and _images.grid_tower(self) else ()
    for key in ("attention_mask", "position_ids", "decoder_input_ids", "token_type_ids", "inputs_embeds", *host):
        if extra_kwargs.get(key) is not None:
            extra_kwargs[key] = _to_host(extra_kwargs[key])

    if layout.kind == IMAGES:  # the vision tower's graph; the prefill's forward merges them
        try:
            extra_kwargs = _images.encode_images(self, state, extra_kwargs, run_graph)
        except NotCompilableError:  # its image encoder is not one graph (recorded): this call runs upstream's loop
            if state.images_problem is None:
                raise
            return _run_upstream(self, call_route(self, *asked), upstream, args, kwargs)
    if features is not None:
        input_ids, extra_kwargs = _encode_features(self, inputs, extra_kwargs)
    elif self.config.is_encoder_decoder:
        input_ids, extra_kwargs = _encode(self, input_ids, extra_kwargs)

    arguments.pop("self", None)
    streamer = arguments.get("streamer")

    def run(found: Route):
        arguments["custom_generate"] = functools.partial(run_loop, hf_tpu_plan={"streamer": streamer, "route": found})
        return upstream(self, input_ids, **arguments, **extra_kwargs)

    result, route = attempt(self, run, *asked, route=route)  # (demoted where a graph fails its first trace)
    if route.loop == UPSTREAM:
        return _run_upstream(self, route, upstream, args, kwargs)
    if before is not None:
        _refuse_eager_compiles(before)
    return _output_to(result, out_device)


def _check_compile_config(model, arguments: dict, extra_kwargs: dict) -> None:
    """Raise ValueError when ``generate`` on a tpu model is given an Inductor ``CompileConfig``, before any work.

    ``CompileConfig()``'s defaults are CUDA's: ``backend="inductor"``, ``mode="reduce-overhead"`` (CUDA graphs). On a
    chip, torch_tpu's ``torch.compile`` refuses ``backend="inductor"`` for tpu inputs at the first compiled step, after
    the prefill already ran; transformers itself compiles with torch_tpu's ``"tpu"`` backend when no
    ``compile_config`` is given (``PreTrainedModel._default_compile_config``). hf_tpu does not reroute such a config to
    ``"tpu"``: that would honour neither its backend nor its mode, and the same code would then behave differently with
    and without hf_tpu (torch_tpu raises). It raises at the start of ``generate`` instead, naming the one-line fix. A
    config with ``options={"tpu_backend": ...}`` (torch_tpu's own switch for running Inductor on TPU) or any other
    backend passes."""
    device = getattr(model, "device", None)
    if device is None or device.type != "tpu":
        return
    generation_config = arguments.get("generation_config") or getattr(model, "generation_config", None)
    config = extra_kwargs.get("compile_config")
    if config is None:
        config = getattr(generation_config, "compile_config", None)
    if config is None or getattr(config, "backend", None) != "inductor":
        return
    if extra_kwargs.get("disable_compile", getattr(generation_config, "disable_compile", False)):
        return
    if (getattr(config, "options", None) or {}).get("tpu_backend"):
        return
    raise InvalidArgumentError(
        f"generate(compile_config={config!r}) on a model on the tpu device: torch_tpu's torch.compile refuses "
        "backend='inductor' for tpu tensors (it would fail at the first compiled step), and mode='reduce-overhead' "
        "(CUDA graphs) has no TPU meaning. Pass CompileConfig(backend='tpu', dynamic=False, mode='default'), or leave "
        "compile_config out: transformers then compiles with torch_tpu's 'tpu' backend. (torch_tpu runs Inductor on "
        "TPU only when asked explicitly: options={'tpu_backend': 'pallas'}.)"
    )


def _run_upstream(model, route: Route, upstream, args, kwargs):
    """Upstream's ``generate`` on the call as given (its inputs moved to the TPU for the forward), saying the
    route's reason once where it costs something."""
    if route.warn:
        warn_once(route.reason, f"hf_tpu: {route.reason}; running upstream's generate on the TPU instead.")
    args, kwargs = _float_inputs_on_device(model, args, kwargs)
    with inputs_on_model_device(model), running():
        return upstream(model, *args, **kwargs)


def _float_inputs_on_device(model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's floating-point inputs (Whisper's ``input_features``, images' ``pixel_values``, and the other inputs
    of the image and video encoders: Qwen2-VL's ``image_grid_thw``, ``video_grid_thw``) moved to the TPU
    for upstream's loop, wherever the caller left them: upstream hands them to the encoder or vision tower as they
    are (which refuses host tensors against TPU weights), where the token ids, masks and positions stay on the host
    and its ``prepare_inputs_for_generation`` moves them each step. The call with images or videos of a model that
    numbers its positions from them (Qwen2-VL to Qwen3-VL) has all its tensors moved: upstream numbers its positions
    from the ids and the grids together (``get_rope_index``), so they must share a device (the result then comes
    back on the TPU)."""
    import torch

    # with the integer ones the image and video encoders read (grids, sizes)
    images = set(_images.image_inputs(model, kwargs)) | set(_images.video_inputs(model, kwargs))
    everything = bool(images) and _images.numbers_from_images(model)

    def moved(value, name=None):
        if not isinstance(value, torch.Tensor) or value.device == model.device:
            return value
        return value.to(model.device) if value.is_floating_point() or name in images or everything else value

    # (prompt embeddings excepted: upstream builds the call's ids and its bookkeeping where they are)
    return tuple(moved(a) for a in args), {k: v if k == "inputs_embeds" else moved(v, k) for k, v in kwargs.items()}


def run_loop(model, *args, hf_tpu_plan: dict, **kwargs):
    """The ``custom_generate`` callable hf_tpu hands upstream's ``generate``: the loop registered for the call's
    route (``hf_tpu_plan["route"]``, :func:`~hf_tpu.transformers._loops.skeleton.route_spec`: beam search's for a
    beam call, else the route's own loop), which runs the call."""
    return route_spec(hf_tpu_plan["route"]).run(model, *args, hf_tpu_plan=hf_tpu_plan, **kwargs)


def _bos_prompt(model, arguments: dict, model_kwargs: dict):
    """A call without a prompt on a decoder-only model: upstream's own start, one row holding the bos id (on the
    host); None where upstream does more (an encoder-decoder model, other tensors given, no bos id: its error)."""
    import torch

    if model.config.is_encoder_decoder or any(isinstance(v, torch.Tensor) for v in model_kwargs.values()):
        return None
    try:
        config, _ = model._prepare_generation_config(arguments.get("generation_config"), **model_kwargs)
    except (ValueError, TypeError, AttributeError):
        return None
    bos = config.bos_token_id
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if len(bos) == 1 else None
    return None if bos is None else torch.full((1, 1), int(bos), dtype=torch.long)


def _refuse_eager_compiles(before) -> None:
    """strict="eager": a torch_tpu cache miss during this ``generate`` (after warm-up) is a recompile: raise."""
    spent = _torch_tpu.cache_stats() - before
    if spent.misses:
        raise RecompileError(
            f"generate compiled {spent.misses} program(s) after warm-up: torch_tpu's cache missed {spent.misses} of "
            f"{spent.requests} request(s) (torch.tpu._get_cache_stats(); each miss is an eager op signature or a "
            "graph torch_tpu had not compiled). Warm up the shapes you serve, or relax strict mode: "
            f"hf_tpu.transformers.configure(model, strict=True) checks graphs only, unset {STRICT_ENV} allows both."
        )


def _encode(model, input_ids, model_kwargs: dict):
    """Run the encoder once on a bucketed, right-padded input and hand upstream ``encoder_outputs``."""
    import torch
    from transformers.modeling_outputs import BaseModelOutput

    state = model_state(model)
    batch, length = input_ids.shape
    ladder = state.ladder(model.config)
    bucket = ladder.bucket(length, "the encoder input", LADDER_FIX)
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(batch, length, dtype=torch.long)
    config = model.generation_config
    pad_id = fill_id(model, config.pad_token_id, config.eos_token_id)  # masked out: an id the encoder embeds
    ids = _pad_right(input_ids, bucket, pad_id)
    mask = _pad_right(mask.long(), bucket, 0)
    with torch.no_grad():
        key = (GraphKind("encoder"), batch, bucket)
        hidden = run_graph(model, state, key, ids.to(model.device), mask.to(model.device))
    model_kwargs = dict(model_kwargs)
    model_kwargs["attention_mask"] = mask
    model_kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    return ids, model_kwargs


def _encode_features(model, features, model_kwargs: dict):
    """Run the encoder of a model taking features (Whisper's ``input_features``) once, compiled for their shape
    (one graph per batch and feature shape: Whisper's feature extractor pads every clip to the model's 30 s window,
    so every audio length shares it), and hand upstream ``encoder_outputs``. The features go to the model's device
    here, wherever the caller left them."""
    import torch
    from transformers.modeling_outputs import BaseModelOutput

    state = model_state(model)
    on_device = features.to(model.device)  # (no copy when they are there already)
    # what upstream's generate gets as its inputs: it reads their batch size and device only, the encoder having run
    host = features if features.device.type == "cpu" else torch.empty(features.shape, dtype=features.dtype)
    mask = model_kwargs.get("attention_mask")  # (over the frames, as upstream hands it to the encoder)
    key = (GraphKind("features_encoder"), int(host.shape[0]), *(int(n) for n in host.shape[1:]), mask is not None)
    with torch.no_grad():
        args = (on_device,) if mask is None else (on_device, mask.to(model.device))
        hidden = run_graph(model, state, key, *args)
    model_kwargs = dict(model_kwargs)
    model_kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    return host, model_kwargs


@contextlib.contextmanager
def timed_host_steps() -> Iterator[list[float]]:
    """Add up, while the block runs, the seconds hf_tpu's loops spend getting each step's next tokens to the host
    (the one small copy back; on the host path the logits row, the processors and the sampler too).

    Yields:
        A one-item list holding the running total in seconds (read it after the block).

    Example:
        >>> with timed_host_steps() as host:                           # doctest: +SKIP
        ...     model.generate(ids, max_new_tokens=32)
        >>> host[0]                                                    # doctest: +SKIP
        0.0021
    """
    from hf_tpu.transformers._loops import skeleton

    total = [0.0]
    skeleton.HOST_TIMERS.append(total)
    try:
        yield total
    finally:
        skeleton.HOST_TIMERS.remove(total)


def eager_decode_step(model, cache_len: int) -> Callable[[], object]:
    """One greedy decode step of batch 1 over the model's bucketed static cache of ``cache_len`` slots, as a
    callable that runs it eagerly (no compile): for measuring what one step touches (``hf-tpu bench
    compile_cache`` counts its ops and bytes).

    Args:
        model: a causal LM on its device (a ``tpu`` one for hf_tpu's cache layers).
        cache_len: the cache's slots; the step writes the middle one.

    Returns:
        A callable without arguments running the step under ``torch.no_grad()`` and returning (tokens, logits).
    """
    import torch

    from hf_tpu.transformers._cache.static import cache_for
    from hf_tpu.transformers._graph_key import graph_spec
    from hf_tpu.transformers._graphs import run_graph  # noqa: F401 (registers the built-in graph kinds)

    cache = cache_for(model, model_state(model), 1, cache_len, None)
    mask = torch.ones(1, cache_len, dtype=torch.bool).to(model.device)
    step = torch.tensor([[5, cache_len // 2]], dtype=torch.long).to(model.device)
    extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}

    def run():
        with torch.no_grad():
            return graph_spec("decode").body(model, step, mask, cache, extra, None)

    return run

