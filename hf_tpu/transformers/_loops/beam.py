"""Beam search and beam sampling (``num_beams > 1``) on hf_tpu's bucketed static cache.

Upstream's ``generate`` prepares the call as for its own ``_beam_search`` (the inputs expanded to ``batch *
num_beams`` rows, the logits processors and stopping criteria built) and hands it to :func:`beam_loop` through
``custom_generate``. The loop pads the prompt on the left to its bucket as the greedy loop does, sends the prompt
and the beam state to the device once, and runs one ``beam_prefill`` graph and then one ``beam_decode`` graph per
new token (:mod:`hf_tpu.transformers._beam_graphs`: the forward, the processors, the beam scoring with upstream's
own helpers, the finished hypotheses and the cache reorder, all on the device). Each step sends nothing and reads
back one boolean: whether the search stopped (the check upstream's loop makes on the host). The outputs are
upstream's ``_beam_search``'s: ``sequences`` (``num_return_sequences`` per prompt), and with
``return_dict_in_generate`` ``sequences_scores`` (with ``output_scores``), ``scores``/``logits`` (copied back each
step only when asked), ``beam_indices`` and the cache. ``token_type_ids`` (GPT-2's) go through the prefill, and the
prompt's last type with every new token, as upstream extends them (graph variants ``+token_type_ids``).

What it serves is decided in :mod:`hf_tpu.transformers.route` with :func:`beam_problem`: a call it cannot serve
runs upstream's loop with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hf_tpu.errors import InternalError
from hf_tpu.transformers import _step_outputs as step_outputs
from hf_tpu.transformers._cache.handoff import full_attention_only, returned_cache
from hf_tpu.transformers._cache.static import cache_for, reset_cache, set_decoding, set_length
from hf_tpu.transformers._graph_key import NO_VARIANT, GraphKind, Variant
from hf_tpu.transformers._graphs import ALIGNED
from hf_tpu.transformers._graphs import run_graph as _run_graph
from hf_tpu.transformers._images import mrope_rows
from hf_tpu.transformers._loops.cached import extra_inputs
from hf_tpu.transformers._loops.skeleton import (
    BEAM, LoopSpec, ShapePlan, fill_id, output_vocab, plan_shapes, register_loop,
)  # fmt: skip
from hf_tpu.transformers._settings import CACHED, CACHELESS, NotCompilableError, model_state
from hf_tpu.transformers._upstream import numbers_by_cache_length, output_cache_field

__all__ = ["beam_features", "beam_problem"]

_STOPPING_FORMS = ("MaxLengthCriteria", "EosTokenCriteria")


def beam_problem(model, args: dict, config, model_kwargs: dict, route) -> tuple[str, bool] | None:
    """Why hf_tpu's beam loop cannot serve this beam call, and whether generate warns (not where upstream raises its
    own error for the call); None when it can. ``args``: generate's named arguments, ``config``/``model_kwargs``
    the call's generation config and model inputs, ``route`` the route the call takes otherwise."""
    problem = _problem(model, args, config, model_kwargs, route)
    if problem is None:
        return None
    return problem, not problem.endswith(_UPSTREAM_ERROR)


# the end of a reason where upstream's loop raises its own error for the call (no warning: the error says it)
_UPSTREAM_ERROR = "(upstream's loop refuses it)"


def _problem(model, args: dict, config, model_kwargs: dict, route) -> str | None:
    name = type(model).__name__
    if model.config.is_encoder_decoder:
        return "beam search on an encoder-decoder model: hf_tpu's beam loop serves decoder-only models only"
    if route.loop not in (CACHED, CACHELESS):
        return f"beam search on {name}: hf_tpu's beam loop runs on the cached loop and the loop without a cache, and {route}"
    if route.loop == CACHED and numbers_by_cache_length(model):
        return f"beam search on {name}: its prompt goes first in the bucketed cache, which the beam loop does not place"
    if mrope_rows(model) > 1:
        return f"beam search on {name}: its positions come in three rows (multimodal rotary positions), which the beam loop does not carry yet"
    if route.loop == CACHED and not full_attention_only(model):
        return f"beam search on {name}: its cache has layer kinds other than full attention, which the beam loop does not reorder yet"
    if args.get("streamer") is not None:
        return f"beam search with a streamer {_UPSTREAM_ERROR}"
    if args.get("stopping_criteria"):
        return "beam search with stopping_criteria of your own: they are asked on the host, between device steps"
    if config.stop_strings is not None or config.max_time is not None:
        return "beam search with stop_strings/max_time: those stopping criteria run on the host"
    if config.low_memory:
        return f"beam search with low_memory=True {_UPSTREAM_ERROR}"
    from hf_tpu.transformers._upstream import PROMPT_INPUTS

    given = [k for k in PROMPT_INPUTS if k != "token_type_ids" and model_kwargs.get(k) is not None]
    if given:
        return f"beam search with {', '.join(given)}: the beam loop takes input_ids (and token_type_ids) only"
    from hf_tpu.transformers._upstream import CACHE_NAMES

    if any(model_kwargs.get(k) is not None for k in CACHE_NAMES):
        return "beam search from a cache passed in: the beam loop starts from the prompt"
    taken = {"input_ids", "attention_mask", "position_ids", "token_type_ids", "use_cache", "output_attentions",
             "output_hidden_states"}  # fmt: skip
    other = sorted(k for k, v in model_kwargs.items() if v is not None and k not in taken and k not in CACHE_NAMES)
    if other:  # (images, audio features, ...: inputs other loops of hf_tpu may take)
        return f"beam search with model inputs {other}: the beam loop takes input_ids (and token_type_ids) only"
    if not model_state(model).settings.device_sampling:
        return "beam search with device sampling off (configure(model, device_sampling=False)): its processors run in the graph only"
    procs = args.get("logits_processor") or []
    from hf_tpu.transformers.sampling._registry import form_for

    own = [type(p).__name__ for p in procs if form_for(p) is None]
    if own:
        return f"beam search with {', '.join(own)}, which has no device form: its processors run in the graph only"
    return None


def beam_features(num_beams: int, keep: int, n_eos: int, early_stopping, do_sample: bool) -> tuple[str, ...]:
    """The features of a beam graph's kind that say what it was traced for (:mod:`hf_tpu.transformers._graph_key`):
    the beams, the continuations kept per step (upstream's ``beams_to_keep``) and the number of end-of-sequence ids
    checked (``"beams4x8e1"``), ``early_stopping`` (``"early"``, ``"never"``), sampling (``"beam_sample"``)."""
    stop = {True: ("early",), "never": ("never",)}.get(early_stopping, ())
    return (f"beams{num_beams}x{keep}e{n_eos}", *stop, *(("beam_sample",) if do_sample else ()))


def _stopping(stopping_criteria, prompt_len: int) -> tuple[int | None, object]:
    """(the new tokens MaxLengthCriteria allows, the eos ids EosTokenCriteria stops at) of the call's criteria;
    another kind runs upstream's loop (its reason)."""
    limit, eos = None, None
    for criterion in stopping_criteria:
        kind = type(criterion).__name__
        if kind not in _STOPPING_FORMS or type(criterion).__module__ != "transformers.generation.stopping_criteria":
            error = NotCompilableError(f"beam search with {kind}: the beam loop checks max length and eos only")
            error.reason = str(error)
            raise error
        if kind == "MaxLengthCriteria":
            allowed = int(criterion.max_length) - prompt_len
            limit = allowed if limit is None else min(limit, allowed)
        else:
            eos = criterion.eos_token_id
    return limit, eos


def _divisors(config, width: int, max_new: int):
    """The length penalty's divisors per step (index ``i``: after ``i + 1`` new tokens), as upstream's Python
    computes them: for a finished hypothesis, and for the best running score of its early-stopping heuristic."""
    import torch

    penalty = config.length_penalty
    finish = [float((i + 1) ** penalty) for i in range(width)]
    if config.early_stopping == "never" and penalty > 0.0:
        running = [float(max_new**penalty)] * width
    else:
        running = [float((i + 1) ** penalty) for i in range(width)]
    return torch.tensor(finish, dtype=torch.float32), torch.tensor(running, dtype=torch.float32)


def _beam_state(batch, num_beams, width, fill, max_new, last_position, eos, divisors, device) -> dict:
    """The device state of a beam search: upstream's running and finished tensors (the sequence and beam-index
    buffers holding the new tokens only, ``width`` columns), the step counter and the call's values."""
    import torch

    seqs = torch.full((batch, num_beams, width), fill, dtype=torch.long)
    indices = torch.full((batch, num_beams, width), -1, dtype=torch.int32)
    running_scores = torch.zeros(batch, num_beams)
    running_scores[:, 1:] = -1e9
    host = {
        "seqs": seqs,
        "running_scores": running_scores,
        "running_indices": indices,
        "sequences": seqs.clone(),
        "beam_scores": torch.full((batch, num_beams), -1e9),
        "beam_indices": indices.clone(),
        "finished": torch.zeros(batch, num_beams, dtype=torch.bool),
        "improvable": torch.ones(batch, 1, dtype=torch.bool),
        "generated": torch.zeros(1, dtype=torch.long),
        "max_new_tokens": torch.tensor([max_new], dtype=torch.long),
        "fill": torch.tensor([fill], dtype=torch.long),
        "last_position": last_position,
        "finish_divisors": divisors[0],
        "running_divisors": divisors[1],
    }
    if eos is not None:
        host["eos"] = eos
    return {k: v.to(device) for k, v in host.items()}


def _run(model, state, key: tuple, *args):
    """Run a beam graph; one that does not trace sends this call (not the model: its greedy graphs may trace) to
    upstream's loop with the reason (``NotCompilableError.loop`` None: the model's route stays)."""
    try:
        return _run_graph(model, state, key, *args)
    except NotCompilableError as exc:
        if exc.loop is None:
            raise
        error = NotCompilableError(f"beam search: {exc.reason or exc}")
        error.reason = str(error)
        raise error from exc


def _output_fill(config) -> int:
    """The id upstream's ``_beam_search`` fills unused sequence slots with (its own expression)."""
    pad_token_id, eos_token_id = config._pad_token_tensor, config._eos_token_tensor
    fill = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
    return int(fill)


@dataclass
class _BeamCall:
    """What a beam call's loop reads of its arguments (:func:`_beam_call`), on either route."""

    config: object  # the call's generation config
    input_ids: object  # (batch * num_beams, prompt_len), on the host
    num_beams: int
    batch: int  # prompts, before their beams
    max_new: int  # the new tokens the stopping criteria allow
    keep: int  # the continuations kept per step (upstream's beams_to_keep)
    checked: int  # the end-of-sequence ids checked
    eos: object  # those ids (None: none)
    do_sample: bool
    plan: object  # the device sampling plan of its processors
    flags: dict  # output_attentions / output_hidden_states: graphs of their own
    variant: Variant
    types: object  # token_type_ids (GPT-2's; the beams of a prompt share its types), on the host

    def spec(self, width: int) -> tuple:
        """The beam graphs' search settings, with ``width`` new-token columns in the beam buffers."""
        return (self.batch, self.num_beams, self.keep, self.config.early_stopping, self.do_sample, self.checked, width)

    def state(self, width: int, last_position, device) -> dict:
        """The search's device state (:func:`_beam_state`) with ``width`` columns and the prompts' last positions."""
        divisors = _divisors(self.config, width, self.max_new)
        fill = _output_fill(self.config)
        return _beam_state(self.batch, self.num_beams, width, fill, self.max_new, last_position, self.eos, divisors,
                           device)  # fmt: skip


def _beam_call(model, input_ids, logits_processor, stopping_criteria, config, model_kwargs: dict) -> _BeamCall:
    """The beam call's settings from what upstream's ``generate`` prepared: the new tokens and eos ids its stopping
    criteria allow, its processors' device plan (one without a device form: upstream's loop, its reason), the graph
    variant they make."""
    from hf_tpu.transformers.sampling import device_plan

    input_ids = input_ids.to("cpu")
    rows, prompt_len = input_ids.shape
    num_beams = int(config.num_beams)
    max_new = config.max_length - prompt_len
    limit, eos = _stopping(stopping_criteria, prompt_len)
    max_new = min(max_new, limit) if limit is not None else max_new
    if eos is not None:
        eos = eos.to("cpu").long().reshape(-1)
    eos_config = config._eos_token_tensor  # upstream sizes beams_to_keep by the config's eos ids
    keep = max(2, 1 + (0 if eos_config is None else int(eos_config.shape[0]))) * num_beams
    checked = 0 if eos is None else int(eos.shape[0])
    do_sample = bool(config.do_sample)
    plan = device_plan(logits_processor, input_ids, vocab=output_vocab(model), do_sample=False)
    if isinstance(plan, str):
        error = NotCompilableError(f"beam search: {plan}: its processors run in the graph only")
        error.reason = str(error)
        raise error
    flags = step_outputs.asked(config)
    variant = plan.variant.with_features(*beam_features(num_beams, keep, checked, config.early_stopping, do_sample))
    variant = variant.with_features(*step_outputs.features(flags))
    types = model_kwargs.get("token_type_ids")
    if types is not None:
        types = types.to("cpu").long()
        variant = variant.with_features("token_type_ids")  # (graphs taking them: their own kind)
    return _BeamCall(config, input_ids, num_beams, rows // num_beams, max_new, keep, checked, eos, do_sample, plan,
                     flags, variant, types)  # fmt: skip


def beam_loop(
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
    """``custom_generate`` callable for beam search and beam sampling: on the bucketed cache
    (:func:`_cached_beam`), or on the route without a cache (:func:`_cacheless_beam`)."""
    call = _beam_call(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
    if (hf_tpu_plan or {}).get("route") is not None and hf_tpu_plan["route"].loop == CACHELESS:
        return _cacheless_beam(model, call, model_kwargs)
    return _cached_beam(model, call, model_kwargs)


def _cached_beam(model, call: _BeamCall, model_kwargs: dict):
    """Beam search on the bucketed cache: the prompt padded on the left to its bucket, one ``beam_prefill`` graph,
    then one ``beam_decode`` graph per new token (:func:`_search`)."""
    import torch
    import torch.nn.functional as F

    config, input_ids, variant, types = call.config, call.input_ids, call.variant, call.types
    state, device = model_state(model), model.device
    rows, prompt_len = input_ids.shape
    shapes = plan_shapes(model, rows, prompt_len, call.max_new, variant=variant, kind="beam_prefill")
    extra = {**extra_inputs(model), **call.flags}
    if extra.get(ALIGNED):  # pragma: no cover - route.beam_problem refuses these models
        raise InternalError("the beam loop does not place a prompt-first model's prompt")
    ids, pos, full_mask, positions = _beam_layout(model, call, model_kwargs, shapes)
    pad = shapes.prompt_bucket - prompt_len
    width = shapes.cache_bucket  # the new-token columns of the beam buffers (at least max_new)
    cache = cache_for(model, state, rows, shapes.cache_bucket, None)
    mask_dev = full_mask.to(device)
    decode_extra = extra
    if types is not None:  # the prompt's (padding: type 0, masked), then its last one for every new token, as
        # upstream's loop extends them (rows of one prompt share them, so the beams' reorder leaves them alone)
        extra = {**extra, "token_type_ids": F.pad(types, (pad, 0), value=0).to(device)}
        decode_extra = {**decode_extra, "token_type_ids": types[:, -1:].to(device)}
    sampling = call.plan.to_device(device, shapes.cache_bucket + 1, pad)
    spec = call.spec(width)
    beam = call.state(width, positions[:, -1].clone(), device)
    prefill_key = (GraphKind("beam_prefill", variant), rows, shapes.prompt_bucket, shapes.cache_bucket)
    decode_key = (GraphKind("beam_decode", variant), rows, shapes.cache_bucket)
    static_len = config.max_length - 1 if config.cache_implementation == "static" else None
    outputs = step_outputs.StepOutputs(call.flags, key_width=static_len) if call.flags else None

    set_length(cache, 0)
    packed = torch.cat([ids, pos], dim=1).to(device)
    first = _run(model, state, prefill_key, packed, mask_dev, cache, extra, spec, beam, sampling)
    set_decoding(cache, True, rows_after=False)

    def seen(steps: int) -> tuple[slice, slice]:  # this step's forward: the prompt at the prefill, then one token
        queries = slice(pad, shapes.prompt_bucket) if steps == 0 else slice(0, 1)
        return queries, slice(pad, shapes.prompt_bucket + steps)

    def step():
        return _run(model, state, decode_key, mask_dev, cache, decode_extra, spec, beam, sampling)

    steps, scores, raw_logits = _search(config, first, step, call.max_new, outputs, seen)
    cache_out = None
    if config.return_dict_in_generate:
        cache_out = returned_cache(model, cache, pad, shapes.prompt_bucket + steps - 1, static_len)
    return _outputs(config, input_ids, beam, width, steps, scores, raw_logits, outputs, cache_out)


def _beam_layout(model, call: _BeamCall, model_kwargs: dict, shapes: ShapePlan) -> tuple:
    """The prompt padded on the left to its bucket: ``(ids, positions, mask over the cache, the prompt's
    positions)``, on the host."""
    import torch
    import torch.nn.functional as F

    config, input_ids = call.config, call.input_ids
    rows, prompt_len = input_ids.shape
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones(rows, prompt_len, dtype=torch.long) if mask is None else mask.to("cpu")
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    positions = positions.to("cpu").long().expand(rows, prompt_len)
    pad = shapes.prompt_bucket - prompt_len
    ids = F.pad(input_ids, (pad, 0), value=fill_id(model, config._pad_token_tensor, config._eos_token_tensor))
    pos = F.pad(positions, (pad, 0), value=0)
    full_mask = torch.cat(
        [
            F.pad(mask.bool(), (pad, 0), value=False),
            torch.ones(rows, shapes.cache_bucket - shapes.prompt_bucket, dtype=torch.bool),
        ],
        dim=1,
    )
    return ids, pos, full_mask, positions


def _search(config, first: tuple, step: Callable, max_new: int, outputs, seen: Callable) -> tuple[int, tuple, tuple]:
    """The search from the prefill graph's outputs ``first``: ``step()`` (the next decode graph) until the device
    says the search stopped (one boolean read back per step) or ``max_new`` steps ran; the scores and logits asked
    copied back each step, the attentions and hidden states kept (``seen(steps)``: the step's queries and keys).
    Returns the steps run and the scores and logits."""
    want_scores = bool(config.return_dict_in_generate and config.output_scores)
    want_logits = bool(config.return_dict_in_generate and config.output_logits)
    scores, raw_logits = (), ()
    result, steps = first, 0
    while True:
        finished, step_scores, step_logits = result[:3]
        if outputs is not None:
            outputs.add(result[3], *seen(steps))
        steps += 1
        if want_scores:
            scores += (step_scores.to("cpu"),)
        if want_logits:
            raw_logits += (step_logits.to("cpu"),)
        if bool(finished.to("cpu")[0]) or steps >= max_new:
            return steps, scores, raw_logits
        result = step()



def _outputs(config, input_ids, beam: dict, width: int, steps: int, scores, raw_logits, outputs, cache_out):
    """What upstream's ``_beam_search`` returns, from the device state after ``steps`` steps."""
    import torch
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

    num_beams = int(config.num_beams)
    rows, prompt_len = input_ids.shape
    batch = rows // num_beams
    want_scores = bool(config.return_dict_in_generate and config.output_scores)
    want_logits = bool(config.return_dict_in_generate and config.output_logits)
    returns = min(int(config.num_return_sequences), num_beams)
    sequences = beam["sequences"].to("cpu")[:, :returns, width - steps :].reshape(batch * returns, steps)
    beam_scores = beam["beam_scores"].to("cpu")[:, :returns].reshape(-1)
    beam_indices = beam["beam_indices"].to("cpu")[:, :returns, width - steps :].reshape(batch * returns, steps)
    generated = int((beam_indices + 1).bool().sum(dim=1).max())
    prompt = input_ids.view(batch, num_beams, prompt_len)[:, :returns].reshape(batch * returns, prompt_len)
    sequences = torch.cat([prompt, sequences[:, :generated]], dim=1)
    beam_indices = beam_indices[:, :generated]
    if not config.return_dict_in_generate:
        return sequences
    fields = {output_cache_field(GenerateBeamDecoderOnlyOutput): cache_out} if cache_out is not None else {}
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=beam_scores if config.output_scores else None,
        scores=scores if want_scores else None,
        logits=raw_logits if want_logits else None,
        beam_indices=beam_indices,
        attentions=None if outputs is None else outputs.attentions,
        hidden_states=None if outputs is None else outputs.hidden_states,
        **fields,
    )


def _cacheless_beam(model, call: _BeamCall, model_kwargs: dict):
    """Beam search without a cache (``use_cache=False``, a model that keeps none): the loop of
    :mod:`hf_tpu.transformers._loops.cacheless` (the ids in a buffer as long as the bucket, the prompt first, the whole
    buffer through the model each step), its rows following the running beams."""
    import torch

    from hf_tpu.transformers._loops import cacheless

    config, input_ids, variant, types = call.config, call.input_ids, call.variant, call.types
    state, device = model_state(model), model.device
    rows, prompt_len = input_ids.shape
    # (length_for prefers the buffers of compiled "cacheless_prefill" graphs of this variant: a beam variant has none,
    # so the call's shape plan sizes the buffer, as it did when kinds were strings and this passed "beam" + variant)
    length = cacheless.length_for(model, state, rows, prompt_len, call.max_new, variant)
    pad_id = fill_id(model, config._pad_token_tensor, config._eos_token_tensor)
    ids, mask, positions = cacheless.cacheless_layout(model, input_ids, model_kwargs, length, call.max_new, pad_id)
    ids_dev, mask_dev = ids.to(device), mask.to(device)
    positions_dev = None if positions is None else positions.to(device)
    extra = {**cacheless.cacheless_extra(model), **call.flags}
    if types is not None:  # the prompt's, then its last one for every new token (the variant says so already)
        extra["token_type_ids"] = torch.cat([types, types[:, -1:].expand(rows, length - prompt_len)], 1).to(device)
    sampling = call.plan.to_device(device, length + 1, 0)
    width = length  # the new-token columns of the beam buffers (at least max_new)
    last = positions[:, prompt_len - 1].clone() if positions is not None else torch.zeros(rows, dtype=torch.long)
    spec = call.spec(width)
    beam = call.state(width, last, device)
    beam["slot"] = torch.tensor([prompt_len - 1]).to(device)  # the prompt's last slot; each step one more
    prefill_key = (GraphKind("beam_cacheless_prefill", variant), rows, length)
    decode_key = (GraphKind("beam_cacheless_decode", variant), rows, length)
    outputs = step_outputs.StepOutputs(call.flags) if call.flags else None
    args = (mask_dev, positions_dev, extra, spec, beam, sampling)
    first = _run(model, state, prefill_key, ids_dev, *args)

    def seen(steps: int) -> tuple[slice, slice]:  # upstream's forward without a cache: the whole sequence each step
        return slice(0, prompt_len + steps), slice(0, prompt_len + steps)

    def step():
        return _run(model, state, decode_key, ids_dev, *args)

    steps, scores, raw_logits = _search(config, first, step, call.max_new, outputs, seen)
    return _outputs(config, input_ids, beam, width, steps, scores, raw_logits, outputs, None)


def warm(model, plan: ShapePlan, variant: Variant = NO_VARIANT, *, num_beams: int) -> list[tuple]:
    """Compile (or find compiled) the beam graphs of ``plan`` (its batch: prompts, before the beams) for a call with
    the model's own ``generation_config`` and ``num_beams``; returns their keys. (``variant``, the greedy loop's, is
    not read: a beam graph's is its processors' and its beams'.)"""
    import torch

    from hf_tpu.transformers.sampling import device_plan

    config, _ = model._prepare_generation_config(None, num_beams=num_beams)  # (upstream's defaults filled in)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    state, device = model_state(model), model.device
    rows, p, c = plan.batch * num_beams, plan.prompt_bucket, plan.cache_bucket
    eos = config._eos_token_tensor
    eos = [] if eos is None else [int(e) for e in eos.reshape(-1)]
    keep = max(2, 1 + len(eos)) * num_beams
    early, do_sample = config.early_stopping, bool(config.do_sample)
    ids = torch.zeros(rows, p, dtype=torch.long)
    dplan = device_plan(_processors(model, ids, num_beams), ids, vocab=output_vocab(model), do_sample=False)
    if isinstance(dplan, str):
        raise NotCompilableError(f"beam search: {dplan}: its processors run in the graph only, so warm-up has none")
    variant = dplan.variant.with_features(*beam_features(num_beams, keep, len(eos), early, do_sample))
    extra = extra_inputs(model)
    cache = cache_for(model, state, rows, c, None)
    with torch.no_grad():
        mask_dev = torch.ones(rows, c, dtype=torch.bool).to(device)
        pos = torch.arange(p, dtype=torch.long).expand(rows, p)
        sampling = dplan.to_device(device, c + 1, 0)
        spec = (plan.batch, num_beams, keep, early, do_sample, len(eos), c)
        eos_t = torch.tensor(eos, dtype=torch.long) if eos else None
        beam = _beam_state(
            plan.batch, num_beams, c, 0, c - p + 1, pos[:, -1].clone(), eos_t, _divisors(config, c, c - p + 1), device
        )
        prefill_key = (GraphKind("beam_prefill", variant), rows, p, c)
        decode_key = (GraphKind("beam_decode", variant), rows, c)
        set_length(cache, 0)
        packed = torch.cat([ids, pos], dim=1).to(device)
        _run(model, state, prefill_key, packed, mask_dev, cache, extra, spec, beam, sampling)
        set_decoding(cache, True, rows_after=False)
        _run(model, state, decode_key, mask_dev, cache, extra, spec, beam, sampling)
        reset_cache(cache)
    return [prefill_key, decode_key]


def _processors(model, ids, num_beams: int):
    """The logits processors upstream builds for a beam call with the model's own ``generation_config``."""
    from transformers.generation.logits_process import LogitsProcessorList

    config, _ = model._prepare_generation_config(None, num_beams=num_beams)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    model._prepare_generated_length(
        config, has_default_max_length=True, has_default_min_length=True, model_input_name="input_ids",
        input_ids_length=ids.shape[1], inputs_tensor=ids,
    )  # fmt: skip
    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
        logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
    )  # fmt: skip


register_loop(LoopSpec(BEAM, beam_loop, warm))
