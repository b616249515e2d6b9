"""What every hf_tpu loop does around its graphs in one ``generate`` call, written once: :func:`loop`.

The cached loop (:mod:`.cached`) and the loop without a cache (:mod:`.cacheless`) share their shape; each is
``loop(its_steps)`` and supplies in ``its_steps(call, model, model_kwargs)`` only what differs, its inputs' layout
and its two graphs. A call then runs:

1. ``call = LoopCall(...)``: the call's sampling plan (plain greedy search's argmax, the logits processors and the
   sampler in the graph, or the host path, warned once with its cost per step) and the graph variant it leads to, the
   outputs asked and how often the tokens come back (read from the call's route: its
   :class:`~hf_tpu.transformers._settings.Layout` and read-back reason), the sequences kept on the host;
2. the loop's steps: its layout and its prefill graph (through :func:`hf_tpu.transformers._graphs.run_graph`), whose
   outputs :meth:`LoopCall.take` keeps, returned as :class:`Steps` with its decode step;
3. :meth:`LoopCall.run`: each step's host side (the next tokens back, scores and logits kept, finished rows padded,
   the streamer fed, the stopping criteria asked), then the loop's ``step(next_tokens)``, its decode graph;
4. :meth:`LoopCall.output`: what upstream's ``generate`` returns (with the cache the loop hands back, if any).

**The call's shapes** (:func:`plan_shapes`, every loop's, beam's too): a decoder-only call pads its prompt on the
left to the prompt bucket (the first rung of the model's ladder that holds it, :mod:`hf_tpu.transformers.buckets`)
and sizes its static cache to hold the padded prompt plus ``max_new_tokens``, rounded up with
:func:`~hf_tpu.transformers.buckets.cache_length` (a multiple of 128 by default). A cache already compiled for the
same prompt bucket that is large enough is preferred to compiling a smaller one. :func:`plan_shapes` is the public way
to ask which shapes a call will use (``hf_tpu.transformers.shapes``, ``hf_tpu.transformers.generation``), and
:func:`ladder_figures` measures a ladder (padding, unused cache slots, graphs) through it. The padding's token id
(:func:`fill_id`): upstream's ``generate`` writes the call's ``pad_token_id`` into the returned sequences only; it
never embeds it where a row is not finished. ``pad_token_id=-1`` (transformers' own tests pass it) or an id past the
vocabulary is fine there, but it cannot be embedded: the padding hf_tpu adds to reach a bucket, and a finished row's
input to the next decode step, take :func:`fill_id` instead (masked out, or never read back), and the sequences keep
the caller's pad id.

The sampling plan of a call (:func:`sampling_plan`, the one decision) is asked here by the loop; without a call,
for warm-up and :func:`hf_tpu.transformers.explain`, by :mod:`.defaults`. Beam search (:mod:`.beam`) keeps its search
state on the device and has a host side of its own.

**The loops' registry** (:class:`LoopSpec`, :func:`register_loop`, :func:`loop_spec`): each loop, beam's too,
registers its spec here once, under its route's name (:data:`BEAM` for beam's), with its ``custom_generate`` and
its warm-up; :func:`hf_tpu.transformers.generation.run_loop` runs the spec :func:`route_spec` finds for the call's
route, and :func:`hf_tpu.warmup` its warm-up. It lives in this module, which every call's path passes through
already.

Example:
    >>> plan_shapes(model, batch=1, prompt_len=500, max_new_tokens=8)      # doctest: +SKIP
    ShapePlan(batch=1, prompt_len=500, prompt_bucket=512, cache_bucket=640, encoder_bucket=None)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hf_tpu.errors import InvalidArgumentError, UnknownNameError
from hf_tpu.transformers._graph_key import NO_VARIANT, GraphKind, Variant
from hf_tpu.transformers._loops import readback
from hf_tpu.transformers._notes import warn_once
from hf_tpu.transformers._settings import model_state
from hf_tpu.transformers._upstream import encoder_input_name, output_cache_field
from hf_tpu.transformers.buckets import BucketLadder, BucketOverflowError, cache_length

__all__ = [
    "BEAM", "LADDER_FIX", "LoopSpec", "ShapePlan", "claimed_loop", "fill_id", "ladder_figures", "loop_spec",
    "plan_shapes", "register_loop", "unregister_loop",
]  # fmt: skip

# The remedy every length error names (it must exist: tests/transformers/test_remedies.py resolves it).
LADDER_FIX = (
    "truncate the prompt (tokenizer(..., truncation=True, max_length=...)) or give a larger ladder "
    "(hf_tpu.transformers.configure(model, buckets=[...]))"
)


@dataclass(frozen=True)
class ShapePlan:
    """The shapes of one call: its batch, its prompt length and bucket, its cache length (and encoder bucket)."""

    batch: int
    prompt_len: int
    prompt_bucket: int
    cache_bucket: int
    encoder_bucket: int | None = None


def _cache_rungs(ladder: BucketLadder) -> BucketLadder:
    # The ladder-sized cache (cache_multiple=None): a padded prompt plus the new tokens may pass the model's length
    # limit while the real sequence does not; the extra slots are storage only (padding keeps position 0), so the
    # cache ladder has one rung above the top.
    return BucketLadder((*ladder.rungs, 2 * ladder.max))


def _cache_size(state, ladder: BucketLadder, need: int) -> int:
    multiple = state.settings.cache_multiple
    if multiple is None:
        return _cache_rungs(ladder).bucket(need)
    return cache_length(need, multiple)


def plan_shapes(
    model, batch: int, prompt_len: int, max_new_tokens: int, *, encoder_len: int | None = None,
    variant: Variant | str = NO_VARIANT, kind: str = "prefill",
) -> ShapePlan:
    """The buckets a ``generate`` call of this size runs in (prefers shapes already compiled for the model: its
    prefill graphs of base ``kind`` and ``variant``; beam search's are ``"beam_prefill"``). ``variant``: a
    :class:`~hf_tpu.transformers._graph_key.Variant`, or its text (``"+top_k+sample"``, as
    :func:`~hf_tpu.transformers.generation.default_variant` gives it).

    Raises :class:`BucketOverflowError` for a prompt past the largest bucket, or a prompt plus ``max_new_tokens``
    longer than the largest bucket.

    Example:
        >>> plan_shapes(model, batch=1, prompt_len=20, max_new_tokens=32)      # doctest: +SKIP
        ShapePlan(batch=1, prompt_len=20, prompt_bucket=32, cache_bucket=64, encoder_bucket=None)
    """
    state = model_state(model)
    ladder = state.ladder(model.config)
    new = max(int(max_new_tokens), 1)
    if isinstance(variant, str):  # (a caller's text: read at this boundary)
        variant = Variant.parse(variant)
    if encoder_len is not None:
        # Encoder-decoder: the encoder input is bucketed, the decoder prompt (usually the start token) is not.
        # (an encoder of features runs at the length its input fixes: its output's length is the model's own)
        exact = encoder_input_name(model) is not None
        encoder_bucket = encoder_len if exact else ladder.bucket(encoder_len, "the encoder input", LADDER_FIX)
        need = prompt_len + new - 1
        if need > ladder.max:
            raise BucketOverflowError(
                f"the decoder prompt ({prompt_len}) plus max_new_tokens ({new}) needs a cache of {need} tokens, past "
                f"the largest bucket ({ladder.max}): lower max_new_tokens or give a larger ladder "
                "(hf_tpu.transformers.configure(model, buckets=[...]))."
            )
        prefill = GraphKind("seq2seq_prefill", variant)
        compiled = sorted(
            k.dim("cache bucket")
            for k in state.compiled
            if k.kind == prefill
            and (k.batch, k.dim("encoder bucket"), k.dim("decoder prompt")) == (batch, encoder_bucket, prompt_len)
            and k.dim("cache bucket") >= need
        )
        cache_bucket = compiled[0] if compiled else _cache_size(state, ladder, need)
        return ShapePlan(batch, prompt_len, prompt_len, cache_bucket, encoder_bucket)

    prompt_bucket = ladder.bucket(prompt_len, "the prompt", LADDER_FIX)
    if prompt_len + new - 1 > ladder.max:
        raise BucketOverflowError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({new}) is {prompt_len + new} tokens, past the "
            f"largest bucket ({ladder.max}, the model's length limit unless configured): lower max_new_tokens, "
            "shorten the prompt, or give a larger ladder (hf_tpu.transformers.configure(model, buckets=[...]))."
        )
    need = prompt_bucket + new - 1
    kinds = (GraphKind(kind, variant),)
    if kind == "prefill":
        kinds += (GraphKind("mm_prefill", variant),)  # (an image call's prefill: the same cache shapes)
    compiled = sorted(
        k.dim("cache bucket")
        for k in state.compiled
        if k.kind in kinds
        and (k.batch, k.dim("prompt bucket")) == (batch, prompt_bucket)
        and k.dim("cache bucket") >= need
    )
    cache_bucket = compiled[0] if compiled else _cache_size(state, ladder, need)
    return ShapePlan(batch, prompt_len, prompt_bucket, cache_bucket)


def ladder_figures(model, prompt_lens: Iterable[int], max_new_tokens: int, batch: int = 1) -> dict:
    """What the model's ladder costs for calls with these prompt lengths, measured through :func:`plan_shapes`.

    Returns ``{"padding": fraction of prefill tokens that are padding, "unused_cache": fraction of static-cache
    slots no token ever occupies (the cache holds ``prompt + max_new_tokens - 1`` real tokens at most),
    "graphs": prefill graphs + decode graphs the calls need, "prompt_buckets", "cache_buckets"}``. Compiled
    shapes the model already has are preferred by :func:`plan_shapes`, as in a real call.

    Example:
        >>> ladder_figures(model, range(1, 2049), max_new_tokens=16)["padding"]     # doctest: +SKIP
        0.102...
    """
    padding = prefill = unused = slots = 0
    prefills, caches = set(), set()
    for n in prompt_lens:
        plan = plan_shapes(model, batch, int(n), max_new_tokens)
        padding += plan.prompt_bucket - plan.prompt_len
        prefill += plan.prompt_bucket
        unused += plan.cache_bucket - (plan.prompt_len + max_new_tokens - 1)
        slots += plan.cache_bucket
        prefills.add((plan.prompt_bucket, plan.cache_bucket))
        caches.add(plan.cache_bucket)
    return {
        "padding": padding / prefill if prefill else 0.0,
        "unused_cache": unused / slots if slots else 0.0,
        "graphs": len(prefills) + len(caches),
        "prompt_buckets": sorted({p for p, _ in prefills}),
        "cache_buckets": sorted(caches),
    }


def _input_vocab(model) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        weight = getattr(embeddings, "weight", None)
        rows = None if weight is None else int(weight.shape[0])
    if rows is None:
        rows = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    return rows


def fill_id(model, pad_token_id, eos_token_id=None) -> int:
    """An id ``model`` can embed, for positions the caller gave no token: ``pad_token_id`` when it is one, else the
    first end-of-sequence id that is, else 0.

    Example:
        >>> fill_id(model, -1, eos_token_id=2)          # doctest: +SKIP
        2
    """
    vocab = _input_vocab(model)

    def valid(token) -> bool:
        return token is not None and 0 <= int(token) and (vocab is None or int(token) < vocab)

    for token in (pad_token_id, *_ids(eos_token_id)):
        if valid(token):
            return int(token)
    return 0


def _ids(value) -> list:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value]


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
            staged = rows.stage()
            # the next window's first steps, queued before the read-back waits: never past max_new_tokens, and not
            # before a streamer's first token (its time to the first token does not grow)
            ahead = min(readback.READ_AHEAD, steps_left, self._left() - staged[1])
            if self.streamer is not None and record.read_backs == 0:
                ahead = 0
            for _ in range(max(ahead, 0)):
                steps_left -= 1
                record.decode_steps += 1
                tokens_dev, _ = step(rows.fed)
                rows.add(tokens_dev)
            start = time.perf_counter() if HOST_TIMERS else None
            block = rows.read(staged)
            _add_time(start)
            record.read_backs += 1
            for index, next_tokens in enumerate(block):
                self._take(next_tokens)
                if self.unfinished.max() == 0 or (steps_left <= 0 and not rows.kept and index == len(block) - 1):
                    record.extra_steps = len(block) - 1 - index + len(rows.kept)
                    return
            rows.sync(self.unfinished)
            size = self._chunk()
            if not rows.kept:
                steps_left -= 1
                record.decode_steps += 1
                tokens_dev, _ = step(rows.fed)
                rows.add(tokens_dev)

    def _left(self) -> int:
        """The tokens the call may still return (``max_length`` ends it there)."""
        return self.new_tokens - (self.input_ids.shape[1] - self.prompt_len)

    def _chunk(self) -> int:
        """The tokens the next read-back holds: :attr:`every`, fewer where ``max_length`` ends the call sooner."""
        return max(1, min(self.every, self._left()))

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


# The name of beam search's loop: a call whose route says ``beams`` takes it, whatever its route's loop.
BEAM = "beam"


@dataclass(frozen=True)
class LoopSpec:
    """One of hf_tpu's loops, as :func:`register_loop` keeps it: everything ``generate`` and warm-up ask of a loop.

    Attributes:
        name: the loop's name: a route's loop (``route.loop``, :mod:`hf_tpu.transformers.route`) or :data:`BEAM`.
        run: its ``custom_generate`` callable (``run(model, input_ids, logits_processor, stopping_criteria,
            generation_config, synced_gpus, streamer, hf_tpu_plan=..., **model_kwargs)``, what :func:`loop` builds),
            which :func:`hf_tpu.transformers.generation.run_loop` calls for a call on its route.
        warm: compiles (or finds compiled) the graphs a call of one shape runs, on dummy inputs, and returns their
            keys: ``warm(model, plan, variant, **options)`` (beam's option: ``num_beams``); what
            :func:`hf_tpu.warmup` runs for the loop. None only with ``no_warm_up``.
        no_warm_up: why the loop has no graph to warm (None: ``warm`` warms them).
        claims: ``claims(model) -> bool``, the models whose route is this loop, asked before the built-in decision
            of :mod:`hf_tpu.transformers.route` (once per model, in the order the loops were registered); None: the
            loop runs where that decision names it. A claimed model whose graph fails its first trace goes back to
            the built-in decision.
    """

    name: str
    run: Callable
    warm: Callable[..., list] | None = None
    no_warm_up: str | None = None
    claims: Callable[[Any], bool] | None = None


# Every registered loop by name (:func:`register_loop`); read through :func:`loop_spec`.
LOOP_SPECS: dict[str, LoopSpec] = {}


def register_loop(spec: LoopSpec) -> LoopSpec:
    """Register ``spec`` under its name (a loop module does so once, at its end); returns it."""
    if spec.name in LOOP_SPECS:
        raise InvalidArgumentError(
            f"a loop named {spec.name!r} is registered already ({LOOP_SPECS[spec.name].run!r}): give the new loop a "
            "name of its own, or unregister_loop() the old one first"
        )
    if (spec.warm is None) == (spec.no_warm_up is None):
        raise InvalidArgumentError(
            f"loop {spec.name!r}: give its warm-up (warm=) or the reason it needs none (no_warm_up=), exactly one"
        )
    LOOP_SPECS[spec.name] = spec
    return spec


def unregister_loop(name: str) -> LoopSpec:
    """Remove the loop registered as ``name`` (a test's own loop); returns its spec."""
    loop_spec(name)  # (an unknown name: its error)
    return LOOP_SPECS.pop(name)


def loop_spec(name: str) -> LoopSpec:
    """The loop registered as ``name``."""
    spec = LOOP_SPECS.get(name)
    if spec is None:
        raise UnknownNameError(
            f"no loop is registered as {name!r}; the registered loops: {sorted(LOOP_SPECS)} (register_loop in "
            "hf_tpu.transformers._loops.skeleton adds one)"
        )
    return spec


def claimed_loop(model) -> str | None:
    """The name of the first registered loop that claims ``model`` (:attr:`LoopSpec.claims`), None when none does."""
    return next((spec.name for spec in LOOP_SPECS.values() if spec.claims is not None and spec.claims(model)), None)


def route_spec(route) -> LoopSpec:
    """The loop a call on ``route`` runs: beam search's for a beam call, else the route's own."""
    return loop_spec(BEAM if route.beams else route.loop)
