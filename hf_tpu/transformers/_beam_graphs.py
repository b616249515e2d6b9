"""The graph bodies of beam search (``num_beams > 1``, ``do_sample`` False or True) on the bucketed static cache.

Two graph kinds, registered in :mod:`hf_tpu.transformers._graphs`: ``beam_prefill`` (the prompt, expanded to
``batch * num_beams`` rows as upstream's ``_expand_inputs_for_generation`` does, then the first beam step) and
``beam_decode`` (one token per running beam, then a beam step). A beam step is upstream's own ``_beam_search``
iteration, run in the graph on the device state of :mod:`hf_tpu.transformers._loops.beam`: log-softmax, the logits
processors' device forms (:mod:`hf_tpu.transformers.sampling`), upstream's ``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams``, ``_check_early_stop_heuristic`` and
``_beam_search_has_unfinished_sequences`` (called, not copied), the stopping criteria's device forms (max length,
end of sequence), then the cache and the processors' state reordered by beam index (``index_select`` in place).

Upstream's helpers index the sequence buffers with a Python ``cur_len`` and divide by ``length ** length_penalty``
with Python numbers: as graph constants these would compile a new graph per step. Here the sequence and beam-index
buffers hold the generated tokens only, shifted left by one column at every step, so the helpers always write the
last column (a constant ``cur_len``); and the length penalty's divisors come from tables the loop builds on the host
once per call (upstream's own Python arithmetic, ``(length) ** length_penalty``), read at the step's index on the
device, the scores divided before the helpers see them and the helpers handed ``length_penalty=0.0`` (so their own
division is by ``1.0``). The results are upstream's to the bit on the CPU.

Beam sampling draws ``beams_to_keep`` continuations without replacement in proportion to their probabilities, as
upstream's ``torch.multinomial(..., replacement=False)`` does, by the Gumbel-top-k race (the top ``k`` of the
scores plus Gumbel noise from the device generator); the rest of that step is upstream's helper's, mirrored in
:func:`_sampled_continuations` (the helper's sampling branch calls ``torch.multinomial``, which has no graph form).
"""

from __future__ import annotations

from typing import Any

from hf_tpu.transformers._step_outputs import with_outputs

__all__: list[str] = []

# The static description of a beam call a graph is traced for (all part of its key's kind):
# (batch, num_beams, beams_to_keep, early_stopping, do_sample, number of eos ids, generated-token columns)
Spec = tuple


def _forward(model, ids, positions, mask, cache, extra):
    """The forward's outputs (with the attentions and hidden states ``extra`` asks for)."""
    from hf_tpu.transformers._upstream import cache_name

    return model(
        input_ids=ids, position_ids=positions, attention_mask=mask, **{cache_name(): cache}, use_cache=True,
        return_dict=True, **extra,
    )  # fmt: skip


def beam_prefill_body(model, packed, mask, cache, extra, spec: Spec, beam: dict, sampling=None):
    """The prompt (``packed``: ids then positions, left-padded to the prompt bucket) through the model, then the
    first beam step."""
    from hf_tpu.transformers._cache.masks import prefill_mask

    q = packed.shape[1] // 2
    out = _forward(model, packed[:, :q], packed[:, q:], prefill_mask(cache, mask, q), cache, extra)
    return with_outputs(_beam_step(model, out.logits[:, -1, :].float(), cache, spec, beam, sampling), out, extra)


def beam_decode_body(model, mask, cache, extra, spec: Spec, beam: dict, sampling=None):
    """The running beams' last tokens through the model (their positions: the prompt's last plus the tokens
    generated), then a beam step. Nothing comes from the host."""
    from hf_tpu.transformers._cache.masks import decode_mask
    from hf_tpu.transformers.sampling import advance

    batch, num_beams = spec[0], spec[1]
    tokens = beam["seqs"][:, :, -1].reshape(batch * num_beams, 1)
    positions = (beam["last_position"] + beam["generated"])[:, None]
    advance(sampling, tokens)
    out = _forward(model, tokens, positions, decode_mask(cache, mask), cache, extra)
    return with_outputs(_beam_step(model, out.logits[:, -1, :].float(), cache, spec, beam, sampling), out, extra)


def beam_cacheless_prefill_body(model, ids, mask, positions, extra, spec: Spec, beam: dict, sampling=None):
    """Without a cache (hf_tpu.transformers._loops.cacheless's layout: the ids in a buffer as long as the bucket, the
    prompt first): the model over the buffer, the logits at the prompt's last slot, then the first beam step; the buffer's
    rows follow the running beams."""
    out, logits = _cacheless_forward(model, ids, beam["slot"], mask, positions, extra)
    return with_outputs(_beam_step(model, logits, None, spec, beam, sampling, (ids,)), out, extra)


def beam_cacheless_decode_body(model, ids, mask, positions, extra, spec: Spec, beam: dict, sampling=None):
    """Without a cache: the running beams' last tokens written into the buffer at the next slot, the model over the
    buffer, the logits at that slot, then a beam step."""
    from hf_tpu.transformers.sampling import advance

    batch, num_beams = spec[0], spec[1]
    tokens = beam["seqs"][:, :, -1].reshape(batch * num_beams, 1)
    slot = beam["slot"] + beam["generated"]
    ids.index_copy_(1, slot, tokens)
    advance(sampling, tokens)
    out, logits = _cacheless_forward(model, ids, slot, mask, positions, extra)
    return with_outputs(_beam_step(model, logits, None, spec, beam, sampling, (ids,)), out, extra)


def _cacheless_forward(model, ids, slot, mask, positions, extra):
    kwargs = dict(extra)
    if positions is not None:
        kwargs["position_ids"] = positions
    if model._supports_logits_to_keep():
        kwargs["logits_to_keep"] = slot  # a tensor of indices: the logits of that slot only
    out = model(input_ids=ids, attention_mask=mask, return_dict=True, **kwargs)
    logits = out.logits if "logits_to_keep" in kwargs else out.logits.index_select(1, slot)
    return out, logits[:, -1, :].float()


def _shift(buffer, fill):
    """``buffer`` one column to the left, ``fill`` (an int, or a ``(1,)`` tensor: a value of the call) in its last
    column (the column this step writes)."""
    import torch

    if isinstance(fill, int):
        last = torch.full_like(buffer[..., :1], fill)
    else:
        last = fill.to(buffer.dtype).expand(*buffer.shape[:-1], 1)
    return torch.cat([buffer[..., 1:], last], dim=-1)


def _beam_step(model, logits, cache, spec: Spec, beam: dict, sampling, buffers: tuple = ()) -> tuple[Any, Any, Any]:
    """One iteration of upstream's ``_beam_search`` after its forward, on the device state ``beam`` (updated in
    place); ``cache`` (None without one) and ``buffers`` (per-row tensors) follow the running beams. Returns ``(finished, scores, logits)``: whether the whole search stopped (``(1,)`` bool, the one value
    the host reads per step), the processed log-probabilities and the raw logits (copied back only when asked)."""
    import torch
    from transformers.generation.utils import GenerationMixin as G

    from hf_tpu.transformers.sampling import process

    batch, num_beams, keep, early_stopping, do_sample, n_eos, width = spec
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    if sampling is not None:
        log_probs = process(log_probs, sampling)
    scores = log_probs
    log_probs = G._unflatten_beam_dim(log_probs, batch, num_beams) + beam["running_scores"][:, :, None]
    log_probs = torch.reshape(log_probs, (batch, -1))

    fill = beam["fill"]
    running_sequences = _shift(beam["seqs"], fill)
    running_beam_indices = _shift(beam["running_indices"], -1)
    cur_len, prompt_len = width - 1, 0  # the column every step writes (after the shift)
    if do_sample:
        topk_log_probs, topk_sequences, topk_indices = _sampled_continuations(
            model, log_probs, running_sequences, running_beam_indices, cur_len, keep, num_beams, batch
        )
    else:
        topk_log_probs, topk_sequences, topk_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=running_sequences,
            running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=prompt_len,
            do_sample=False, beams_to_keep=keep, num_beams=num_beams, batch_size=batch,
        )  # fmt: skip

    # the stopping criteria's device forms: MaxLengthCriteria and EosTokenCriteria on each continuation
    generated = beam["generated"]  # tokens generated before this step, (1,)
    hits = (generated + 1 >= beam["max_new_tokens"]).expand(batch, keep)
    if n_eos:
        last = topk_sequences[:, :, -1]
        hits = hits | (last[:, :, None] == beam["eos"][None, None, :]).any(dim=-1)

    running_sequences, running_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
        topk_log_probs=topk_log_probs, topk_running_sequences=topk_sequences,
        topk_running_beam_indices=topk_indices, next_token_hits_stopping_criteria=hits, num_beams=num_beams,
    )  # fmt: skip
    top_num_beam_mask = torch.arange(keep, device=logits.device) < num_beams  # (built on the device: no copy)
    # the length penalty of a hypothesis ending here: upstream's (cur_len + 1 - prompt_len) ** length_penalty, from
    # the host's table (its helper then divides by (...) ** 0.0 == 1.0)
    penalty = beam["finish_divisors"].index_select(0, generated)
    sequences, beam_scores, beam_indices, finished = model._update_finished_beams(
        sequences=_shift(beam["sequences"], fill),
        topk_running_sequences=topk_sequences, beam_scores=beam["beam_scores"],
        topk_log_probs=topk_log_probs / penalty, beam_indices=_shift(beam["beam_indices"], -1),
        topk_running_beam_indices=topk_indices,
        is_early_stop_heuristic_unsatisfied=beam["improvable"], is_sent_finished=beam["finished"],
        next_token_hits_stopping_criteria=hits, top_num_beam_mask=top_num_beam_mask, num_beams=num_beams,
        cur_len=cur_len, decoder_prompt_len=prompt_len, length_penalty=0.0, early_stopping=early_stopping,
    )  # fmt: skip

    # the cache and the processors' state follow the running beams
    beam_idx = G._flatten_beam_dim(running_beam_indices[..., -1]).long()
    if cache is not None:
        _reorder_cache(cache, beam_idx)
    for buffer in buffers:
        buffer.copy_(buffer.index_select(0, beam_idx))
    if sampling is not None:
        _reorder_sampling(sampling, beam_idx)

    improvable = model._check_early_stop_heuristic(
        is_early_stop_heuristic_unsatisfied=beam["improvable"],
        running_beam_scores=running_scores / beam["running_divisors"].index_select(0, generated),
        beam_scores=beam_scores, is_sent_finished=finished, cur_len=width, max_length=width,
        decoder_prompt_len=prompt_len, early_stopping=early_stopping, length_penalty=0.0,
    )  # fmt: skip
    going = model._beam_search_has_unfinished_sequences(improvable, finished, hits, early_stopping)

    beam["seqs"].copy_(running_sequences)
    beam["running_scores"].copy_(running_scores)
    beam["running_indices"].copy_(running_beam_indices)
    beam["sequences"].copy_(sequences)
    beam["beam_scores"].copy_(beam_scores)
    beam["beam_indices"].copy_(beam_indices)
    beam["finished"].copy_(finished)
    beam["improvable"].copy_(improvable)
    generated.add_(1)
    return (~going).reshape(1), scores, logits


def _sampled_continuations(model, log_probs, running_sequences, running_beam_indices, cur_len, keep, num_beams, batch):
    """Upstream's ``_get_top_k_continuations`` with ``do_sample=True``, its ``torch.multinomial(softmax(scores),
    keep)`` (without replacement) drawn as a Gumbel-top-k race from the device generator: the same law."""
    import torch

    uniform = torch.rand_like(log_probs).clamp(min=torch.finfo(log_probs.dtype).tiny, max=1.0 - 1e-7)
    gumbel = -torch.log(-torch.log(uniform))
    topk_indices = torch.topk(log_probs + gumbel, k=keep).indices
    # from here on, upstream's helper line for line
    topk_log_probs = torch.gather(input=log_probs, dim=1, index=topk_indices)
    topk_log_probs, order = topk_log_probs.sort(dim=-1, descending=True)
    topk_indices = topk_indices.gather(dim=-1, index=order)
    vocab_size = log_probs.shape[-1] // num_beams
    topk_current_beam_indices = topk_indices // vocab_size
    topk_running_beam_indices = model._gather_beams(running_beam_indices, topk_current_beam_indices)
    topk_running_sequences = model._gather_beams(running_sequences, topk_current_beam_indices)
    topk_ids = topk_indices % vocab_size
    topk_running_sequences[:, :, cur_len] = topk_ids
    batch_offset = torch.arange(batch, device=topk_ids.device).view(-1, 1) * num_beams
    topk_running_beam_indices[:, :, cur_len] = topk_current_beam_indices + batch_offset
    return topk_log_probs, topk_running_sequences, topk_running_beam_indices


def _reorder_cache(cache, beam_idx) -> None:
    """Every layer's keys and values gathered by ``beam_idx`` along the batch, in place (upstream's
    ``Cache.reorder_cache`` assigns new tensors, which a graph cannot hand back to the loop's cache)."""
    self_cache = getattr(cache, "self_attention_cache", cache)
    for layer in self_cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None:
                tensor.copy_(tensor.index_select(0, beam_idx))


def _reorder_sampling(sampling, beam_idx) -> None:
    """The per-row state of the device sampling plan (the sequence history, the state of forms that keep one:
    the repetition penalty's tokens seen) gathered by ``beam_idx``, in place."""
    from hf_tpu.transformers.sampling import forms

    (program, _), _state, _params, history, tensors = sampling
    if history is not None:
        history.copy_(history.index_select(0, beam_idx))
    registry = forms()
    for name, _static, _s0, _ns, t0, nt in program:
        if registry[name].advance is not None:
            for tensor in tensors[t0 : t0 + nt]:
                tensor.copy_(tensor.index_select(0, beam_idx))
