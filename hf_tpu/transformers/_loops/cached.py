"""The decoding loop plugged into upstream ``generate`` as ``custom_generate``, and warm-up of one shape plan.

The loop pads the prompt on the left to its bucket, runs the prefill graph, then one decode graph per new token;
the growing tensors (sequence, mask, positions) stay on the host, each decode step sends one ``(batch, 2)`` tensor
(``(batch, 4)`` for a model numbering its positions in three rows: Qwen2-VL's) and reads back the next tokens: the
logits processors and the sampler run in the graph (:mod:`hf_tpu.transformers.sampling`), unless one of them has
no device form or the scores are wanted on the host (``output_scores``): then the last logits row comes back and
upstream's processors run on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hf_tpu.transformers import _step_outputs as step_outputs
from hf_tpu.transformers._cache.handoff import cached_length, copy_in, returned_cache
from hf_tpu.transformers._cache.layers import set_decoding, set_length
from hf_tpu.transformers._cache.pool import cache_for
from hf_tpu.transformers._graphs import ALIGNED, MROPE, PENALTY, run_graph  # noqa: F401  (PENALTY: re-exported)
from hf_tpu.transformers._images import features_shape, mrope_rows
from hf_tpu.transformers._notes import warn_once
from hf_tpu.transformers._pad_id import fill_id
from hf_tpu.transformers._settings import model_state
from hf_tpu.transformers._signatures import cache_name, output_cache_field
from hf_tpu.transformers._upstream import numbers_by_cache_length, prompt_first_inputs
from hf_tpu.transformers.shapes import ShapePlan, plan_shapes

__all__ = ["default_variant"]

# The running totals of the open generation.timed_host_steps() blocks: seconds spent getting each step's next tokens
# to the host (the copy back, and on the host path the processors and the sampler).
HOST_TIMERS: list[list[float]] = []

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


def output_vocab(model) -> int:
    embeddings = model.get_output_embeddings()
    if embeddings is not None and hasattr(embeddings, "weight"):
        return int(embeddings.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def _plan(model, logits_processor, input_ids, do_sample: bool, host_only: str | None):
    """The call's device sampling plan, or None for the host path (warned once per model class and reason, with
    its cost per step)."""
    from hf_tpu.transformers.sampling import device_plan, host_path_cost

    vocab = output_vocab(model)
    reason = host_only or device_plan(logits_processor, input_ids, vocab=vocab, do_sample=do_sample)
    if not isinstance(reason, str):
        return reason
    warn_once(
        f"host-path:{type(model).__name__}:{reason}",
        f"hf_tpu: {reason}, so {type(model).__name__}.generate keeps the logits processors and sampling on the host: "
        f"{host_path_cost(input_ids.shape[0], vocab)}.",
    )
    return None


class LoopCall:
    """What both loops (:func:`decode_loop`, and the one without a cache in :mod:`hf_tpu.transformers._loops.cacheless`)
    do around their graphs in one ``generate`` call: the sampling plan (on the device, or the host path), and each
    step's host side (the next tokens, the scores and logits kept, finished rows padded, the streamer fed, the
    stopping criteria asked)."""

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, plan):
        import torch

        self.streamer = (plan or {}).get("streamer", streamer)
        self.state = model_state(model)
        self.input_ids = input_ids.to("cpu")
        self.batch, self.prompt_len = self.input_ids.shape
        self.new_tokens = generation_config.max_length - self.prompt_len
        self.config = generation_config
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.pad_token = generation_config._pad_token_tensor
        # what a bucket's padding and a finished row's next input embed (the sequences keep the caller's pad id)
        self.fill_id = fill_id(model, self.pad_token, generation_config._eos_token_tensor)
        self.has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        self.do_sample = bool(generation_config.do_sample)
        want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        host_only = "output_scores/output_logits need the scores on the host" if want_scores or want_logits else None
        if not self.state.settings.device_sampling and (self.do_sample or len(logits_processor) > 0):
            host_only = "device sampling is off (configure(model, device_sampling=False))"
        self.sampler = _plan(model, logits_processor, self.input_ids, self.do_sample, host_only)
        self.host_path = self.sampler is None
        self.variant = "" if self.sampler is None else self.sampler.variant
        self.scores = () if want_scores else None
        self.raw_logits = () if want_logits else None
        self.unfinished = torch.ones(self.batch, dtype=torch.long)
        # output_attentions / output_hidden_states: the graphs' variant and model arguments, and what they return
        self.output_flags = step_outputs.asked(generation_config)
        self.variant += step_outputs.variant(self.output_flags)
        self.outputs = None
        if self.output_flags:
            self.outputs = step_outputs.StepOutputs(self.output_flags)

    def take(self, result: tuple, rows: slice, keys: slice) -> tuple:
        """A graph's ``(tokens, logits)``, keeping the attentions and hidden states it returned after them (cut to
        ``rows`` queries and ``keys`` key slots, upstream's shapes: :mod:`~hf_tpu.transformers._step_outputs`)."""
        if len(result) == 3:
            self.outputs.add(result[2], rows, keys)
            return result[:2]
        return result

    def sampling(self, device, width: int, offset: int):
        """The device state of the sampling plan (None on the host path)."""
        return None if self.host_path else self.sampler.to_device(device, width, offset)

    def run(self, tokens_dev, logits_dev, steps_left: int, step: Callable) -> None:
        """From the prefill's outputs: each step's host side, then ``step(next_tokens)`` (the next graph, which
        returns its outputs), until every row has stopped or ``steps_left`` more steps ran."""
        import torch

        while True:
            start = time.perf_counter() if HOST_TIMERS else None
            next_tokens, step_scores, step_logits = _select(
                self.logits_processor, self.input_ids, tokens_dev, logits_dev, self.do_sample, self.host_path
            )
            if start is not None:
                for total in HOST_TIMERS:
                    total[0] += time.perf_counter() - start
            if self.scores is not None:
                self.scores += (step_scores,)
            if self.raw_logits is not None:
                self.raw_logits += (step_logits,)
            fed = next_tokens
            if self.has_eos:
                fed = next_tokens * self.unfinished + self.fill_id * (1 - self.unfinished)
                next_tokens = next_tokens * self.unfinished + self.pad_token * (1 - self.unfinished)
            self.input_ids = torch.cat([self.input_ids, next_tokens[:, None]], dim=-1)
            if self.streamer is not None:
                self.streamer.put(next_tokens)
            self.unfinished = self.unfinished & ~self.stopping_criteria(self.input_ids, self.scores)
            if self.unfinished.max() == 0 or steps_left <= 0:
                break
            steps_left -= 1
            tokens_dev, logits_dev = step(fed)

    def output(self, seq2seq: bool = False, cache=None):
        """What upstream's ``generate`` returns for the call (``cache``: the transformers cache it returns)."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

        if self.streamer is not None:
            self.streamer.end()
        if not self.config.return_dict_in_generate:
            return self.input_ids
        cls = GenerateEncoderDecoderOutput if seq2seq else GenerateDecoderOnlyOutput
        fields = {output_cache_field(cls): cache} if cache is not None else {}
        if self.outputs is not None:
            fields.update(attentions=self.outputs.attentions, hidden_states=self.outputs.hidden_states)
        return cls(sequences=self.input_ids, scores=self.scores, logits=self.raw_logits, **fields)


def decode_loop(
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

    call = LoopCall(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, hf_tpu_plan)
    state, device, variant = call.state, model.device, call.variant
    batch, prompt_len, input_ids = call.batch, call.prompt_len, call.input_ids
    is_seq2seq = bool(model.config.is_encoder_decoder)

    if is_seq2seq:
        encoder_hidden = model_kwargs["encoder_outputs"].last_hidden_state
        enc_mask = model_kwargs.get("attention_mask")
        if enc_mask is None:
            enc_mask = torch.ones(encoder_hidden.shape[:2], dtype=torch.long)
        plan = plan_shapes(
            model, batch, prompt_len, call.new_tokens, encoder_len=encoder_hidden.shape[1], variant=variant
        )
        cache = cache_for(model, state, batch, plan.cache_bucket, encoder_hidden.shape[1])
        enc_mask_dev = enc_mask.to(device)
        sampling = call.sampling(device, plan.cache_bucket + 1, 0)
        prefill_key = ("seq2seq_prefill" + variant, batch, plan.encoder_bucket, prompt_len, plan.cache_bucket)
        decode_key = ("seq2seq_decode" + variant, batch, plan.encoder_bucket, plan.cache_bucket)
        set_length(cache, 0)
        first = run_graph(model, state, prefill_key, input_ids.to(device), encoder_hidden, enc_mask_dev, cache, sampling)
        set_decoding(cache, True)
        length = prompt_len

        def step(next_tokens):
            nonlocal length
            set_length(cache, length)
            length += 1
            ids = next_tokens[:, None].to(device)
            return run_graph(model, state, decode_key, ids, encoder_hidden, enc_mask_dev, cache, sampling)

        call.run(*first, plan.cache_bucket - prompt_len, step)
        returned = returned_cache(model, cache, 0, length) if generation_config.return_dict_in_generate else None
        return call.output(seq2seq=True, cache=returned)

    embeds = model_kwargs.get("inputs_embeds")  # the prompt as embeddings: input_ids holds the ids given, if any
    types = model_kwargs.get("token_type_ids")
    variant += "+token_type_ids" if types is not None else ""  # (graphs taking them: their own kind)
    variant += "+mrope" if mrope_rows(model) > 1 else ""  # (positions in rows, packed after the ids)
    ids_len = prompt_len
    if embeds is not None:
        prompt_len = embeds.shape[1]
    plan = plan_shapes(model, batch, prompt_len, call.new_tokens, variant=variant)
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(batch, prompt_len, dtype=torch.long)
    mask = mask.to("cpu")
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    rows = mrope_rows(model)
    if rows > 1:  # (rows, batch, prompt): upstream's rows (Qwen2-VL's: the text row first, for masks, then 3)
        positions = positions.to("cpu").long()
        positions = positions[-rows:] if positions.ndim == 3 else positions.expand(rows, batch, prompt_len)
    else:
        positions = positions.to("cpu").long().expand(batch, prompt_len)[None]
    pad = plan.prompt_bucket - prompt_len
    pad_id = call.fill_id
    extra = {**extra_inputs(model), **call.output_flags}
    if extra.get(ALIGNED) and (embeds is not None or types is not None):  # (its cache length found at a trace)
        from hf_tpu.transformers._settings import NotCompilableError

        error = NotCompilableError(prompt_first_inputs(model))
        error.reason = str(error)  # (error.loop None: this call's inputs, the route stays)
        raise error
    length = prompt_len if extra.get(ALIGNED) else plan.prompt_bucket  # the cache's length after the prefill
    if extra.get(ALIGNED):  # the prompt first, the bucket's padding after it (slot -1)
        ids = F.pad(input_ids, (0, pad), value=pad_id)
        pos = F.pad(torch.arange(prompt_len).expand(batch, prompt_len), (0, pad), value=-1)[None]
        full_mask = torch.cat([mask.bool(), torch.ones(batch, plan.cache_bucket - prompt_len, dtype=torch.bool)], 1)
        pad = 0
    else:
        ids = F.pad(input_ids, (pad, 0), value=pad_id)
        pos = F.pad(positions, (pad, 0), value=0)  # (rows, batch, bucket)
        full_mask = torch.cat(
            [
                F.pad(mask.bool(), (pad, 0), value=False),
                torch.ones(batch, plan.cache_bucket - plan.prompt_bucket, dtype=torch.bool),
            ],
            dim=1,
        )
    start = pad  # the prompt's first cache slot
    static_len = None
    if generation_config.cache_implementation == "static":  # upstream generates with a StaticCache this long
        static_len = generation_config.max_length - 1 + (prompt_len if prompt_len != ids_len else 0)
    if call.outputs is not None:
        call.outputs.key_width = static_len
    cache = cache_for(model, state, batch, plan.cache_bucket, None)
    mask_dev = full_mask.to(device)
    # the history of the sampling plan holds the sequence's ids: after the prompt's embeddings that have none
    sampling = call.sampling(device, plan.cache_bucket + 1, pad + prompt_len - ids_len)
    decode_extra = extra
    images = model_kwargs.get("mm_encoder_outputs")  # encoded by the vision graph (_images): the prefill merges them
    if types is not None:  # upstream repeats the prompt's last token type for every new token
        types = types.to("cpu").long()
        extra = {**extra, "token_type_ids": F.pad(types, (pad, 0), value=0).to(device)}
        if not images:  # (with images they mark image tokens for the prefill's mask: Gemma 3 and PaliGemma pass
            # them to the first forward only)
            decode_extra = {**decode_extra, "token_type_ids": types[:, -1:].to(device)}
    kind = "prefill" if embeds is None else "embeds_prefill"
    prefill_key = (kind + variant, batch, plan.prompt_bucket, plan.cache_bucket)
    if images:
        extra = {**extra, "mm_encoder_outputs": images}
        prefill_key = ("mm_prefill" + variant, batch, plan.prompt_bucket, plan.cache_bucket, features_shape(images))
    decode_key = ("decode" + variant, batch, plan.cache_bucket)
    set_length(cache, 0)
    given = model_kwargs.get(cache_name())  # the caller's cache (upstream's empty one when none was given)
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
            packed_step = torch.cat([input_ids[:, index, None], positions[..., index].T], dim=1).to(device)
            first = run_graph(model, state, decode_key, packed_step, mask_dev, cache, decode_extra, sampling)
            first = call.take(first, slice(0, 1), slice(start, pad + index + 1))
        if call.outputs is not None:  # upstream runs the uncached tokens in one forward
            call.outputs.merge(prompt_len - seen)
    elif embeds is None:
        packed = torch.cat([ids, *pos], dim=1).to(device)
        first = run_graph(model, state, prefill_key, packed, mask_dev, cache, extra, sampling)
    else:  # moved to the device like input_ids, wherever the caller left them; the padding: zero rows, masked out
        padded = F.pad(embeds.to(device=device, dtype=model.dtype), (0, 0, pad, 0))
        pos = pos if rows > 1 else pos[0]
        first = run_graph(model, state, prefill_key, padded, pos.to(device), mask_dev, cache, extra, sampling)
    if not seen:
        first = call.take(first, slice(pad, pad + prompt_len), slice(start, start + prompt_len))
    set_decoding(cache, True)
    positions = positions[..., -1].T  # (batch, rows): each row goes on by one per token, as upstream's loop does

    def step(next_tokens):
        nonlocal length, positions
        set_length(cache, length)
        length += 1
        positions = positions + 1
        packed_step = torch.cat([next_tokens[:, None], positions], dim=1).to(device)  # (batch, 1 + rows)
        result = run_graph(model, state, decode_key, packed_step, mask_dev, cache, decode_extra, sampling)
        return call.take(result, slice(0, 1), slice(start, length))

    call.run(*first, plan.cache_bucket - plan.prompt_bucket, step)
    returned = None
    if generation_config.return_dict_in_generate:
        returned = returned_cache(model, cache, start, length, static_len)
    return call.output(cache=returned)


def extra_inputs(model) -> dict:
    """The prefill/decode graphs' extra model arguments: ``logits_to_keep`` where the model takes it, and the flag of
    a model whose prompt goes first (:data:`hf_tpu.transformers._graphs.ALIGNED`)."""
    extra: dict = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
    if mrope_rows(model) > 1:  # its positions in rows, packed after the ids
        extra[MROPE] = mrope_rows(model)
    # a cache reporting its host length goes prompt-first too: the length it reports is the real token count
    if numbers_by_cache_length(model) or model_state(model).host_length:
        extra[ALIGNED] = True
    return extra


def _default_plan(model, input_ids, **generate_kwargs):
    """The device plan (or the host-path reason) of a call with the model's own ``generation_config`` (updated by
    ``generate_kwargs``, as a call's keyword arguments update it), built from the processors upstream's
    ``generate`` would build for it."""
    from transformers.generation.logits_process import LogitsProcessorList

    from hf_tpu.transformers.sampling import device_plan

    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    # As upstream's generate does before building the processors: min_new_tokens also sets min_length (prompt +
    # min_new_tokens), which adds a MinLengthLogitsProcessor, so the call runs "+min_length+min_new_tokens".
    model._prepare_generated_length(
        config, has_default_max_length=True, has_default_min_length=True, model_input_name="input_ids",
        input_ids_length=input_ids.shape[1], inputs_tensor=input_ids,
    )  # fmt: skip
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
    )  # fmt: skip
    return device_plan(processors, input_ids, vocab=output_vocab(model), do_sample=bool(config.do_sample))


def host_sampling(model, **generate_kwargs) -> str | None:
    """Why a call with ``generate_kwargs`` keeps its logits processors and sampling on the host (one logits row
    back per step), None when they run in the graph: what :class:`LoopCall` finds, without a call."""
    import torch

    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    if config.return_dict_in_generate and (config.output_scores or config.output_logits):
        return "output_scores/output_logits need the scores on the host"
    ids = generate_kwargs.pop("input_ids", None)
    ids = torch.zeros(1, 1, dtype=torch.long) if ids is None else ids.to("cpu")
    plan = _default_plan(model, ids, **{k: v for k, v in generate_kwargs.items() if not hasattr(v, "device")})
    if not model_state(model).settings.device_sampling and (config.do_sample or not isinstance(plan, str) and plan.variant):
        return "device sampling is off (configure(model, device_sampling=False))"
    return plan if isinstance(plan, str) else None


def default_variant(model) -> str:
    """The graph variant the model's own ``generation_config`` leads to (``"+temperature+top_k+top_p+sample"`` for
    Qwen3's, ``"+repetition_penalty"`` for greedy search with a repetition penalty, ``""`` for plain greedy search
    or the host path); :func:`hf_tpu.warmup` compiles that one."""
    import torch

    plan = _default_plan(model, torch.zeros(1, 1, dtype=torch.long))
    return "" if isinstance(plan, str) else plan.variant


def warm_sampling(model, ids, variant: str, width: int, offset: int):
    """Dummy device sampling state for warming ``variant`` (the model's default one) on prompt ``ids``."""
    if not variant:
        return None
    plan = _default_plan(model, ids)
    if isinstance(plan, str) or plan.variant != variant:
        found = plan if isinstance(plan, str) else plan.variant
        raise ValueError(
            f"warm-up can compile the variant of the model's own generation_config only; asked for {variant!r}, "
            f"the generation_config leads to {found!r}"
        )
    return plan.to_device(model.device, width, offset)


def warm_plan(model, plan: ShapePlan, variant: str = "") -> list[tuple]:
    """Compile (or find compiled) every graph a call with ``plan`` runs, on dummy inputs; returns their keys."""
    import torch

    state = model_state(model)
    device = model.device
    batch = plan.batch
    with torch.no_grad():
        if plan.encoder_bucket is not None:
            enc_key = ("encoder", batch, plan.encoder_bucket)
            ids = torch.zeros(batch, plan.encoder_bucket, dtype=torch.long)
            mask = torch.ones(batch, plan.encoder_bucket, dtype=torch.long)
            mask_dev = mask.to(device)
            hidden = run_graph(model, state, enc_key, ids.to(device), mask_dev)
            start = model.generation_config.decoder_start_token_id
            start = 0 if start is None else int(start)
            cache = cache_for(model, state, batch, plan.cache_bucket, plan.encoder_bucket)
            prefill_key = ("seq2seq_prefill" + variant, batch, plan.encoder_bucket, plan.prompt_len, plan.cache_bucket)
            decode_key = ("seq2seq_decode" + variant, batch, plan.encoder_bucket, plan.cache_bucket)
            step = torch.full((batch, plan.prompt_len), start, dtype=torch.long)
            sampling = warm_sampling(model, step, variant, plan.cache_bucket + 1, 0)
            set_length(cache, 0)
            run_graph(model, state, prefill_key, step.to(device), hidden, mask_dev, cache, sampling)
            set_decoding(cache, True)
            step = torch.full((batch, 1), start, dtype=torch.long).to(device)
            set_length(cache, plan.prompt_len)
            run_graph(model, state, decode_key, step, hidden, mask_dev, cache, sampling)
            cache.reset()  # the next call resets it too: meet the eager ops of the reset here
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
        kind_variant = variant + ("+mrope" if rows > 1 else "")
        prefill_key = ("prefill" + kind_variant, batch, p, c)
        decode_key = ("decode" + kind_variant, batch, c)
        set_length(cache, 0)
        run_graph(model, state, prefill_key, packed, mask_dev, cache, extra, sampling)
        set_decoding(cache, True)
        step = torch.tensor([[0, *[p] * rows]], dtype=torch.long).expand(batch, 1 + rows).contiguous().to(device)
        set_length(cache, p)
        run_graph(model, state, decode_key, step, mask_dev, cache, extra, sampling)
        cache.reset()
        return [prefill_key, decode_key]