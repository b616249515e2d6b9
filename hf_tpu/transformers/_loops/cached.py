"""The decoding loop plugged into upstream ``generate`` as ``custom_generate``, and warm-up of one shape plan.

The loop pads the prompt on the left to its bucket, runs the prefill graph, then one decode graph per new token;
the growing tensors (sequence, mask) stay on the host, each decode step's input (``(batch, 2)``: the next tokens and
their positions; ``(batch, 4)`` for a model numbering its positions in three rows: Qwen2-VL's) is built on the device
(:func:`decode_input`) from the last step's tokens, which come back to the host every K steps
(:mod:`~hf_tpu.transformers._loops.readback`): the logits processors and the sampler run in the graph
(:mod:`hf_tpu.transformers.sampling`), unless one of them has no device form or the scores are wanted on the host
(``output_scores``): then the last logits row comes back each step and upstream's processors run on the host. What
the loop does around its graphs (the sampling plan, each step's host side, the output) is the shared
:class:`~hf_tpu.transformers._loops.skeleton.LoopCall`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_tpu.transformers._cache.handoff import cached_length, copy_in, returned_cache
from hf_tpu.transformers._cache.static import cache_for, reset_cache, set_decoding, set_length
from hf_tpu.transformers._graph_key import NO_VARIANT, GraphKind, Variant
from hf_tpu.transformers._graphs import ALIGNED, MROPE, run_graph
from hf_tpu.transformers._images import check_image_tokens, features_shape, mrope_rows, positioned
from hf_tpu.transformers._loops.defaults import warm_sampling
from hf_tpu.transformers._loops.skeleton import LoopCall, LoopSpec, ShapePlan, Steps, loop, plan_shapes, register_loop
from hf_tpu.transformers._settings import CACHED, HOST_LENGTH, model_state
from hf_tpu.transformers._upstream import cache_name, numbers_by_cache_length, prompt_first_inputs

__all__: list[str] = []


def cached_steps(call: LoopCall, model, model_kwargs: dict) -> Steps:
    """The cached loop's part of a call (:func:`decode_loop`): the prompt padded to its bucket (:func:`_lay_out`),
    the static cache, the prefill graph (:func:`_prefill`), then one decode graph per new token; the cache the call
    returns."""
    if model.config.is_encoder_decoder:
        return _seq2seq_steps(call, model, model_kwargs)
    state, device = call.state, model.device
    prompt = _lay_out(call, model, model_kwargs)
    plan = prompt.plan
    static_len = None
    if call.config.cache_implementation == "static":  # upstream generates with a StaticCache this long
        static_len = call.config.max_length - 1 + (prompt.length if prompt.length != prompt.ids_len else 0)
    if call.outputs is not None:
        call.outputs.key_width = static_len
    cache = cache_for(model, state, call.batch, plan.cache_bucket, None)
    mask_dev = prompt.full_mask.to(device)
    # the history of the sampling plan holds the sequence's ids: after the prompt's embeddings that have none
    sampling = call.sampling(device, plan.cache_bucket + 1, prompt.pad + prompt.length - prompt.ids_len)
    extra, decode_extra, prefill_key, decode_key = _graph_inputs(call, model, model_kwargs, prompt)
    inputs = extra, decode_extra, prefill_key, decode_key
    first = _prefill(call, model, model_kwargs, prompt, cache, mask_dev, sampling, inputs)
    set_decoding(cache, True)
    start, length = prompt.pad, prompt.cache_length  # the prompt's first cache slot; the cache's length now
    # (batch, rows), on the device: each row goes on by one per token, as upstream's loop does
    positions = prompt.positions[..., -1].T.contiguous().to(device)

    def step(next_tokens):
        nonlocal length, positions
        set_length(cache, length)
        length += 1
        packed_step, positions = decode_input(next_tokens, positions)
        result = run_graph(model, state, decode_key, packed_step, mask_dev, cache, decode_extra, sampling)
        return call.take(result, slice(0, 1), slice(start, length))

    def returned():
        return returned_cache(model, cache, start, length, static_len)

    return Steps(first, plan.cache_bucket - plan.prompt_bucket, step, returned)


def _seq2seq_steps(call: LoopCall, model, model_kwargs: dict) -> Steps:
    """:func:`cached_steps` of an encoder-decoder model: the encoder ran (``encoder_outputs``); the decoder's prompt
    (not bucketed) through the prefill graph, then one decode graph per new token."""
    import torch

    state, device, variant, batch, prompt_len = call.state, model.device, call.variant, call.batch, call.prompt_len
    encoder_hidden = model_kwargs["encoder_outputs"].last_hidden_state
    enc_mask = model_kwargs.get("attention_mask")
    if enc_mask is None:
        enc_mask = torch.ones(encoder_hidden.shape[:2], dtype=torch.long)
    plan = plan_shapes(model, batch, prompt_len, call.new_tokens, encoder_len=encoder_hidden.shape[1], variant=variant)
    cache = cache_for(model, state, batch, plan.cache_bucket, encoder_hidden.shape[1])
    enc_mask_dev = enc_mask.to(device)
    sampling = call.sampling(device, plan.cache_bucket + 1, 0)
    prefill_kind = GraphKind("seq2seq_prefill", variant)
    prefill_key = (prefill_kind, batch, plan.encoder_bucket, prompt_len, plan.cache_bucket)
    decode_key = (GraphKind("seq2seq_decode", variant), batch, plan.encoder_bucket, plan.cache_bucket)
    set_length(cache, 0)
    ids = call.input_ids.to(device)
    first = run_graph(model, state, prefill_key, ids, encoder_hidden, enc_mask_dev, cache, sampling)
    set_decoding(cache, True)
    length = prompt_len

    def step(next_tokens):
        nonlocal length
        set_length(cache, length)
        length += 1
        ids = next_tokens.to(device)[:, None]
        return run_graph(model, state, decode_key, ids, encoder_hidden, enc_mask_dev, cache, sampling)

    def returned():
        return returned_cache(model, cache, 0, length)

    return Steps(first, plan.cache_bucket - prompt_len, step, returned, seq2seq=True)


@dataclass
class _Prompt:
    """A decoder-only call's prompt as the cached loop lays it out (:func:`_lay_out`)."""

    plan: ShapePlan
    variant: Variant  # the call's, with the features its inputs add (token types, rows of positions, image types)
    length: int  # the prompt's length (its embeddings' where it comes as embeddings)
    ids_len: int  # the ids given (fewer than ``length`` after embeddings)
    rows: int  # the rows of positions
    positions: object  # (rows, batch, length) on the host
    ids: object  # the ids padded to the bucket
    pos: object  # their positions, padded the same way: (rows, batch, bucket)
    full_mask: object  # (batch, cache bucket) bool, on the host
    pad: int  # the padding before the prompt (0: prompt-first)
    cache_length: int  # the cache's length after the prefill
    extra: dict  # the graphs' extra model arguments (:func:`extra_inputs`, the outputs asked)
    embeds: object = None  # the prompt as embeddings
    types: object = None  # token_type_ids
    mm_types: object = None  # the image tokens' marks the prefill's forward reads (Gemma 4's mm_token_type_ids)


def _lay_out(call: LoopCall, model, model_kwargs: dict) -> _Prompt:
    """The call's prompt padded to its bucket: on the left, or for a model whose prompt goes first
    (:data:`~hf_tpu.transformers._graphs.ALIGNED`) first with the bucket's padding after it; its positions and mask,
    the graph variant its inputs make."""
    import torch
    import torch.nn.functional as F

    batch, prompt_len, variant = call.batch, call.prompt_len, call.variant
    embeds = model_kwargs.get("inputs_embeds")  # the prompt as embeddings: input_ids holds the ids given, if any
    types = model_kwargs.get("token_type_ids")
    if types is not None:  # (graphs taking them: their own kind)
        variant = variant.with_features("token_type_ids")
    rows = call.route.layout.rows  # (what the call's inputs are, decided with its route)
    if rows > 1:  # (positions in rows, packed after the ids)
        variant = variant.with_features("mrope")
    # Gemma 4's processor marks its image tokens (mm_token_type_ids): its prefill's forward reads them (a mask over
    # each image), upstream passes them to the first forward only
    # (Qwen-VL's stay with upstream, which numbers the positions from them: not the forward's)
    mm_types = model_kwargs.get("mm_token_type_ids") if model_kwargs.get("mm_encoder_outputs") else None
    mm_types = mm_types if mm_types is not None and positioned(model) else None
    if mm_types is not None:
        variant = variant.with_features("mm_token_type_ids")
    ids_len = prompt_len
    if embeds is not None:
        prompt_len = embeds.shape[1]
    plan = plan_shapes(model, batch, prompt_len, call.new_tokens, variant=variant)
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(batch, prompt_len, dtype=torch.long)
    mask = mask.to("cpu")
    positions = _prompt_positions(model_kwargs.get("position_ids"), mask, rows, batch, prompt_len)
    pad = plan.prompt_bucket - prompt_len
    extra = {**extra_inputs(model, rows), **call.output_flags}
    if extra.get(ALIGNED) and (embeds is not None or types is not None):  # (its cache length found at a trace)
        from hf_tpu.transformers._settings import NotCompilableError

        error = NotCompilableError(prompt_first_inputs(model))
        error.reason = str(error)  # (error.loop None: this call's inputs, the route stays)
        raise error
    length = prompt_len if extra.get(ALIGNED) else plan.prompt_bucket  # the cache's length after the prefill
    if extra.get(ALIGNED):  # the prompt first, the bucket's padding after it (slot -1)
        ids = F.pad(call.input_ids, (0, pad), value=call.fill_id)
        pos = F.pad(torch.arange(prompt_len).expand(batch, prompt_len), (0, pad), value=-1)[None]
        full_mask = torch.cat([mask.bool(), torch.ones(batch, plan.cache_bucket - prompt_len, dtype=torch.bool)], 1)
        pad = 0
    else:
        ids = F.pad(call.input_ids, (pad, 0), value=call.fill_id)
        pos = F.pad(positions, (pad, 0), value=0)  # (rows, batch, bucket)
        full_mask = torch.cat(
            [
                F.pad(mask.bool(), (pad, 0), value=False),
                torch.ones(batch, plan.cache_bucket - plan.prompt_bucket, dtype=torch.bool),
            ],
            dim=1,
        )
    return _Prompt(plan, variant, prompt_len, ids_len, rows, positions, ids, pos, full_mask, pad, length, extra,
                   embeds, types, mm_types)  # fmt: skip


def _prompt_positions(positions, mask, rows: int, batch: int, prompt_len: int):
    """The prompt's positions on the host, ``(rows, batch, prompt_len)``: the call's ``position_ids``, else as
    upstream's ``generate`` numbers them from the mask."""
    if positions is None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if rows > 1:  # (rows, batch, prompt): upstream's rows (Qwen2-VL's: the text row first, for masks, then 3)
        positions = positions.to("cpu").long()
        return positions[-rows:] if positions.ndim == 3 else positions.expand(rows, batch, prompt_len)
    return positions.to("cpu").long().expand(batch, prompt_len)[None]


def _graph_inputs(call: LoopCall, model, model_kwargs: dict, prompt: _Prompt) -> tuple[dict, dict, tuple, tuple]:
    """The prefill's and the decode step's extra model arguments (token types, image tokens' marks, the encoded
    images) on the device, and the two graphs' keys."""
    import torch.nn.functional as F

    device, batch, plan, pad, variant = model.device, call.batch, prompt.plan, prompt.pad, prompt.variant
    extra = decode_extra = prompt.extra
    images = model_kwargs.get("mm_encoder_outputs")  # encoded by the vision graph (_images): the prefill merges them
    types = prompt.types
    if types is not None:  # upstream repeats the prompt's last token type for every new token
        types = types.to("cpu").long()
        extra = {**extra, "token_type_ids": F.pad(types, (pad, 0), value=0).to(device)}
        if not images:  # (with images they mark image tokens for the prefill's mask: Gemma 3 and PaliGemma pass
            # them to the first forward only)
            decode_extra = {**decode_extra, "token_type_ids": types[:, -1:].to(device)}
    if prompt.mm_types is not None:  # (left-padded as the ids: the padding is text)
        mm_types = F.pad(prompt.mm_types.to("cpu").long(), (pad, 0), value=0)
        extra = {**extra, "mm_token_type_ids": mm_types.to(device)}
    kind = "prefill" if prompt.embeds is None else "embeds_prefill"
    prefill_key = (GraphKind(kind, variant), batch, plan.prompt_bucket, plan.cache_bucket)
    if images:
        check_image_tokens(model, call.input_ids, images)  # (upstream's check in the forward: here, on the host ids)
        extra = {**extra, "mm_encoder_outputs": images}
        prefill_key = (GraphKind("mm_prefill", variant), batch, plan.prompt_bucket, plan.cache_bucket,
                       features_shape(images))  # fmt: skip
    decode_key = (GraphKind("decode", variant), batch, plan.cache_bucket)
    return extra, decode_extra, prefill_key, decode_key


def _prefill(call: LoopCall, model, model_kwargs: dict, prompt: _Prompt, cache, mask_dev, sampling, inputs: tuple
             ) -> tuple:  # fmt: skip
    """The prompt into the cache: the prefill graph (ids, or embeddings), or, continuing from the caller's cache, its
    tokens copied in and the others through the decode graph; returns the first step's outputs, as
    :meth:`~hf_tpu.transformers._loops.skeleton.LoopCall.take` keeps them."""
    import torch
    import torch.nn.functional as F

    state, device, plan, pad, prompt_len = call.state, model.device, prompt.plan, prompt.pad, prompt.length
    extra, decode_extra, prefill_key, decode_key = inputs  # (:func:`_graph_inputs`)
    set_length(cache, 0)
    given = model_kwargs.get(cache_name()) if call.route.layout.continues else None  # the caller's cache, if any
    seen = cached_length(given) if given is not None else 0
    if seen:  # continuing: the cached tokens copied in, the others through the decode graph (_cache.handoff)
        if sampling is not None:  # its history: the cached tokens; each decode step adds its own
            sampling = replace(call.sampler, input_ids=call.input_ids[:, :seen]).to_device(
                device, plan.cache_bucket + 1, pad
            )
        copy_in(given, cache, pad)
        set_decoding(cache, True)
        for index in range(seen, prompt_len):
            set_length(cache, pad + index)
            packed_step = torch.cat([call.input_ids[:, index, None], prompt.positions[..., index].T], dim=1).to(device)
            first = run_graph(model, state, decode_key, packed_step, mask_dev, cache, decode_extra, sampling)
            first = call.take(first, slice(0, 1), slice(pad, pad + index + 1))
        if call.outputs is not None:  # upstream runs the uncached tokens in one forward
            call.outputs.merge(prompt_len - seen)
        return first
    if prompt.embeds is None:
        packed = torch.cat([prompt.ids, *prompt.pos], dim=1).to(device)
        first = run_graph(model, state, prefill_key, packed, mask_dev, cache, extra, sampling)
    else:  # moved to the device like input_ids, wherever the caller left them; the padding: zero rows, masked out
        padded = F.pad(prompt.embeds.to(device=device, dtype=model.dtype), (0, 0, pad, 0))
        pos = prompt.pos if prompt.rows > 1 else prompt.pos[0]
        first = run_graph(model, state, prefill_key, padded, pos.to(device), mask_dev, cache, extra, sampling)
    return call.take(first, slice(pad, pad + prompt_len), slice(pad, pad + prompt_len))


# ``custom_generate`` callable: greedy/sampling decode with bucketed static shapes and compiled graphs.
decode_loop = loop(cached_steps)


def decode_input(next_tokens, positions) -> tuple:
    """A decode step's ``(batch, 1 + rows)`` input on the device, from the next tokens (on the device, where the loop
    keeps them between read-backs, or on the host) and the last positions ``(batch, rows)`` on the device; returns it
    with the step's positions. Nothing comes back to the host."""
    import torch

    positions = positions + 1
    return torch.cat([next_tokens.to(positions.device)[:, None], positions], dim=1), positions



def extra_inputs(model, rows: int | None = None) -> dict:
    """The prefill/decode graphs' extra model arguments: ``logits_to_keep`` where the model takes it, the rows of
    positions (``rows``, as a call's layout says; None: asked of the model) and the flag of a model whose prompt goes
    first (:data:`hf_tpu.transformers._graphs.ALIGNED`)."""
    extra: dict = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
    rows = mrope_rows(model) if rows is None else rows
    if rows > 1:  # its positions in rows, packed after the ids
        extra[MROPE] = rows
    # a cache reporting its host length goes prompt-first too: the length it reports is the real token count
    if numbers_by_cache_length(model) or model_state(model).host_length:
        extra[ALIGNED] = True
    return extra


def warm_plan(model, plan: ShapePlan, variant: Variant = NO_VARIANT) -> list[tuple]:
    """Compile (or find compiled) every graph a call with ``plan`` runs, on dummy inputs; returns their keys."""
    import torch

    state = model_state(model)
    device = model.device
    batch = plan.batch
    with torch.no_grad():
        if plan.encoder_bucket is not None:
            enc_key = (GraphKind("encoder"), batch, plan.encoder_bucket)
            ids = torch.zeros(batch, plan.encoder_bucket, dtype=torch.long)
            mask = torch.ones(batch, plan.encoder_bucket, dtype=torch.long)
            mask_dev = mask.to(device)
            hidden = run_graph(model, state, enc_key, ids.to(device), mask_dev)
            start = model.generation_config.decoder_start_token_id
            start = 0 if start is None else int(start)
            cache = cache_for(model, state, batch, plan.cache_bucket, plan.encoder_bucket)
            prefill_key = (GraphKind("seq2seq_prefill", variant), batch, plan.encoder_bucket, plan.prompt_len,
                           plan.cache_bucket)  # fmt: skip
            decode_key = (GraphKind("seq2seq_decode", variant), batch, plan.encoder_bucket, plan.cache_bucket)
            step = torch.full((batch, plan.prompt_len), start, dtype=torch.long)
            sampling = warm_sampling(model, step, variant, plan.cache_bucket + 1, 0)
            set_length(cache, 0)
            run_graph(model, state, prefill_key, step.to(device), hidden, mask_dev, cache, sampling)
            set_decoding(cache, True)
            step = torch.full((batch,), start, dtype=torch.long).to(device)[:, None]  # (as the loop's: _loops.cached)
            set_length(cache, plan.prompt_len)
            run_graph(model, state, decode_key, step, hidden, mask_dev, cache, sampling)
            reset_cache(cache)  # the next call resets it too: meet the eager ops of the reset here
            return [enc_key, prefill_key, decode_key]
        p, c = plan.prompt_bucket, plan.cache_bucket
        extra = extra_inputs(model)
        cache = cache_for(model, state, batch, c, None)
        mask_dev = torch.ones(batch, c, dtype=torch.bool).to(device)
        rows = mrope_rows(model)
        pos = torch.arange(p, dtype=torch.long).expand(batch, p)
        ids = torch.zeros(batch, p, dtype=torch.long)
        sampling = warm_sampling(model, ids, variant, c + 1, 0)
        packed = torch.cat([ids, *[pos] * rows], dim=1).to(device)
        kind_variant = variant.with_features("mrope") if rows > 1 else variant
        prefill_key = (GraphKind("prefill", kind_variant), batch, p, c)
        decode_key = (GraphKind("decode", kind_variant), batch, c)
        set_length(cache, 0)
        run_graph(model, state, prefill_key, packed, mask_dev, cache, extra, sampling)
        set_decoding(cache, True)
        tokens = torch.zeros(batch, dtype=torch.long).to(device)
        step, _ = decode_input(tokens, torch.full((batch, rows), p - 1, dtype=torch.long).to(device))
        set_length(cache, p)
        run_graph(model, state, decode_key, step, mask_dev, cache, extra, sampling)
        reset_cache(cache)
        return [prefill_key, decode_key]


# The routes "cached" and "host_length" run this loop (the latter's cache layers report their length as a host
# number: its graphs are its own, the loop is the same).
register_loop(LoopSpec(CACHED, decode_loop, warm_plan))
register_loop(LoopSpec(HOST_LENGTH, decode_loop, warm_plan))
