"""What every hf_tpu loop does around its graphs in one ``generate`` call, written once: :func:`loop`.

The cached loop (:mod:`.cached`) and the loop without a cache (:mod:`.cacheless`) share their shape; each is
``loop(its_steps)`` and supplies in ``its_steps(call, model, model_kwargs)`` only what differs, its inputs' layout
and its two graphs. A call then runs:

1. ``call = LoopCall(...)``: the call's sampling plan (the logits processors and the sampler in the graph, or the host
   path, warned once with its cost per step) and the graph variant it leads to, the outputs asked
   (``output_attentions`` / ``output_hidden_states``), the sequences kept on the host;
2. the loop's steps: its layout and its prefill graph (through :func:`hf_tpu.transformers._graphs.run_graph`), whose
   outputs :meth:`LoopCall.take` keeps, returned as :class:`Steps` with its decode step;
3. :meth:`LoopCall.run`: each step's host side (the next tokens back, scores and logits kept, finished rows padded,
   the streamer fed, the stopping criteria asked), then the loop's ``step(next_tokens)``, its decode graph;
4. :meth:`LoopCall.output`: what upstream's ``generate`` returns (with the cache the loop hands back, if any).

Also here: the sampling plan a call with the model's own ``generation_config`` leads to (:func:`default_variant`,
:func:`host_sampling`, :func:`warm_sampling`), which warm-up and :func:`hf_tpu.transformers.explain` ask without a
call. Beam search (:mod:`.beam`) keeps its search state on the device and has a host side of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers._graph_key import NO_VARIANT, Variant
from hf_tpu.transformers._loops import readback
from hf_tpu.transformers._notes import warn_once
from hf_tpu.transformers._settings import model_state
from hf_tpu.transformers._signatures import output_cache_field
from hf_tpu.transformers.shapes import fill_id

__all__ = ["default_variant"]

# The running totals of the open generation.timed_host_steps() blocks: seconds spent getting each step's next tokens
# to the host (the copy back, and on the host path the processors and the sampler).
HOST_TIMERS: list[list[float]] = []


def _add_time(start: float | None) -> None:
    if start is not None:
        for total in HOST_TIMERS:
            total[0] += time.perf_counter() - start


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


def sampling_plan(model, config, logits_processor, input_ids):
    """The sampling plan of a call with generation config ``config`` and processors ``logits_processor``: a
    :class:`~hf_tpu.transformers.sampling.DevicePlan` (the processors and the sampler run in the graph), None for
    plain greedy search (no processor, no sampler: the graph's argmax, :mod:`hf_tpu.transformers.sampling` not
    asked), or why they
    run on the host, as text: device sampling is off (``configure(model, device_sampling=False)``) and the call samples
    or has processors; the scores or logits are wanted on the host (``output_scores``/``output_logits``); or a
    processor has no device form. The one decision, for a call (:class:`LoopCall`) and without one
    (:func:`host_sampling`, which :func:`hf_tpu.transformers.explain` asks)."""
    do_sample = bool(config.do_sample)
    if not model_state(model).settings.device_sampling and (do_sample or len(logits_processor) > 0):
        return "device sampling is off (configure(model, device_sampling=False))"
    if config.return_dict_in_generate and (config.output_scores or config.output_logits):
        return "output_scores/output_logits need the scores on the host"
    if not do_sample and len(logits_processor) == 0:
        return None  # plain greedy search: the graph's argmax, no sampling program
    from hf_tpu.transformers.sampling import device_plan

    return device_plan(logits_processor, input_ids, vocab=output_vocab(model), do_sample=do_sample)


def _plan(model, config, logits_processor, input_ids):
    """The call's device sampling plan (None: plain greedy search), or the reason it takes the host path, as text
    (warned once per model class and reason, with its cost per step)."""
    reason = sampling_plan(model, config, logits_processor, input_ids)
    if not isinstance(reason, str):
        return reason
    from hf_tpu.transformers.sampling import host_path_cost

    warn_once(
        f"host-path:{type(model).__name__}:{reason}",
        f"hf_tpu: {reason}, so {type(model).__name__}.generate keeps the logits processors and sampling on the host: "
        f"{host_path_cost(input_ids.shape[0], output_vocab(model))}.",
    )
    return reason


# Why a call whose sampling plan takes the host path reads its tokens back each step (:mod:`.readback`).
HOST_PATH_READ_BACK = "the logits processors and sampling run on the host, so each step's logits come back"


def read_back(route, host_path: bool, every: int) -> str | None:
    """Why a call on ``route`` reads its new tokens back each decode step (None: every ``every`` steps): the reason
    its route says (:attr:`~hf_tpu.transformers._settings.Route.read_back`, decided with it), else the host path of
    its sampling plan (each step's logits come back)."""
    return HOST_PATH_READ_BACK if host_path and every > 1 else route.read_back


class LoopCall:
    """What both loops (:func:`~hf_tpu.transformers._loops.cached.decode_loop`, and the one without a cache in
    :mod:`hf_tpu.transformers._loops.cacheless`) do around their graphs in one ``generate`` call: the sampling plan (on the device, or the host path), and each
    step's host side (the next tokens, the scores and logits kept, finished rows padded, the streamer fed, the
    stopping criteria asked)."""

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, plan):
        import torch

        self.streamer = plan.get("streamer", streamer)
        self.route = plan["route"]  # (its layout and read-back reason, decided by hf_tpu.transformers.route)
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
        plan = _plan(model, generation_config, logits_processor, self.input_ids)
        self.host_path = isinstance(plan, str)
        self.sampler = None if self.host_path else plan  # (None: plain greedy search or the host path)
        self.variant = NO_VARIANT if self.sampler is None else self.sampler.variant
        self.scores = () if want_scores else None
        self.raw_logits = () if want_logits else None
        self.unfinished = torch.ones(self.batch, dtype=torch.long)
        # output_attentions / output_hidden_states (the route's layout): the graphs' variant and model arguments,
        # and what they return
        outputs = self.route.layout.outputs
        self.output_flags = {f"output_{name}": True for name in outputs}
        self.outputs = None
        if outputs:
            from hf_tpu.transformers._step_outputs import StepOutputs

            self.variant = self.variant.with_features(*outputs)
            self.outputs = StepOutputs(self.output_flags)
        # how often the new tokens come back (readback): every `every` decode steps, or each step for a reason
        every = self.state.settings.read_back_every
        reason = read_back(self.route, self.host_path, every)
        self.every = 1 if reason else every
        self.record = readback.ReadBacks(self.every, reason)

    def take(self, result: tuple, rows: slice, keys: slice) -> tuple:
        """A graph's ``(tokens, logits)``, keeping the attentions and hidden states it returned after them (cut to
        ``rows`` queries and ``keys`` key slots, upstream's shapes: :mod:`~hf_tpu.transformers._step_outputs`)."""
        if len(result) == 3:
            self.outputs.add(result[2], rows, keys)
            return result[:2]
        return result

    def sampling(self, device, width: int, offset: int):
        """The device state of the sampling plan (None on the host path and for plain greedy search)."""
        return None if self.sampler is None else self.sampler.to_device(device, width, offset)

    def run(self, tokens_dev, logits_dev, steps_left: int, step: Callable) -> None:
        """From the prefill's outputs: each step's host side, then ``step(next_tokens)`` (the next graph, which
        returns its outputs), until every row has stopped or ``steps_left`` more steps ran. The tokens come back
        every :attr:`every` steps (:mod:`.readback`), or each step."""
        for records in readback.RECORDS:
            records.append(self.record)
        if self.every > 1:
            self._run_chunked(tokens_dev, steps_left, step)
            return
        while True:
            start = time.perf_counter() if HOST_TIMERS else None
            next_tokens, step_scores, step_logits = _select(
                self.logits_processor, self.input_ids, tokens_dev, logits_dev, self.do_sample, self.host_path
            )
            _add_time(start)
            self.record.read_backs += 1
            fed = self._take(next_tokens, step_scores, step_logits)
            if self.unfinished.max() == 0 or steps_left <= 0:
                break
            steps_left -= 1
            self.record.decode_steps += 1
            tokens_dev, logits_dev = step(fed)

    def _take(self, next_tokens, step_scores=None, step_logits=None):
        """One new token per row on the host, as upstream's ``_sample`` takes it (scores and logits kept, a finished
        row padded, the streamer fed, the stopping criteria asked); returns what the next step is fed."""
        import torch

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
        return fed

    def _run_chunked(self, tokens_dev, steps_left: int, step: Callable) -> None:
        """:meth:`run` with the tokens kept on the device: up to :attr:`every` steps dispatched back to back, one
        read-back, then the host side of each token read, cut at the first where every row has stopped."""
        record = self.record
        pad = None if self.pad_token is None else int(self.pad_token)
        eos = readback.eos_ids(self.stopping_criteria) if self.has_eos else None
        rows = readback.DeviceRows(tokens_dev.device, self.batch, self.every, pad, self.fill_id, eos)
        rows.add(tokens_dev)
        size = 1 if self.streamer is not None else self._chunk()  # (a streamer gets the first token at once)
        while True:
            while len(rows.kept) < size and steps_left > 0:
                steps_left -= 1
                record.decode_steps += 1
                tokens_dev, _ = step(rows.fed)
                rows.add(tokens_dev)
            start = time.perf_counter() if HOST_TIMERS else None
            block = rows.read()
            _add_time(start)
            record.read_backs += 1
            for index, next_tokens in enumerate(block):
                self._take(next_tokens)
                if self.unfinished.max() == 0 or (steps_left <= 0 and index == len(block) - 1):
                    record.extra_steps = len(block) - 1 - index
                    return
            rows.sync(self.unfinished)
            size = self._chunk()
            steps_left -= 1
            record.decode_steps += 1
            tokens_dev, _ = step(rows.fed)
            rows.add(tokens_dev)

    def _chunk(self) -> int:
        """The tokens the next read-back holds: :attr:`every`, fewer where ``max_length`` ends the call sooner."""
        left = self.new_tokens - (self.input_ids.shape[1] - self.prompt_len)
        return max(1, min(self.every, left))

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


@dataclass
class Steps:
    """What a loop hands the skeleton after its prefill graph ran (see :func:`loop`)."""

    first: tuple  # the prefill graph's (next tokens, logits), as :meth:`LoopCall.take` kept them
    left: int  # the decode steps the call's shape has room for after the prefill
    step: Callable  # next tokens -> the decode graph's (next tokens, logits), as LoopCall.take kept them
    returned: Callable[[], Any] | None = None  # the cache the call returns (asked with return_dict_in_generate only)
    seq2seq: bool = False  # the output class: upstream's encoder-decoder one


def loop(steps: Callable[[LoopCall, Any, dict], Steps]) -> Callable:
    """A loop's ``custom_generate`` callable, from its own part ``steps(call, model, model_kwargs)`` (its layout, its
    prefill graph and its decode step): the :class:`LoopCall` of the call, the steps' host side until every row has
    stopped, and upstream's output, written once for every loop built on it."""

    def custom_generate(
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
        call = LoopCall(
            model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, hf_tpu_plan
        )
        found = steps(call, model, model_kwargs)
        call.run(*found.first, found.left, found.step)
        returned = None
        if found.returned is not None and generation_config.return_dict_in_generate:
            returned = found.returned()
        return call.output(seq2seq=found.seq2seq, cache=returned)

    custom_generate.__doc__ = f"``custom_generate`` callable of hf_tpu's loop on :func:`{steps.__name__}`."
    return custom_generate


def _default_processors(model, input_ids, **generate_kwargs):
    """The generation config of a call with the model's own ``generation_config`` (updated by ``generate_kwargs``, as
    a call's keyword arguments update it) and the processors upstream's ``generate`` would build for it."""
    from transformers.generation.logits_process import LogitsProcessorList

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
    return config, processors


def _default_plan(model, input_ids, **generate_kwargs):
    """The device plan (or the host-path reason) of the processors of a call with the model's own
    ``generation_config`` updated by ``generate_kwargs`` (:func:`_default_processors`)."""
    from hf_tpu.transformers.sampling import device_plan

    config, processors = _default_processors(model, input_ids, **generate_kwargs)
    return device_plan(processors, input_ids, vocab=output_vocab(model), do_sample=bool(config.do_sample))


def host_sampling(model, **generate_kwargs) -> str | None:
    """Why a call with ``generate_kwargs`` keeps its logits processors and sampling on the host (one logits row
    back per step), None when they run in the graph: what :class:`LoopCall` finds (:func:`sampling_plan`), without
    a call."""
    import torch

    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    ids = generate_kwargs.pop("input_ids", None)
    ids = torch.zeros(1, 1, dtype=torch.long) if ids is None else ids.to("cpu")
    fields = {k: v for k, v in generate_kwargs.items() if not hasattr(v, "device")}
    _, processors = _default_processors(model, ids, **fields)
    plan = sampling_plan(model, config, processors, ids)
    return plan if isinstance(plan, str) else None


def own_variant(model) -> Variant:
    """The graph variant the model's own ``generation_config`` leads to (its sampling program; none for plain greedy
    search or the host path); :func:`hf_tpu.warmup` compiles that one."""
    import torch

    plan = _default_plan(model, torch.zeros(1, 1, dtype=torch.long))
    return Variant() if isinstance(plan, str) else plan.variant


def default_variant(model) -> str:
    """The graph variant the model's own ``generation_config`` leads to, as the text its graphs' kinds end with
    (``"+temperature+top_k+top_p+sample"`` for Qwen3's, ``"+repetition_penalty"`` for greedy search with a
    repetition penalty, ``""`` for plain greedy search or the host path); :func:`hf_tpu.warmup` compiles that one.

    Example:
        >>> default_variant(model)                                      # doctest: +SKIP
        '+temperature+top_k+top_p+sample'
    """
    return str(own_variant(model))


def warm_sampling(model, ids, variant: Variant, width: int, offset: int):
    """Dummy device sampling state for warming ``variant`` (the model's default one) on prompt ``ids``."""
    if not variant:
        return None
    plan = _default_plan(model, ids)
    if isinstance(plan, str) or plan.variant != variant:
        found = plan if isinstance(plan, str) else plan.variant
        raise InvalidArgumentError(
            f"warm-up can compile the variant of the model's own generation_config only; asked for {str(variant)!r}, "
            f"the generation_config leads to {str(found)!r}"
        )
    return plan.to_device(model.device, width, offset)
