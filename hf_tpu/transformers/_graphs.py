"""The compiled graphs of the generation loop and the one place that runs them (:func:`run_graph`).

Each graph kind (prefill, decode, encoder, seq2seq prefill/decode; with a device sampling plan, a variant of one)
is its own top-level function, so that dynamo keeps one cache of compiled entries per kind, registered here as a
:class:`~hf_tpu.transformers._graph_key.GraphSpec` (its body, its key's dims by name, what :func:`run_graph` does
around it). :func:`run_graph` reads the spec, never the kind's name, and runs the graph for one shape key: from the
model's persistent compile cache when it has one (:mod:`hf_tpu.compile_cache`: loaded without tracing or compiling,
or compiled ahead of time and stored), else through ``torch.compile``; in strict mode after warm-up it refuses a shape
warm-up did not compile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from hf_tpu import _capture_registry
from hf_tpu._torch_tpu import HOST_READ_REFUSED
from hf_tpu.compile_cache import model_identity
from hf_tpu.transformers import _beam_graphs
from hf_tpu.transformers._graph_key import GraphKind, Variant, public_key
from hf_tpu.transformers._graph_key import GraphKey, GraphSpec, graph_spec, graph_specs, register_graph
from hf_tpu.transformers._settings import (
    CACHED,
    CACHELESS,
    HOST_LENGTH,
    STRICT_ENV,
    GenerationSettings,
    ModelState,
    NotCompilableError,
    RecompileError,
    compile_cache_of,
)
from hf_tpu.transformers._step_outputs import FEATURES as OUTPUT_FEATURES
from hf_tpu.transformers._step_outputs import is_variant, prepare, with_outputs
from hf_tpu.transformers._upstream import cache_name

logger = logging.getLogger("hf_tpu.generation")

__all__: list[str] = []

def _last_logits(logits, sampling) -> tuple[Any, Any]:
    """(next tokens, float32 logits) of the last position: the argmax, or with ``sampling`` (a device plan of
    :mod:`hf_tpu.transformers.sampling`) the logits processors, warpers and sampler run on the device."""
    logits = logits[:, -1, :].float()
    if sampling is None:
        return logits.argmax(dim=-1), logits
    from hf_tpu.transformers.sampling import select

    return select(logits, sampling), logits


def _mark(sampling, tokens) -> None:
    """Add the tokens just appended to the sequence to the device state of the sampling plan (in place)."""
    if sampling is not None:
        from hf_tpu.transformers.sampling import advance

        advance(sampling, tokens)


# A decoder that numbers its tokens by its cache length (absolute positions, no ``position_ids``: BART-family and
# Whisper decoders, TrOCR) gets its prompt right-aligned: the prompt fills the first slots, the bucket's padding
# follows it, and the prefill sets every layer's counter back to the prompt length, so each token sits at its own
# position (the padding is causal future to the prompt, and decode overwrites it). ``extra`` carries the flag.
ALIGNED = "hf_tpu_prompt_first"
# A model numbering its positions in several rows (Qwen2-VL's multimodal rotary positions: temporal, height, width)
# gets them packed after the ids, row after row; ``extra`` carries the number of rows (the graphs' "mrope" feature).
MROPE = "hf_tpu_position_rows"


def _split(packed, extra: dict):
    """The ids and positions of a packed ``(batch, q * (1 + rows))`` input: positions ``(batch, q)``, or
    ``(rows, batch, q)`` for a model numbering them in ``rows`` rows."""
    rows = extra.get(MROPE, 1)
    q = packed.shape[1] // (1 + rows)
    positions = packed[:, q:]
    if rows > 1:
        positions = positions.reshape(packed.shape[0], rows, q).transpose(0, 1)
    return packed[:, :q], positions


def _model_kwargs(extra: dict) -> dict:
    """``extra`` without hf_tpu's flags (as given when it has none: copying it would guard on its keys' order)."""
    if extra.get(ALIGNED) is None and extra.get(MROPE) is None:
        return extra
    return {k: v for k, v in extra.items() if k not in (ALIGNED, MROPE)}


def _decoder_prefill(model, packed, mask, cache, extra, sampling=None):
    from hf_tpu.transformers._cache.masks import prefill_mask

    ids, positions = _split(packed, extra)
    q = ids.shape[1]
    if extra.get(ALIGNED):
        return _aligned_prefill(model, ids, positions, mask, cache, extra, sampling)
    out = model(
        input_ids=ids, position_ids=positions, attention_mask=prefill_mask(cache, mask, q),
        **{cache_name(): cache}, use_cache=True, return_dict=True, **_model_kwargs(extra),
    )  # fmt: skip
    return with_outputs(_last_logits(out.logits, sampling), out, extra)


def _embeds_prefill(model, embeds, positions, mask, cache, extra, sampling=None):
    """The prefill of a prompt given as embeddings (``generate(inputs_embeds=...)``), left-padded with zeros."""
    from hf_tpu.transformers._cache.masks import prefill_mask

    out = model(
        inputs_embeds=embeds, position_ids=positions, attention_mask=prefill_mask(cache, mask, embeds.shape[1]),
        **{cache_name(): cache}, use_cache=True, return_dict=True, **_model_kwargs(extra),
    )  # fmt: skip
    return with_outputs(_last_logits(out.logits, sampling), out, extra)


def _aligned_prefill(model, ids, slots, mask, cache, extra, sampling):
    """The prefill of a right-aligned prompt: ``slots`` holds each token's cache slot, -1 for the padding after it."""
    import torch

    from hf_tpu.transformers._cache.masks import prefill_mask

    length = (slots >= 0).sum(dim=-1)[:1]  # the prompt's length (one per call: every row has it)
    kwargs = _model_kwargs(extra)  # (a copy: ALIGNED is set)
    if "logits_to_keep" in kwargs:
        kwargs["logits_to_keep"] = length - 1
    out = model(
        input_ids=ids, attention_mask=prefill_mask(cache, mask, ids.shape[1]), **{cache_name(): cache}, use_cache=True,
        return_dict=True, **kwargs,
    )  # fmt: skip
    self_cache = getattr(cache, "self_attention_cache", cache)
    for layer in self_cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.copy_(length[0])
    logits = out.logits if "logits_to_keep" in kwargs else out.logits.index_select(1, length - 1)
    return with_outputs(_last_logits(logits, sampling), out, kwargs)


def _decoder_decode(model, packed, mask, cache, extra, sampling=None):
    from hf_tpu.transformers._cache.masks import decode_mask

    ids, positions = _split(packed, extra)
    _mark(sampling, ids)
    kwargs = dict(_model_kwargs(extra))  # (a copy: positions go in)
    if not extra.get(ALIGNED):  # (a prompt-first model takes no positions: its cache length places the token)
        kwargs["position_ids"] = positions
    out = model(
        input_ids=ids, attention_mask=decode_mask(cache, mask), **{cache_name(): cache}, use_cache=True,
        return_dict=True, **kwargs,
    )  # fmt: skip
    return with_outputs(_last_logits(out.logits, sampling), out, kwargs)


def _encoder(model, input_ids, mask):
    return model.get_encoder()(input_ids=input_ids, attention_mask=mask, return_dict=True).last_hidden_state


def _vision(model, inputs, constants=None, precomputed=None):
    """The image encoder of a vision-language model (its base model's ``get_image_features``, as upstream's
    ``generate`` calls it before the prefill). A model taking a grid per image (not Qwen-VL's:
    :func:`hf_tpu.transformers._images.takes_grid`): ``constants`` holds the grid and its segment bounds as ints
    (:func:`~hf_tpu.transformers._images.grid_constants`), made tensors here, and ``precomputed`` a windowed
    tower's window inputs."""
    import torch

    from hf_tpu.transformers._images import Bounds

    if constants is not None:
        device = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device
        grid = torch.tensor(constants["image_grid_thw"], dtype=torch.long, device=device)
        bounds = Bounds(constants["cu_seqlens"])
        inputs = {**inputs, "image_grid_thw": grid, "cu_seqlens": bounds, **(precomputed or {})}
    return model.base_model.get_image_features(**inputs, return_dict=True)


def _grid_vision(model, pixels, precomputed):
    """The vision tower of a model taking its images as patch rows with a grid each (Qwen2-VL to Qwen3-VL), on the
    grid's precomputed inputs (:func:`hf_tpu.transformers._images.grid_inputs`); returns the merged features of all
    images, in order (what ``get_image_features`` splits per image and the forward concatenates again), and with a
    tower handing the text features of its early layers (Qwen3-VL's ``deepstack_features``) those as well, a tuple
    of one tensor per layer."""
    visual = model.base_model.visual
    out = visual(pixels.type(visual.dtype), grid_thw=None, **precomputed, return_dict=True)
    deepstack = getattr(out, "deepstack_features", None)
    return (out.pooler_output, tuple(deepstack)) if deepstack else out.pooler_output


@contextlib.contextmanager
def _no_output_collector():
    """No outputs collected from the modules run inside, as upstream's ``capture_outputs`` sets it around a forward
    asking for none: its hooks on the layers (installed once a forward of the model asked for outputs) then read a
    plain variable, which dynamo traces, not the context variable they read outside a decorated forward."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - a transformers without output capturing: no hooks to quiet
        yield
        return
    token = _active_collector.set(None)
    try:
        yield
    finally:
        _active_collector.reset(token)


def _positioned_vision(model, pixels, positions, counts):
    """The image encoder of a model taking patch rows with their positions (Gemma 4, Gemma 4 Unified:
    :func:`hf_tpu.transformers._images.positioned`), its own modules as its ``get_image_features`` runs them, up to
    the features of the padded rows; then each image's first features (``counts``: its real rows, host integers),
    where upstream keeps them by the positions' values (a boolean mask: a shape the graph cannot know). Returns the
    images' features in one tensor, in order."""
    import torch

    base = model.base_model
    tower = getattr(base, "vision_tower", None)
    if tower is None:  # Gemma 4 Unified: an encoder-free embedder, a token per row
        features = base.embed_vision(pixels, positions, return_dict=True).pooler_output
        return torch.cat([features[i, :n] for i, n in enumerate(counts)])
    area = int(tower.config.pooling_kernel_size) ** 2
    padding = (positions == -1).all(dim=-1)
    embeds = tower.patch_embedder(pixels, positions, padding)
    with _no_output_collector():
        hidden = tower.encoder(inputs_embeds=embeds, attention_mask=~padding, pixel_position_ids=positions)
    pooled, _ = tower.pooler(
        hidden_states=hidden.last_hidden_state, pixel_position_ids=positions, padding_positions=padding,
        output_length=pixels.shape[-2] // area,
    )  # fmt: skip
    pooled = torch.cat([pooled[i, : n // area] for i, n in enumerate(counts)])
    if tower.config.standardize:
        pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
    return base.embed_vision(inputs_embeds=pooled.to(embeds.dtype))


def _padded_vision(model, pixels, mask, rules):
    """The image encoder of Idefics2, Idefics3 and SmolVLM (:func:`hf_tpu.transformers._images.padded`) on the call's
    real images only (``pixels``, ``(images, channels, height, width)``, in the model's dtype) and their pixel masks
    (``(images, height, width)``), dropped from the padding on the host
    (:func:`~hf_tpu.transformers._images.padded_images`). Re-composes the lines of upstream's ``get_image_features``
    after that drop (modeling_idefics2.py, modeling_idefics3.py, modeling_smolvlm.py in transformers 5.24): each
    patch's mask from its pixels' (unfolded as upstream does; ``rules``: every pixel real, Idefics2's, else any, and
    whether the connector takes the patches' mask, as :func:`~hf_tpu.transformers._images.padded_rule` read them from
    that code), the model's own ``vision_model`` and ``connector``; not the per-row split (``tolist()`` of a device
    value there; the forward concatenates the rows' features again). Returns the images' features, a row per token,
    in order: what upstream's per-row features concatenate to."""
    base = model.base_model
    full, connector_mask = rules
    patch = int(base.config.vision_config.patch_size)
    subgrid = mask.unfold(dimension=1, size=patch, step=patch).unfold(dimension=2, size=patch, step=patch)
    sums = subgrid.sum(dim=(-1, -2))
    patch_mask = (sums == patch * patch).bool() if full else (sums > 0).bool()
    out = base.vision_model(pixel_values=pixels, patch_attention_mask=patch_mask, return_dict=True)
    hidden = out.last_hidden_state
    if connector_mask:
        features = base.connector(hidden, attention_mask=patch_mask.view(pixels.size(0), -1))
    else:
        features = base.connector(hidden)
    return features.reshape(-1, features.shape[-1])


def _features_encoder(model, features, mask=None):
    """The encoder of a model taking features (Whisper's ``input_features``) rather than ids, with the call's mask
    over its frames when one was given (Whisper's encoder ignores it; Speech2Text's reads it)."""
    kwargs = {} if mask is None else {"attention_mask": mask}
    return model.get_encoder()(**{model.main_input_name: features}, **kwargs, return_dict=True).last_hidden_state


def _seq2seq_prefill(model, ids, encoder_hidden, encoder_mask, cache, sampling=None):
    from transformers.modeling_outputs import BaseModelOutput

    out = model(
        decoder_input_ids=ids, encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden),
        attention_mask=encoder_mask, **{cache_name(): cache}, use_cache=True, return_dict=True,
    )  # fmt: skip
    return _last_logits(out.logits, sampling)


def _seq2seq_decode(model, ids, encoder_hidden, encoder_mask, cache, sampling=None):
    from transformers.modeling_outputs import BaseModelOutput

    _mark(sampling, ids)
    out = model(
        decoder_input_ids=ids, encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden),
        attention_mask=encoder_mask, **{cache_name(): cache}, use_cache=True, return_dict=True,
    )  # fmt: skip
    return _last_logits(out.logits, sampling)


# The loop without a cache (hf_tpu.transformers._loops.cacheless): the ids live in a device buffer as long as the
# bucket, the prompt first; each graph runs the model over all of it and reads the logits at one slot.
def _cacheless_forward(model, ids, slot, mask, positions, extra, sampling):
    kwargs = dict(extra)
    if positions is not None:
        kwargs["position_ids"] = positions
    if model._supports_logits_to_keep():
        kwargs["logits_to_keep"] = slot  # a tensor of indices: the logits of that slot only
    out = model(input_ids=ids, attention_mask=mask, return_dict=True, **kwargs)
    logits = out.logits if "logits_to_keep" in kwargs else out.logits.index_select(1, slot)
    return with_outputs(_last_logits(logits, sampling), out, kwargs)


def _cacheless_prefill(model, ids, slot, mask, positions, extra, sampling=None):
    """The first step: the logits at ``slot`` (``(1,)``, the prompt's last slot) of the buffer ``ids``."""
    return _cacheless_forward(model, ids, slot, mask, positions, extra, sampling)


def _cacheless_decode(model, ids, step, mask, positions, extra, sampling=None):
    """A later step: ``step`` is ``(batch, 2)``, the new tokens and their slot; written into ``ids`` in place."""
    tokens, slot = step[:, :1], step[:1, 1]
    ids.index_copy_(1, slot, tokens)
    _mark(sampling, tokens)
    return _cacheless_forward(model, ids, slot, mask, positions, extra, sampling)


# The built-in graph kinds (hf_tpu.transformers._graph_key: a new kind is one GraphSpec, registered once)
_PREFILL = ("prompt bucket", "cache bucket")
_CACHE = ("cache bucket",)
for _spec in (
    GraphSpec("prefill", _decoder_prefill, _PREFILL, "a decoder's prompt into its cache", starts_sequence=True),
    GraphSpec("embeds_prefill", _embeds_prefill, _PREFILL, "a prompt given as embeddings", starts_sequence=True),
    GraphSpec(
        "mm_prefill", _decoder_prefill, (*_PREFILL, "image features"),
        "a prompt with its encoded images among the extra arguments: the forward merges them",
        starts_sequence=True, images="merge", text_base="prefill",
    ),
    GraphSpec(
        "vision", _vision, ("image inputs", "image grids"),  # (the grids: a model taking one per image, not Qwen-VL)
        "an image encoder (the base model's get_image_features)", images="encoder",
    ),
    GraphSpec("grid_vision", _grid_vision, ("pixel rows", "image grids"), "a vision tower over patch rows with grids",
              images="encoder"),  # fmt: skip
    GraphSpec("positioned_vision", _positioned_vision, ("patch rows", "real rows per image"),
              "an image encoder over patch rows with their positions", images="encoder"),  # fmt: skip
    GraphSpec("padded_vision", _padded_vision, ("real images' pixels", "pixel mask dtype"),
              "an image encoder over the real images of a padded batch", images="encoder"),  # fmt: skip
    GraphSpec("decode", _decoder_decode, _CACHE, "a decoder's step of one token", host_length=True),
    GraphSpec("encoder", _encoder, ("encoder bucket",), "an encoder-decoder's encoder over ids"),
    GraphSpec("features_encoder", _features_encoder, ("feature size", "frames", "mask"),
              "an encoder over features (Whisper's input_features)"),  # fmt: skip
    GraphSpec("seq2seq_prefill", _seq2seq_prefill, ("encoder bucket", "decoder prompt", "cache bucket"),
              "an encoder-decoder's decoder prompt into its cache"),  # fmt: skip
    GraphSpec("seq2seq_decode", _seq2seq_decode, ("encoder bucket", "cache bucket"),
              "an encoder-decoder's decoder step of one token", host_length=True),  # fmt: skip
    GraphSpec("cacheless_prefill", _cacheless_prefill, _CACHE, "the first step of the loop without a cache",
              cacheless=True),  # fmt: skip
    GraphSpec("cacheless_decode", _cacheless_decode, _CACHE, "a later step of the loop without a cache",
              cacheless=True),  # fmt: skip
    # beam search (hf_tpu.transformers._loops.beam): the forward, then upstream's beam step, in one graph
    GraphSpec("beam_prefill", _beam_graphs.beam_prefill_body, _PREFILL, "beam search's prompt and first beam step",
              starts_sequence=True),  # fmt: skip
    GraphSpec("beam_decode", _beam_graphs.beam_decode_body, _CACHE, "a beam search step"),
    GraphSpec("beam_cacheless_prefill", _beam_graphs.beam_cacheless_prefill_body, _CACHE,
              "beam search's first step without a cache"),  # fmt: skip
    GraphSpec("beam_cacheless_decode", _beam_graphs.beam_cacheless_decode_body, _CACHE,
              "a beam search step without a cache"),  # fmt: skip
):
    register_graph(_spec)


def vision_kinds() -> tuple[str, ...]:
    """The image encoders' graph kinds (run before the prefill, keyed by the images)."""
    return tuple(spec.base for spec in graph_specs() if spec.images == "encoder")


# Graph kinds carry the device plan's variant (hf_tpu.transformers._graph_key: "decode+temperature+top_k+sample"):
# the processors (and sampler) the graph runs on the device. The variant of greedy search with a lone repetition
# penalty:
PENALTY = Variant(("repetition_penalty",))


def _graph(kind: GraphKind) -> Callable:
    return graph_spec(kind).body


_COMPILED: dict[tuple, Callable] = {}


def _backend_for(settings: GenerationSettings, device) -> str | Callable:
    if settings.backend is not None:
        return settings.backend
    return "tpu" if device.type == "tpu" else "aot_eager"


def _compiled(kind: GraphKind, backend, fullgraph: bool) -> Callable:
    key = (kind, _graph(kind), backend, fullgraph)  # (the body: a kind registered again compiles its new one)
    fn = _COMPILED.get(key)
    if fn is None:
        import torch

        fn = torch.compile(
            _graph(kind), backend=backend, fullgraph=fullgraph, dynamic=False,
            options={"guard_filter_fn": _capture_registry.without_registry_guards},
        )  # fmt: skip
        _COMPILED[key] = fn
    return fn


def _describe(key: GraphKey) -> str:
    return graph_spec(key.kind).describe(key)


def _graph_id(key: tuple, args: tuple) -> str:
    """The compile-cache name of a graph: its shape key (whose kind names the device plan's processors; as text, as
    hf_tpu has always named it) plus the Python float constants the trace bakes in (none today: the plan's values
    are graph inputs)."""
    constants = [a[1] for a in args if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], float)]
    return repr((public_key(key), constants))


def _source(module) -> str:
    """``module``'s source, or its name where it has none to read (a module built in memory)."""
    import inspect

    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return module.__name__


def cache_namespace(cache, model, state: ModelState):
    """The model's namespace in the compile cache: everything a graph depends on besides its shapes and weights."""
    import hashlib
    import inspect

    settings = state.settings
    backend = _backend_for(settings, model.device)
    from hf_tpu.transformers import _step_outputs, sampling
    from hf_tpu.transformers._cache import layer_classes as _cache_layer_classes
    from hf_tpu.transformers._cache import masks as _cache_masks
    from hf_tpu.transformers._cache import static as _cache_static
    from hf_tpu.transformers._cache import writes as _cache_writes
    from hf_tpu.transformers.sampling import _processors, _registry, _warpers

    # the graphs' own code: this module, the device sampling, the outputs they return, and the cache layers, masks
    # and KV writes they trace
    modules = [
        inspect.getmodule(run_graph), sampling, _registry, _processors, _warpers, _cache_static, _cache_masks,
        _cache_writes, _cache_layer_classes, _step_outputs, _beam_graphs, inspect.getmodule(GraphSpec),
    ]  # fmt: skip
    for spec in graph_specs():  # (and the module of a kind registered from elsewhere)
        module = inspect.getmodule(spec.body)
        if module is not None and module not in modules:
            modules.append(module)
    source = "".join(_source(m) for m in modules)
    # and the bucketed forms of models' own caches (read, not imported: importing it imports their modeling files)
    from pathlib import Path

    source += (Path(__file__).parent / "_cache" / "model_classes.py").read_text()
    parts = {
        **model_identity(model),
        "ladder": list(state.ladder(model.config).rungs),
        "cache_multiple": settings.cache_multiple,
        "backend": backend if isinstance(backend, str) else f"{backend.__module__}.{backend.__qualname__}",
        "graphs_source": hashlib.sha256(source.encode()).hexdigest(),
    }
    return cache.namespace("generation", parts)


def _from_cache(model, state: ModelState, key: GraphKey, args: tuple) -> Callable | None:
    """The graph for ``key`` from the model's persistent compile cache (loaded, or compiled ahead of time and
    stored); None when the model has no cache or the cache cannot serve this graph (reported, not raised)."""
    cache = compile_cache_of(state)
    settings = state.settings
    if cache is None or not settings.fullgraph:
        return None
    if state.host_length:  # a graph with a symbolic cache length: torch-tpu 0.2.0 cannot serialize those
        _skip_cache_once(model)
        return None
    space = cache_namespace(cache, model, state)
    if space is None:
        return None
    backend = _backend_for(settings, model.device)
    graph_id = _graph_id(key, args)
    fn = space.load_or_compile(graph_id, _graph(key.kind), backend, (model, *args), describe=_describe(key))
    if fn is not None:
        space.record([list(public_key(key))])
    return fn


def _skip_cache_once(model) -> None:
    from hf_tpu.transformers._notes import warn_once

    warn_once(
        f"host-length-cache:{type(model).__name__}",
        f"hf_tpu: {type(model).__name__}'s decode graph takes its cache length as a dynamic size (its code reads the "
        "length as a number); torch-tpu 0.2.0 cannot serialize such a graph, so the persistent compile cache does not "
        "hold its graphs: each new process compiles them once.",
    )


# The source dynamo gives the host length a ``HostLengthLayer`` reports (``L['cache'].layers[0].hf_tpu_length``):
# marked dynamic in decode graphs, so that one graph serves every length.
_HOST_LENGTH_SOURCES = r".*\.hf_tpu_length$"


def _host_read_reason(message: str) -> str:
    """The reason a graph torch_tpu refused for a read of a device value on the host gives (its words:
    :data:`hf_tpu._torch_tpu.HOST_READ_REFUSED`), with the op it names and the innermost source line."""
    import re

    op = re.search(r"(\w+)\(\): " + re.escape(HOST_READ_REFUSED), message)
    sites = re.findall(r'File "(?:[^"]*/)?([^/"]+)", line (\d+), in (\w+)', message)
    where = f" at {sites[-1][0]}:{sites[-1][1]} in {sites[-1][2]}" if sites else ""
    return f"torch_tpu refuses graphs that read a device value on the host ({op[1] if op else 'a read'}{where})"


def _not_one_graph(exc: BaseException) -> str | None:
    """What made a trace fail when the code cannot be one graph, None for any other failure: a graph break under
    ``fullgraph`` (a branch on a tensor's value, ...), a shape that depends on a tensor's value, or a read of a device
    value on the host inside the graph, which torch_tpu refuses to lower."""
    import torch
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound

    from hf_tpu.errors import HfTpuError

    seen: BaseException | None = exc
    for _ in range(8):  # the error, then what it was raised from
        if seen is None or isinstance(seen, HfTpuError):
            return None  # (hf_tpu's own error: one handled before this trace, met as the context it ran in)
        if HOST_READ_REFUSED in str(seen):
            return _host_read_reason(str(seen))
        if isinstance(seen, torch._dynamo.exc.Unsupported):
            return (str(seen).strip().splitlines() or [""])[0]
        if isinstance(seen, (GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound)):
            return f"a shape that depends on a tensor's value ({type(seen).__name__})"
        seen = seen.__cause__ or seen.__context__
    return None


def _where(exc: BaseException) -> str:
    """The innermost source line dynamo names in ``exc`` (``modeling_cpmant.py:637 `if past_length != 0:```)."""
    import re

    lines = str(exc).splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(r'\s*File "(?:.*/)?([^/"]+)", line (\d+), in ', lines[i])
        if found:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f" at {found[1]}:{found[2]}" + (f" `{code}`" if code else "")
    return ""


def _first_trace(model, state: ModelState, key: GraphKey, compiled: Callable, args: tuple):
    """The first run of a graph (its trace); a model whose forward cannot be one static-shape graph raises
    :class:`NotCompilableError`, carrying the reason and the loop whose graph failed for
    :func:`hf_tpu.transformers.route.demote` (which moves the model to its next route)."""
    try:
        return compiled(model, *args)
    except Exception as exc:
        what = _not_one_graph(exc)
        if what is None:
            raise
        what += _where(exc)
        if is_variant(key.kind):  # the call's outputs only: this call runs upstream's loop, the model's route stays
            reason = (
                f"output_attentions/output_hidden_states: {type(model).__name__}'s forward returning them cannot be "
                f"compiled as one static-shape graph ({what})"
            )
            state.outputs_problems[key.kind.features & OUTPUT_FEATURES] = reason
            error = NotCompilableError(f"{reason}; found tracing the {_describe(key)}")
            error.reason, error.loop = reason, None
            raise error from exc
        spec = graph_spec(key.kind)
        # the image encoder, or the forward merging the images where the text's prefill traced: the images' own
        # code, so calls with images run upstream's loop and the others keep the model's route
        merge = spec.images == "merge" and any(k.kind.base == spec.text_base for k in state.compiled)
        if spec.images == "encoder" or merge:
            part = "forward merging them" if merge else "image encoder (get_image_features)"
            reason = (
                f"images: {type(model).__name__}'s {part} cannot be compiled as one static-shape graph ({what})"
                + ("; without images it can" if merge else "")
            )
            state.images_problem = reason
            error = NotCompilableError(f"{reason}; found tracing the {_describe(key)}")
            error.reason, error.loop = reason, None
            raise error from exc
        loop = CACHELESS if spec.cacheless else HOST_LENGTH if state.host_length else CACHED
        if loop == HOST_LENGTH:  # the second try: the first reason stays first
            reason = f"{state.route.reason}; with its cache length as a host int: {what}"
        else:
            reason = (
                f"{type(model).__name__}'s forward cannot be compiled as one static-shape graph ({what}): "
                "its code branches on, or shapes a tensor by, a value of the cache or inputs"
            )
        error = NotCompilableError(f"{reason}; found tracing the {_describe(key)}")
        error.reason, error.loop = reason, loop
        raise error from exc


def run_graph(model, state: ModelState, key: tuple, *args):
    """Run the graph of kind ``key[0]`` (a :class:`~hf_tpu.transformers._graph_key.GraphKind`, whose registered
    :class:`~hf_tpu.transformers._graph_key.GraphSpec` gives the body and what to do around it) for the shape
    ``key``; strict mode refuses a shape warm-up did not compile."""
    import torch

    key = GraphKey.of(key)
    spec = graph_spec(key.kind)
    first = key not in state.compiled
    cache_name()  # read from upstream's signature here, outside any trace (the graphs then read a plain string)
    if first and state.warmed and state.strict:
        raise RecompileError(
            f"generate needs a {_describe(key)}, which warm-up did not compile (strict mode; "
            f"{len(state.compiled)} graph(s) compiled so far). Warm up for this shape "
            f"(hf_tpu.warmup(model, max_prompt_len=..., batch_sizes=[{key.batch}], max_new_tokens=...)), "
            f"or allow compiles: hf_tpu.transformers.configure(model, strict=False) / unset {STRICT_ENV}."
        )
    from hf_tpu.transformers import _module_state

    kind = key.kind
    if spec.starts_sequence and state.module_states != []:  # ([]: the model keeps none, found at its first prefill)
        _module_state.reset(model, state, key.batch)  # a new sequence: module-held state as upstream resets it
    if first and spec.images == "merge":
        from hf_tpu.transformers import _deepstack

        _deepstack.apply_to(model)  # early vision features added at the image tokens with static shapes (Qwen3-VL)
    # (a vision tower's forward asks for hidden states)
    if first and (is_variant(kind) or spec.images == "encoder"):
        prepare(model)
    settings = state.settings
    if not settings.compile:
        result = spec.body(model, *args)
    else:
        limits = {"recompile_limit": max(torch._dynamo.config.recompile_limit, 1024)}
        if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
            limits["accumulated_recompile_limit"] = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
        if not first and state.strict and state.warmed:
            limits["error_on_recompile"] = True
        if spec.images == "merge":
            # the merge's check of image tokens against features (upstream's torch_compilable_check on a tensor) is
            # a host read inside the graph, which torch_tpu refuses to lower: checked on the host instead
            # (hf_tpu.transformers._images.check_image_tokens)
            limits["do_not_emit_runtime_asserts"] = True
        sources = {}
        if state.host_length and spec.host_length:
            sources["dynamic_sources"] = _HOST_LENGTH_SOURCES
        with torch._dynamo.config.patch(**limits), torch.compiler.config.patch(**sources):
            fn = state.loaded.get(key)
            if fn is None and first:
                fn = _from_cache(model, state, key, args)
                if fn is not None:
                    state.loaded[key] = fn
            result = None
            if fn is not None:
                from hf_tpu.compile_cache import StaleGraphError

                try:
                    result = fn(model, *args)
                except StaleGraphError:
                    state.loaded.pop(key, None)
                    fn = None
            if fn is None:
                compiled = _compiled(kind, _backend_for(settings, model.device), settings.fullgraph)
                result = _first_trace(model, state, key, compiled, args) if first else compiled(model, *args)
    from transformers.cache_utils import Cache

    from hf_tpu.transformers._cache.writes import write_rows

    for arg in args:  # the rows a decode graph left unwritten (_cache.writes.kv_rows_after), written in place now
        if isinstance(arg, Cache):
            write_rows(arg)
    if state.module_states:
        _module_state.settle(state)
    if first:
        state.compiled.add(key)
        state.compile_log.append(key)
        logger.info("hf_tpu: compiled the %s", _describe(key))
    return result
