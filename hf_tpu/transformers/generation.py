"""``model.generate()`` on a TPU: static cache, bucketed shapes, compiled prefill and decode, host-side bookkeeping.

Upstream transformers (5.24) can already run ``generate`` on a ``tpu`` device and compile the decode step with the
``"tpu"`` backend when a static cache is used, but on a TPU three things stay expensive:

* every distinct prompt length is a new static-cache length and a new prefill shape, hence new compiles;
* the prefill runs eagerly, op by op, so each new prompt length also compiles every op it touches;
* each decode step sends ``input_ids``, ``position_ids`` and a 4D mask to the device and brings the full logits row
  back (measured on the simulator: 3 host->device and 2 device->host copies per step).

hf_tpu keeps upstream's ``generate`` (argument handling, logits processors, stopping criteria, streamers, output
classes) and plugs its own decoding loop in through upstream's ``custom_generate`` hook. The loop:

* pads the prompt on the left to a *prompt bucket* and sizes the static cache to a *cache bucket*
  (:mod:`hf_tpu.transformers.buckets`), so compiles are bounded by the rungs touched;
* runs prefill and decode as ``torch.compile`` graphs (backend ``"tpu"``, static shapes, full graph);
* keeps the growing tensors (the sequence, the 2D mask, the positions) on the host; the padded mask goes to the
  device once per call, and each decode step sends one ``(batch, 2)`` tensor (next tokens and their positions) and
  reads back one ``(batch,)`` tensor (the greedy tokens, also with upstream's repetition penalty, which runs on
  the device) or, when other logits processors or sampling need them, the last logits row;
* returns the output on the device the inputs came from.

Anything the loop does not cover (beam search, assisted decoding, a user cache, sliding-window caches, ...) runs
upstream's code unchanged, with a warning that names the cost on a TPU.

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
import logging
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.transformers.buckets import BucketLadder, BucketOverflowError, default_ladder

logger = logging.getLogger("hf_tpu.generation")

__all__ = [
    "STRICT_ENV",
    "BucketOverflowError",
    "GenerationSettings",
    "RecompileError",
    "ShapePlan",
    "compiled_graphs",
    "configure",
    "default_variant",
    "generate",
    "plan_shapes",
]

# Turns a compile after warm-up into an error (same as ``warmup(..., strict=True)``).
STRICT_ENV = "HF_TPU_STRICT_COMPILE"

# Device types the hf_tpu loop takes over. Tests may widen it to exercise the loop on CPU.
_DEVICE_TYPES: set[str] = {"tpu"}

# How many static caches (one per batch/cache-bucket shape) a model keeps allocated between calls.
_CACHE_POOL_SIZE = 4


class RecompileError(RuntimeError):
    """Strict mode: ``generate`` needed a graph that warm-up did not compile."""


@dataclass
class GenerationSettings:
    """Per-model knobs of the hf_tpu generation loop (see :func:`configure`).

    ``buckets``: the ladder prompt and cache lengths round up to (default: powers of two from 16 up to the model's
    ``max_position_embeddings``). ``strict``: after :func:`hf_tpu.warmup`, a shape warm-up did not compile raises
    :class:`RecompileError` instead of compiling (default: the ``HF_TPU_STRICT_COMPILE`` environment variable).
    ``backend``/``fullgraph``: what ``torch.compile`` gets (``"tpu"``, ``True``); ``compile=False`` runs the same
    bucketed loop eagerly.
    """

    buckets: BucketLadder | None = None
    strict: bool | None = None
    backend: str | Callable | None = None
    fullgraph: bool = True
    compile: bool = True


@dataclass
class _ModelState:
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    compiled: set[tuple] = field(default_factory=set)  # graph keys already compiled for this model
    compile_log: list[tuple] = field(default_factory=list)
    warmed: bool = False
    caches: OrderedDict = field(default_factory=OrderedDict)

    def ladder(self, config) -> BucketLadder:
        if self.settings.buckets is None:
            self.settings.buckets = default_ladder(config)
        return self.settings.buckets

    @property
    def strict(self) -> bool:
        if self.settings.strict is not None:
            return self.settings.strict
        return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _state(model) -> _ModelState:
    state = model.__dict__.get("_hf_tpu_generation")
    if state is None:
        state = _ModelState()
        model.__dict__["_hf_tpu_generation"] = state
    return state


def configure(
    model,
    *,
    buckets: BucketLadder | list[int] | tuple[int, ...] | None = None,
    strict: bool | None = None,
    backend: str | Callable | None = None,
    fullgraph: bool | None = None,
    compile: bool | None = None,
) -> GenerationSettings:
    """Set how hf_tpu generates with ``model``; arguments left as None keep their current value.

    Example:
        >>> from hf_tpu.transformers.generation import configure       # doctest: +SKIP
        >>> configure(model, buckets=[32, 128, 512], strict=True)       # doctest: +SKIP
    """
    state = _state(model)
    if buckets is not None:
        state.settings.buckets = BucketLadder.coerce(buckets)
    if strict is not None:
        state.settings.strict = strict
    if backend is not None:
        state.settings.backend = backend
    if fullgraph is not None:
        state.settings.fullgraph = fullgraph
    if compile is not None:
        state.settings.compile = compile
    return state.settings


def compiled_graphs(model) -> list[tuple]:
    """The graphs hf_tpu compiled for ``model``, in order: ``("prefill", batch, prompt_bucket, cache_bucket)``,
    ``("decode", batch, cache_bucket)``, and for encoder-decoders ``("encoder", batch, encoder_bucket)`` etc.

    Example:
        >>> model.generate(ids, max_new_tokens=8)             # doctest: +SKIP
        >>> compiled_graphs(model)                            # doctest: +SKIP
        [('prefill', 1, 16, 32), ('decode', 1, 32)]
    """
    return list(_state(model).compile_log)


# ----------------------------------------------------------------------------------------------------------------
# Graphs. Each kind is its own top-level function, so that dynamo keeps one cache of compiled entries per kind.


def _last_logits(out, penalty) -> tuple[Any, Any]:
    """(greedy tokens, float32 logits) of the last position; ``penalty=(seen, value)`` applies upstream's
    repetition penalty to the tokens marked in ``seen`` (``(batch, vocab + 1)`` bool) before the argmax."""
    import torch

    logits = out.logits[:, -1, :].float()
    scores = logits
    if penalty is not None:
        seen, value = penalty
        penalized = torch.where(logits < 0, logits * value, logits / value)
        scores = torch.where(seen[:, : logits.shape[-1]], penalized, logits)
    return scores.argmax(dim=-1), logits


def _mark(penalty, tokens) -> None:
    """Add the tokens just appended to the sequence to the repetition-penalty set (in place, on the device)."""
    if penalty is not None:
        seen = penalty[0]
        seen.scatter_(1, tokens.clamp(max=seen.shape[1] - 1), True)


def _decoder_prefill(model, packed, mask, cache, extra, penalty=None):
    q = packed.shape[1] // 2
    out = model(
        input_ids=packed[:, :q], position_ids=packed[:, q:], attention_mask=mask, cache=cache, use_cache=True,
        return_dict=True, **extra,
    )  # fmt: skip
    return _last_logits(out, penalty)


def _decoder_decode(model, packed, mask, cache, extra, penalty=None):
    q = packed.shape[1] // 2
    _mark(penalty, packed[:, :q])
    out = model(
        input_ids=packed[:, :q], position_ids=packed[:, q:], attention_mask=mask, cache=cache, use_cache=True,
        return_dict=True, **extra,
    )  # fmt: skip
    return _last_logits(out, penalty)


def _encoder(model, input_ids, mask):
    return model.get_encoder()(input_ids=input_ids, attention_mask=mask, return_dict=True).last_hidden_state


def _seq2seq_prefill(model, ids, encoder_hidden, encoder_mask, cache, penalty=None):
    from transformers.modeling_outputs import BaseModelOutput

    out = model(
        decoder_input_ids=ids, encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden),
        attention_mask=encoder_mask, cache=cache, use_cache=True, return_dict=True,
    )  # fmt: skip
    return _last_logits(out, penalty)


def _seq2seq_decode(model, ids, encoder_hidden, encoder_mask, cache, penalty=None):
    from transformers.modeling_outputs import BaseModelOutput

    _mark(penalty, ids)
    out = model(
        decoder_input_ids=ids, encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden),
        attention_mask=encoder_mask, cache=cache, use_cache=True, return_dict=True,
    )  # fmt: skip
    return _last_logits(out, penalty)


_GRAPHS: dict[str, Callable] = {
    "prefill": _decoder_prefill,
    "decode": _decoder_decode,
    "encoder": _encoder,
    "seq2seq_prefill": _seq2seq_prefill,
    "seq2seq_decode": _seq2seq_decode,
}
# Variants with upstream's repetition penalty applied on the device (greedy search keeps its one small copy).
_PENALTY = "+repetition_penalty"
for _kind in ("prefill", "decode", "seq2seq_prefill", "seq2seq_decode"):
    _GRAPHS[_kind + _PENALTY] = _GRAPHS[_kind]
_COMPILED: dict[tuple, Callable] = {}


def _backend_for(settings: GenerationSettings, device) -> str | Callable:
    if settings.backend is not None:
        return settings.backend
    return "tpu" if device.type == "tpu" else "aot_eager"


def _compiled(kind: str, backend, fullgraph: bool) -> Callable:
    key = (kind, backend, fullgraph)
    fn = _COMPILED.get(key)
    if fn is None:
        import torch

        fn = torch.compile(_GRAPHS[kind], backend=backend, fullgraph=fullgraph, dynamic=False)
        _COMPILED[key] = fn
    return fn


def _describe(key: tuple) -> str:
    kind, batch, *rest = key
    names = {
        "prefill": ("prompt bucket", "cache bucket"),
        "decode": ("cache bucket",),
        "encoder": ("encoder bucket",),
        "seq2seq_prefill": ("encoder bucket", "decoder prompt", "cache bucket"),
        "seq2seq_decode": ("encoder bucket", "cache bucket"),
    }[kind.removesuffix(_PENALTY)]
    return f"{kind} graph for batch={batch}, " + ", ".join(f"{n}={v}" for n, v in zip(names, rest))


def _run(model, state: _ModelState, key: tuple, *args):
    """Run the graph ``key[0]`` for the shape ``key``; strict mode refuses a shape warm-up did not compile."""
    import torch

    first = key not in state.compiled
    if first and state.warmed and state.strict:
        raise RecompileError(
            f"generate needs a {_describe(key)}, which warm-up did not compile (strict mode; "
            f"{len(state.compiled)} graph(s) compiled so far). Warm up for this shape "
            f"(hf_tpu.warmup(model, max_prompt_len=..., batch_sizes=[{key[1]}], max_new_tokens=...)), "
            f"or allow compiles: configure(model, strict=False) / unset {STRICT_ENV}."
        )
    settings = state.settings
    if not settings.compile:
        fn = _GRAPHS[key[0]]
        result = fn(model, *args)
    else:
        fn = _compiled(key[0], _backend_for(settings, model.device), settings.fullgraph)
        limits = {"recompile_limit": max(torch._dynamo.config.recompile_limit, 1024)}
        if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
            limits["accumulated_recompile_limit"] = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
        if not first and state.strict and state.warmed:
            limits["error_on_recompile"] = True
        with torch._dynamo.config.patch(**limits):
            result = fn(model, *args)
    if first:
        state.compiled.add(key)
        state.compile_log.append(key)
        logger.info("hf_tpu: compiled the %s", _describe(key))
    return result


# ----------------------------------------------------------------------------------------------------------------
# Caches


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


# ----------------------------------------------------------------------------------------------------------------
# Shape planning


@dataclass(frozen=True)
class ShapePlan:
    batch: int
    prompt_len: int
    prompt_bucket: int
    cache_bucket: int
    encoder_bucket: int | None = None


def _cache_rungs(ladder: BucketLadder) -> BucketLadder:
    # A padded prompt plus the new tokens may pass the model's length limit while the real sequence does not: the
    # extra slots are storage only (padding keeps position 0), so the cache ladder has one rung above the top.
    return BucketLadder((*ladder.rungs, 2 * ladder.max))


def plan_shapes(
    model, batch: int, prompt_len: int, max_new_tokens: int, *, encoder_len: int | None = None, variant: str = ""
) -> ShapePlan:
    """The buckets a ``generate`` call of this size runs in (prefers shapes already compiled for the model).

    Raises :class:`BucketOverflowError` for a prompt past the largest bucket, or a prompt plus ``max_new_tokens``
    longer than the largest cache bucket.

    Example:
        >>> plan_shapes(model, batch=1, prompt_len=20, max_new_tokens=32)      # doctest: +SKIP
        ShapePlan(batch=1, prompt_len=20, prompt_bucket=32, cache_bucket=64, encoder_bucket=None)
    """
    state = _state(model)
    ladder = state.ladder(model.config)
    fix = (
        "truncate the prompt (tokenizer(..., truncation=True, max_length=...)) or give a larger ladder "
        "(hf_tpu.transformers.configure(model, buckets=[...]))"
    )
    new = max(int(max_new_tokens), 1)
    if encoder_len is not None:
        # Encoder-decoder: the encoder input is bucketed, the decoder prompt (usually the start token) is not.
        encoder_bucket = ladder.bucket(encoder_len, "the encoder input", fix)
        need = prompt_len + new - 1
        if need > ladder.max:
            raise BucketOverflowError(
                f"the decoder prompt ({prompt_len}) plus max_new_tokens ({new}) needs a cache of {need} tokens, past "
                f"the largest cache bucket ({ladder.max}): lower max_new_tokens or configure a larger ladder."
            )
        compiled = sorted(
            k[4]
            for k in state.compiled
            if k[0] == "seq2seq_prefill" + variant and k[1:4] == (batch, encoder_bucket, prompt_len) and k[4] >= need
        )
        cache_bucket = compiled[0] if compiled else ladder.bucket(need)
        return ShapePlan(batch, prompt_len, prompt_len, cache_bucket, encoder_bucket)

    prompt_bucket = ladder.bucket(prompt_len, "the prompt", fix)
    if prompt_len + new - 1 > ladder.max:
        raise BucketOverflowError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({new}) is {prompt_len + new} tokens, past the "
            f"largest cache bucket ({ladder.max}, the model's length limit unless configured): lower max_new_tokens "
            "or shorten the prompt."
        )
    need = prompt_bucket + new - 1
    compiled = sorted(
        k[3]
        for k in state.compiled
        if k[0] == "prefill" + variant and k[1:3] == (batch, prompt_bucket) and k[3] >= need
    )
    cache_bucket = compiled[0] if compiled else _cache_rungs(ladder).bucket(need)
    return ShapePlan(batch, prompt_len, prompt_bucket, cache_bucket)


# ----------------------------------------------------------------------------------------------------------------
# The decoding loop (plugged into upstream ``generate`` as ``custom_generate``)


def _select(
    logits_processor, input_ids, tokens_dev, logits_dev, do_sample: bool, host_path: bool
) -> tuple[Any, Any, Any]:
    """Next tokens on the host: the device argmax (one small copy) or, when processors/sampling need the scores,
    the last logits row processed on the host exactly as upstream's ``_sample`` does."""
    import torch

    if not host_path:
        return tokens_dev.to("cpu"), None, None
    logits = logits_dev.to("cpu")
    scores = logits_processor(input_ids, logits)
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
    else:
        tokens = torch.argmax(scores, dim=-1)
    return tokens, scores, logits


def _device_penalty(logits_processor):
    """The repetition-penalty processor when it is the only logits processor (greedy search stays on the device)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    if len(logits_processor) != 1:
        return None
    proc = logits_processor[0]
    if type(proc) is not RepetitionPenaltyLogitsProcessor:
        return None
    return proc


def _output_vocab(model) -> int:
    embeddings = model.get_output_embeddings()
    if embeddings is not None and hasattr(embeddings, "weight"):
        return int(embeddings.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def _penalty_state(input_ids, model, proc, device):
    """``(seen, penalty)`` for a ``RepetitionPenaltyLogitsProcessor`` (None without one): the tokens of the sequence
    so far as a ``(batch, vocab + 1)`` mask on the device. Ids past the vocabulary and the prompt positions the
    processor ignores (``prompt_ignore_length``: the left padding) land in the extra column, as upstream drops them."""
    import torch

    if proc is None:
        return None
    vocab = _output_vocab(model)
    ids = input_ids.clamp(max=vocab)
    ignore = proc.prompt_ignore_length
    if isinstance(ignore, int):
        ids = ids[:, ignore:]
    elif isinstance(ignore, torch.Tensor):
        positions = torch.arange(ids.shape[1])
        ids = ids.masked_fill(positions[None, :] < ignore.to("cpu")[:, None], vocab)
    seen = torch.zeros(input_ids.shape[0], vocab + 1, dtype=torch.bool)
    seen.scatter_(1, ids, True)
    return (seen.to(device), float(proc.penalty))


def _decode_loop(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    hf_tpu_plan: dict | None = None,
    **model_kwargs,
):
    """``custom_generate`` callable: greedy/sampling decode with bucketed static shapes and compiled graphs."""
    import torch
    import torch.nn.functional as F
    from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

    info = hf_tpu_plan or {}
    streamer = info.get("streamer", streamer)
    state = _state(model)
    device = model.device
    is_seq2seq = bool(model.config.is_encoder_decoder)
    input_ids = input_ids.to("cpu")
    batch, prompt_len = input_ids.shape
    new_tokens = generation_config.max_length - prompt_len
    pad_token = generation_config._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    do_sample = bool(generation_config.do_sample)
    want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    host_path = do_sample or len(logits_processor) > 0 or want_scores or want_logits
    penalty_proc = None
    if not (do_sample or want_scores or want_logits):
        penalty_proc = _device_penalty(logits_processor)
        ignore = getattr(penalty_proc, "prompt_ignore_length", None)
        if isinstance(ignore, int) and ignore > prompt_len:  # would also ignore generated tokens: keep it on the host
            penalty_proc = None
    if penalty_proc is not None:
        host_path = False
    variant = _PENALTY if penalty_proc is not None else ""
    scores = () if want_scores else None
    raw_logits = () if want_logits else None

    if is_seq2seq:
        encoder_hidden = model_kwargs["encoder_outputs"].last_hidden_state
        enc_mask = model_kwargs.get("attention_mask")
        if enc_mask is None:
            enc_mask = torch.ones(encoder_hidden.shape[:2], dtype=torch.long)
        plan = plan_shapes(model, batch, prompt_len, new_tokens, encoder_len=encoder_hidden.shape[1], variant=variant)
        cache = _cache_for(model, state, batch, plan.cache_bucket, encoder_hidden.shape[1])
        enc_mask_dev = enc_mask.to(device)
        step_input = input_ids.to(device)
        penalty = _penalty_state(input_ids, model, penalty_proc, device)
        prefill_key = ("seq2seq_prefill" + variant, batch, plan.encoder_bucket, prompt_len, plan.cache_bucket)
        decode_key = ("seq2seq_decode" + variant, batch, plan.encoder_bucket, plan.cache_bucket)
        tokens_dev, logits_dev = _run(
            model, state, prefill_key, step_input, encoder_hidden, enc_mask_dev, cache, penalty
        )
        positions = None
    else:
        plan = plan_shapes(model, batch, prompt_len, new_tokens, variant=variant)
        mask = model_kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(batch, prompt_len, dtype=torch.long)
        mask = mask.to("cpu")
        positions = model_kwargs.get("position_ids")
        if positions is None:
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        positions = positions.to("cpu").long().expand(batch, prompt_len)
        pad = plan.prompt_bucket - prompt_len
        pad_id = int(pad_token) if pad_token is not None else 0
        ids = F.pad(input_ids, (pad, 0), value=pad_id)
        pos = F.pad(positions, (pad, 0), value=0)
        full_mask = torch.cat(
            [
                F.pad(mask.bool(), (pad, 0), value=False),
                torch.ones(batch, plan.cache_bucket - plan.prompt_bucket, dtype=torch.bool),
            ],
            dim=1,
        )
        cache = _cache_for(model, state, batch, plan.cache_bucket, None)
        mask_dev = full_mask.to(device)
        extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        penalty = _penalty_state(input_ids, model, penalty_proc, device)
        prefill_key = ("prefill" + variant, batch, plan.prompt_bucket, plan.cache_bucket)
        decode_key = ("decode" + variant, batch, plan.cache_bucket)
        packed = torch.cat([ids, pos], dim=1).to(device)
        tokens_dev, logits_dev = _run(model, state, prefill_key, packed, mask_dev, cache, extra, penalty)
        positions = positions[:, -1]

    unfinished = torch.ones(batch, dtype=torch.long)
    steps_left = plan.cache_bucket - (plan.prompt_bucket if not is_seq2seq else prompt_len)
    while True:
        next_tokens, step_scores, step_logits = _select(
            logits_processor, input_ids, tokens_dev, logits_dev, do_sample, host_path
        )
        if want_scores:
            scores += (step_scores,)
        if want_logits:
            raw_logits += (step_logits,)
        if has_eos:
            next_tokens = next_tokens * unfinished + pad_token * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(next_tokens)
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        if unfinished.max() == 0 or steps_left <= 0:
            break
        steps_left -= 1
        if is_seq2seq:
            step = next_tokens[:, None].to(device)
            tokens_dev, logits_dev = _run(model, state, decode_key, step, encoder_hidden, enc_mask_dev, cache, penalty)
        else:
            positions = positions + 1
            step = torch.stack([next_tokens, positions], dim=1).to(device)
            tokens_dev, logits_dev = _run(model, state, decode_key, step, mask_dev, cache, extra, penalty)

    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    if is_seq2seq:
        return GenerateEncoderDecoderOutput(sequences=input_ids, scores=scores, logits=raw_logits)
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits)


# ----------------------------------------------------------------------------------------------------------------
# The ``generate`` entry point

_UPSTREAM_GENERATE: Callable | None = None
_SUPPORTED_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "input_ids"}
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def _upstream_generate() -> Callable:
    if _UPSTREAM_GENERATE is not None:
        return _UPSTREAM_GENERATE
    from transformers.generation.utils import GenerationMixin

    fn = GenerationMixin.generate
    return getattr(fn, "__hf_tpu_upstream__", fn)


def _why_upstream(model, args: dict, kwargs: dict) -> str | None:
    """None when the hf_tpu loop handles this call; otherwise why not (a warning when it costs compiles)."""
    from transformers.generation.configuration_utils import GenerationMode

    device = getattr(model, "device", None)
    if device is None or device.type not in _DEVICE_TYPES:
        return "silent:not on a tpu device"
    if args.get("custom_generate") is not None:
        return "silent:custom_generate given"
    for name in ("assistant_model", "negative_prompt_ids", "prefix_allowed_tokens_fn"):
        if args.get(name) is not None:
            return f"{name} is not supported by the bucketed loop"
    if args.get("synced_gpus"):
        return "synced_gpus is not supported by the bucketed loop"
    try:
        config, model_kwargs = model._prepare_generation_config(args.get("generation_config"), **kwargs)
    except (ValueError, TypeError, AttributeError):
        return "silent:upstream rejects the arguments"  # let upstream raise its own error
    if config.disable_compile:
        return "silent:disable_compile=True"
    if config.cache_implementation not in (None, "static"):
        if config.cache_implementation == "dynamic":
            return (
                "cache_implementation='dynamic' on a TPU grows the cache by one token per step: every decode step has "
                "a new shape and compiles a new program (max_new_tokens=N costs about N compiles). Drop "
                "cache_implementation to get hf_tpu's static, bucketed cache"
            )
        return f"cache_implementation={config.cache_implementation!r} is not supported by the bucketed loop"
    if not config.use_cache:
        return "use_cache=False recomputes the whole sequence each step, a new shape (and compile) per step"
    mode = config.get_generation_mode(args.get("assistant_model"))
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"{mode.value} is not supported by the bucketed loop (only greedy search and sampling are)"
    if config.output_attentions or config.output_hidden_states:
        return "output_attentions/output_hidden_states are not supported by the bucketed loop"
    if config.token_healing:
        return "token_healing is not supported by the bucketed loop"
    if model_kwargs.get("cache") is not None or model_kwargs.get("past_key_values") is not None:
        return "silent:a user cache was passed"
    extra = set(model_kwargs) - _SUPPORTED_MODEL_KWARGS
    if model.config.is_encoder_decoder:
        extra -= {"decoder_input_ids"}
    extra = {k for k in extra if model_kwargs[k] is not None}
    if extra:
        return f"model inputs {sorted(extra)} are not supported by the bucketed loop"
    problem = _static_cache_problem(model)
    if problem:
        return f"{type(model).__name__}: {problem}"
    return None


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


def generate(self, *args, **kwargs):
    """``GenerationMixin.generate`` with the hf_tpu loop on TPU-placed models (installed by ``hf_tpu.enable()``).

    Same arguments and results as upstream. On a ``tpu`` device, greedy search and sampling run the bucketed,
    compiled loop; everything else (and every other device) runs upstream's code unchanged.

    Example:
        >>> hf_tpu.enable("generation")                                   # doctest: +SKIP
        >>> model.to("tpu").generate(input_ids, max_new_tokens=16)       # doctest: +SKIP
    """
    import torch

    upstream = _upstream_generate()
    bound = inspect.signature(upstream).bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    extra_kwargs = dict(arguments.pop("kwargs", {}))
    reason = _why_upstream(self, arguments, extra_kwargs)
    if reason is not None:
        if not reason.startswith("silent:"):
            _warn_once(reason, f"hf_tpu: {reason}; running upstream's generate on the TPU instead.")
        return upstream(self, *args, **kwargs)

    inputs = arguments.pop("inputs", None)
    name = "input_ids"
    if inputs is None:
        inputs = extra_kwargs.pop(name, None)
    if inputs is None or not isinstance(inputs, torch.Tensor) or inputs.ndim != 2:
        return upstream(self, *args, **kwargs)
    out_device = inputs.device
    input_ids = inputs.to("cpu")
    for key in ("attention_mask", "position_ids", "decoder_input_ids"):
        if extra_kwargs.get(key) is not None:
            extra_kwargs[key] = _to_host(extra_kwargs[key])

    if self.config.is_encoder_decoder:
        input_ids, extra_kwargs = _encode(self, input_ids, extra_kwargs)

    arguments.pop("self", None)
    arguments["custom_generate"] = functools.partial(_decode_loop, hf_tpu_plan={"streamer": arguments.get("streamer")})
    result = upstream(self, input_ids, **arguments, **extra_kwargs)
    return _output_to(result, out_device)


def _encode(model, input_ids, model_kwargs: dict):
    """Run the encoder once on a bucketed, right-padded input and hand upstream ``encoder_outputs``."""
    import torch
    from transformers.modeling_outputs import BaseModelOutput

    state = _state(model)
    batch, length = input_ids.shape
    ladder = state.ladder(model.config)
    bucket = ladder.bucket(length, "the encoder input", "truncate the input or configure a larger ladder")
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(batch, length, dtype=torch.long)
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    ids = _pad_right(input_ids, bucket, pad_id)
    mask = _pad_right(mask.long(), bucket, 0)
    with torch.no_grad():
        hidden = _run(model, state, ("encoder", batch, bucket), ids.to(model.device), mask.to(model.device))
    model_kwargs = dict(model_kwargs)
    model_kwargs["attention_mask"] = mask
    model_kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    return ids, model_kwargs


@contextlib.contextmanager
def _device_types(*types: str) -> Iterator[None]:
    """Let the loop take over models on other device types too (tests use it to compare on CPU)."""
    added = [t for t in types if t not in _DEVICE_TYPES]
    _DEVICE_TYPES.update(added)
    try:
        yield
    finally:
        _DEVICE_TYPES.difference_update(added)


def default_variant(model) -> str:
    """The graph variant the model's own ``generation_config`` leads to (greedy with a repetition penalty runs the
    penalty variant); :func:`hf_tpu.warmup` compiles that one."""
    config = model.generation_config
    penalty = getattr(config, "repetition_penalty", None)
    if not config.do_sample and penalty is not None and float(penalty) != 1.0:
        return _PENALTY
    return ""


def _warm(model, plan: ShapePlan, variant: str = "") -> list[tuple]:
    """Compile (or find compiled) every graph a call with ``plan`` runs, on dummy inputs; returns their keys."""
    import torch

    state = _state(model)
    device = model.device
    batch = plan.batch
    value = None
    if variant == _PENALTY:
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

        value = RepetitionPenaltyLogitsProcessor(float(model.generation_config.repetition_penalty))
    with torch.no_grad():
        if plan.encoder_bucket is not None:
            enc_key = ("encoder", batch, plan.encoder_bucket)
            ids = torch.zeros(batch, plan.encoder_bucket, dtype=torch.long)
            mask = torch.ones(batch, plan.encoder_bucket, dtype=torch.long)
            mask_dev = mask.to(device)
            hidden = _run(model, state, enc_key, ids.to(device), mask_dev)
            start = model.generation_config.decoder_start_token_id
            start = 0 if start is None else int(start)
            cache = _cache_for(model, state, batch, plan.cache_bucket, plan.encoder_bucket)
            prefill_key = ("seq2seq_prefill" + variant, batch, plan.encoder_bucket, plan.prompt_len, plan.cache_bucket)
            decode_key = ("seq2seq_decode" + variant, batch, plan.encoder_bucket, plan.cache_bucket)
            step = torch.full((batch, plan.prompt_len), start, dtype=torch.long)
            penalty = _penalty_state(step, model, value, device)
            _run(model, state, prefill_key, step.to(device), hidden, mask_dev, cache, penalty)
            step = torch.full((batch, 1), start, dtype=torch.long).to(device)
            _run(model, state, decode_key, step, hidden, mask_dev, cache, penalty)
            cache.reset()  # the next call resets it too: meet the eager ops of the reset here
            return [enc_key, prefill_key, decode_key]
        p, c = plan.prompt_bucket, plan.cache_bucket
        extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        cache = _cache_for(model, state, batch, c, None)
        mask_dev = torch.ones(batch, c, dtype=torch.bool).to(device)
        pos = torch.arange(p, dtype=torch.long).expand(batch, p)
        ids = torch.zeros(batch, p, dtype=torch.long)
        penalty = _penalty_state(ids, model, value, device)
        packed = torch.cat([ids, pos], dim=1).to(device)
        prefill_key = ("prefill" + variant, batch, p, c)
        decode_key = ("decode" + variant, batch, c)
        _run(model, state, prefill_key, packed, mask_dev, cache, extra, penalty)
        step = torch.tensor([[0, p]], dtype=torch.long).expand(batch, 2).contiguous().to(device)
        _run(model, state, decode_key, step, mask_dev, cache, extra, penalty)
        cache.reset()
        return [prefill_key, decode_key]
