"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` of ``hf-tpu serve``: transformers' handlers,
answering per request.

:class:`ChatHandler` and :class:`TextHandler` subclass transformers' ``ChatCompletionHandler`` and
``CompletionHandler`` (same chat template and message conversion, transformers' response templates for tool calls and
reasoning, else hf_tpu's tool-call parsers and a forced call's grammar, :mod:`hf_tpu.serving._tools`) and
replace how one request is run on the continuous batch of the model this process serves (the
handler's ``served``, a :class:`hf_tpu.serving._app.ServedModel`, in place of transformers' model resolution): every
choice of the request (``n``) is a request of upstream's manager (``n > 1``: upstream's forked children, the
prompt's prefill shared), with the request's own sampling settings
(:func:`hf_tpu.serving._openai.resolve`); completions' ``best_of`` above ``n`` runs ``best_of`` choices and answers
the ``n`` with the highest cumulative log-probability; completions' ``prompt`` may be token ids (checked against the
model's vocabulary) or a list of prompts, each then run as its own request of the batch, its choices numbered after
the previous prompt's (vLLM's numbering); ``stop`` strings are looked for on the host in the decoded text of each
choice (the choice is cancelled when one is found); ``finish_reason`` is ``"stop"`` for an end of sequence or a
stop string and ``"length"`` when ``max_tokens`` or the model's context ended the choice; log-probabilities come
from the step's outputs (:mod:`hf_tpu.serving._sampling`); completions' ``echo`` puts the prompt's text (and, with
``logprobs``, its tokens' logprobs from one forward over the prompt, :mod:`hf_tpu.serving._prompt_logprobs`) before
each choice's, and with ``max_tokens`` 0 answers without the batch. ``ResponsesHandler`` (``/v1/responses``) runs its
request as the chat request it amounts to and answers in the Responses API's shape.

The bodies reaching these handlers have been checked by the request models of :mod:`hf_tpu.serving.protocol` (in the
guard).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from typing import Any

from hf_tpu.serving import _tools
from hf_tpu.serving._openai import CHAT, COMPLETIONS, RequestError, Sampling, check_vocab, resolve

__all__ = ["child_ids", "handler_classes"]

#: How transformers' continuous batching (5.24, 5.25) names the forked children of a request with ``num_children``
#: (``ContinuousBatchProcessor.update_batch``): ``f"{request_id}__child#{i}"``.
CHILD = "__child#"


def child_ids(request_id: str, n: int) -> list[str]:
    """The continuous-batching request ids of the ``n`` choices of ``request_id``: itself, then its children."""
    return [request_id] + [f"{request_id}{CHILD}{i}" for i in range(n - 1)]


def _request_kwargs(cb, sampling: Sampling) -> dict[str, Any]:
    """The per-request settings handed to the continuous batch (``add_request``'s logits-processor kwargs, read by
    :class:`hf_tpu.serving._sampling.RowSampling`); without it (async batching), only greedy requests."""
    from hf_tpu.serving import _sampling

    if _sampling.row_sampling_of(cb) is not None:
        return _sampling.request_kwargs(sampling)
    if not sampling.greedy:
        raise RequestError("temperature", "sampling per request needs hf_tpu's row sampling, off with async "
                                          "batching; send temperature 0")  # fmt: skip
    if sampling.logprobs:
        raise RequestError("logprobs", "logprobs need hf_tpu's row sampling, off with async batching")
    if sampling.scored:
        raise RequestError("best_of", "best_of above n needs hf_tpu's row sampling, off with async batching")
    for name in sampling.extra.get("penalties", ()):  # (the model's own defaults stay dropped, as upstream does)
        raise RequestError(name, f"{name} needs hf_tpu's row sampling, off with async batching; leave it out")
    return {}


class _Choice:
    """One choice of a request: its tokens, its text decoded so far (cut at a stop string) and how it ended."""

    def __init__(self, index: int, cb_id: str, tokenizer, skip_special: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.index, self.cb_id, self.tokenizer = index, cb_id, tokenizer
        self.decoder = DecodeStream([], skip_special_tokens=skip_special)
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.ends: list[int] = []  # offset in ``text`` after each token
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.first_token_at: float | None = None

    def take(self, output, sampling: Sampling, eos: set[int]) -> None:
        """Take the tokens of ``output`` (a ``GenerationOutput``) that are new; end the choice at a stop string, an
        end of sequence, or its length."""
        if self.finish_reason is not None:
            return
        if output.error is not None:
            self.error, self.finish_reason = str(output.error), "error"
            return
        new = output.generated_tokens[len(self.tokens) :]
        if new and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        longest = max((len(s) for s in sampling.stop), default=0)
        for k, token in enumerate(new):
            self.tokens.append(token)
            if sampling.scored and len(output.logprobs) > len(self.logprobs):
                self.logprobs.append(output.logprobs[len(self.logprobs)])
            piece = self.decoder.step(self.tokenizer, token) or ""
            start = max(len(self.text) - longest + 1, 0)
            self.text += piece
            self.ends.append(len(self.text))
            if sampling.stop and piece:
                found = [i for i in (self.text.find(s, start) for s in sampling.stop) if i >= 0]
                if found:
                    self.text = self.text[: min(found)]
                    self.ends[-1] = len(self.text)
                    self.finish_reason = "stop"
                    return
        if output.is_finished():
            self.finish_reason = "stop" if self.tokens and self.tokens[-1] in eos else "length"

    def pieces(self, sampling: Sampling) -> list[tuple[int, str]]:
        """``(token index, its text)`` of each token that can be sent now (:meth:`sendable`); marks them sent."""
        hi, out = self.sendable(sampling), []
        while self.sent_tokens < len(self.tokens):
            k = self.sent_tokens
            if self.finish_reason is None and self.ends[k] > hi:
                break
            end = max(min(self.ends[k], len(self.text)), self.sent_chars)
            out.append((k, self.text[self.sent_chars : end]))
            self.sent_chars, self.sent_tokens = end, k + 1
        return out

    def sendable(self, sampling: Sampling) -> int:
        """How much of ``text`` can be sent: all of it once the choice ended, else all but what could still become
        a stop string."""
        if self.finish_reason is not None or not sampling.stop:
            return len(self.text)
        return max(len(self.text) - max(len(s) for s in sampling.stop) + 1, self.sent_chars)


class _Run:
    """The choices of one request on the continuous batch: submitted, their outputs gathered on the event loop."""

    def __init__(self, cb, input_ids: list[int], sampling: Sampling, processor, metrics, *, skip_special: bool,
                 stream: bool) -> None:  # fmt: skip
        self.cb, self.input_ids, self.sampling, self.metrics = cb, input_ids, sampling, metrics
        # Outputs per token when they are streamed, cut at a stop string or split in choices; else only the last.
        self.per_token = stream or bool(sampling.stop) or sampling.best_of > 1
        self.tokenizer = getattr(processor, "tokenizer", processor)
        from hf_tpu.serving._guard import ARRIVAL
        from hf_tpu.serving.metrics import HANDLED

        self.base_id = f"{HANDLED}{uuid.uuid4().hex}"
        self.ids = child_ids(self.base_id, sampling.best_of)
        rust = self.tokenizer._tokenizer
        self.choices = [_Choice(i, cb_id, rust, skip_special) for i, cb_id in enumerate(self.ids)]
        self.queue: asyncio.Queue = asyncio.Queue()
        eos = sampling.eos_token_id
        self.eos = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        self.arrival = ARRIVAL.get(time.perf_counter())
        self.echo = None  # with echo: the prompt's (text, logprobs record per token or None)

    def submit(self) -> None:
        """Register a handler per choice, then add the request (``n`` choices) to the manager."""
        s = self.sampling
        for choice in self.choices:
            self.cb.register_result_handler(choice.cb_id, lambda out, c=choice: self.queue.put_nowait((c, out)))
        kwargs = _request_kwargs(self.cb, s)
        if self.metrics is not None:
            self.metrics.arrived(self.base_id, self.arrival)
        try:
            self.cb.add_request(
                self.input_ids, request_id=self.base_id, max_new_tokens=s.max_tokens, num_choices=s.best_of,
                streaming=self.per_token, eos_token_id=-1 if not self.eos else list(self.eos),
                **kwargs,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        if self.metrics is not None:
            self.metrics.admitted(len(self.input_ids))

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def step(self) -> None:
        """Wait for outputs and take them all (those already queued included)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for choice, output in items:
            ended = choice.finish_reason is not None
            choice.take(output, self.sampling, self.eos)
            if not ended and choice.finish_reason == "stop" and not output.is_finished():
                self._cancel(choice)  # cut at a stop string: the batch stops generating for it
                if self.metrics is not None:
                    self.metrics.stopped(choice.cb_id, len(choice.tokens), choice.first_token_at)

    def _cancel(self, choice: _Choice) -> None:
        router = self.cb.output_router
        with router._lock:
            router.result_handlers.pop(choice.cb_id, None)
        self.cb.cancel_request(choice.cb_id)

    def close(self) -> None:
        """Cancel the choices that have not ended (a client gone, an error) and drop their handlers."""
        for choice in self.choices:
            if choice.finish_reason is None:
                self._cancel(choice)
                choice.finish_reason = "cancelled"
        if self.metrics is not None:
            self.metrics.left(self.base_id)

    def usage(self) -> dict:
        return _usage([self])

    def best(self) -> list[_Choice]:
        """The choices answered: all of them, or with ``best_of`` above ``n`` the ``n`` with the highest cumulative
        log-probability (of the raw model distribution, as the logprobs returned), highest first."""
        s = self.sampling
        if s.best_of <= s.n:
            return self.choices
        return sorted(self.choices, key=lambda c: -sum(record[0] for record in c.logprobs))[: s.n]

    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error is not None), None)


class _Upstream:
    """transformers' streaming ``ResponseParser`` of one choice as hf_tpu's parsers are fed: ``feed(piece)`` and
    ``finish()`` return content (``str``), reasoning (``ReasoningText``) and calls (``ToolCall``)."""

    def __init__(self, parser) -> None:
        self.parser = parser

    def feed(self, piece: str) -> list:
        from transformers.cli.serving.utils import response_events_to_chunks

        return response_events_to_chunks(self.parser.feed(piece))

    def finish(self) -> list:
        return []


def _usage(runs: list[_Run]) -> dict:
    """Usage of one request's runs (one per prompt): every generated token counts, ``best_of``'s unreturned too."""
    completion = sum(len(c.tokens) for run in runs for c in run.choices)
    prompt = sum(len(run.input_ids) for run in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Tokens:
    """Token strings of log-probability entries (cached per id)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _chat_logprobs(choice: _Choice, lo: int, hi: int, name: _Tokens, top: int) -> dict:
    entries = []
    for token, record in zip(choice.tokens[lo:hi], choice.logprobs[lo:hi]):
        chosen, alternatives = record
        text = name(token)
        alts = [{"token": name(t), "logprob": lp, "bytes": list(name(t).encode())} for t, lp in alternatives[:top]]
        entries.append({"token": text, "logprob": chosen, "bytes": list(text.encode()), "top_logprobs": alts})
    return {"content": entries}


def _text_logprobs(choice: _Choice, lo: int, hi: int, name: _Tokens, top: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for k in range(lo, min(hi, len(choice.logprobs))):
        chosen, alternatives = choice.logprobs[k]
        tokens.append(name(choice.tokens[k]))
        values.append(chosen)
        tops.append({name(t): lp for t, lp in alternatives[:top]} if top else None)
        offsets.append(choice.ends[k - 1] if k else 0)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Answer:
    """Runs a checked request on the continuous batch and answers it, streamed or not."""

    def __init__(self, handler, path: str, body: dict, request_id: str) -> None:
        self.handler, self.path, self.body, self.request_id = handler, path, body, request_id
        self.chat = path == CHAT

    async def __call__(self):
        from fastapi.responses import JSONResponse, StreamingResponse

        from hf_tpu.serving._app import BatchDiedError
        from hf_tpu.serving._guard import PromptTooLongError
        from hf_tpu.serving._penalties import vocab_of

        h = self.handler
        served = h.served  # (hf_tpu.serving._app.ServedModel: the model of this process, not upstream's manager)
        served.check_alive(self.request_id)
        model_id, model, processor, cb = served.name, served.model, served.processor, served.cb
        self.model_id, self.model, self.processor = model_id, model, processor
        sampling = resolve(self.path, self.body, model.generation_config)
        vocab = vocab_of(model)
        check_vocab(self.body, vocab)
        prompts = self._prompts(processor, vocab)  # [(text, token ids)]: one, or completions' list of prompts
        self.plan = self._plan(processor, model) if self.chat else _tools.Plan()
        if self.plan.grammar is not None:  # a forced tool call (the protocol refused it beside a response_format)
            sampling.grammar, sampling.extra["grammar_field"] = self.plan.grammar, "tool_choice"
        self.parser = self._parser(processor, model, prompts[0][1]) if self.plan.upstream else None
        self.name, self.created = _Tokens(getattr(processor, "tokenizer", processor)), int(time.time())
        echo = not self.chat and bool(self.body.get("echo"))
        if echo:
            for _, ids in prompts:
                self._check_echo(model, ids)
            if sampling.max_tokens == 0:  # the prompts alone: nothing joins the continuous batch
                echoes = [await self._echo(model, text, ids, sampling) for text, ids in prompts]
                return JSONResponse(self._prompt_only(prompts, echoes, sampling))
        if sampling.grammar is not None:
            self._constrain(cb, processor, model, sampling)
        runs: list[_Run] = []
        try:
            for _, ids in prompts:
                runs.append(_Run(cb, ids, sampling, processor, h.metrics, skip_special=self.plan.skip_special,
                                 stream=bool(self.body.get("stream"))))  # fmt: skip
                runs[-1].submit()
        except BaseException as exc:
            for run in runs:
                run.close()
            if isinstance(exc, PromptTooLongError):
                raise RequestError("messages" if self.chat else "prompt", str(exc)) from None
            raise
        if self.body.get("stream"):  # (one prompt: a list of prompts is not streamed, protocol.CompletionRequest)
            return StreamingResponse(self._stream(runs[0]), media_type="text/event-stream")
        try:
            if echo:  # (the prompts' forwards while the batch generates)
                for run, (text, ids) in zip(runs, prompts):
                    run.echo = await self._echo(model, text, ids, sampling)
            for run in runs:
                while not run.done:
                    await run.step()
        finally:
            for run in runs:
                run.close()
        failure = next((f for f in (run.error() for run in runs) if f is not None), None)
        if failure is not None:
            if cb.background_thread_status.fatal_error is not None:
                raise BatchDiedError(f"the continuous batch died during request {self.request_id}: {failure}")
            return JSONResponse({"error": {"message": f"generation failed: {failure}", "type": "server_error",
                                           "param": None, "code": 500}}, status_code=500)  # fmt: skip
        return JSONResponse(self._whole(runs[0]) if self.chat else self._whole_texts(runs))

    def _constrain(self, cb, processor, model, sampling: Sampling) -> None:
        """Check the request's grammar against the model's tokenizer (a 400 naming its field when llguidance cannot
        compile it) and give the manager that tokenizer (once)."""
        from hf_tpu.errors import InvalidArgumentError
        from hf_tpu.serving import _grammar
        from hf_tpu.serving._penalties import vocab_of

        field = sampling.extra.get("grammar_field") or "response_format"
        try:
            _grammar.attach(cb, getattr(processor, "tokenizer", processor))
            _grammar.check(sampling.grammar, _grammar.llguidance_tokenizer(processor, vocab_of(model)), field)
        except InvalidArgumentError as exc:
            raise RequestError(field, str(exc)) from None

    def _prompts(self, processor, vocab: int) -> list[tuple[str, list[int]]]:
        """``(text, token ids)`` of each prompt of the request: the chat template's, or completions' ``prompt`` (a
        text or token ids, or a list of either; token ids are checked against the model's ``vocab`` and their text
        is their decoding)."""
        tokenizer = getattr(processor, "tokenizer", processor)
        if self.chat:
            return [("", self._chat_ids(processor))]
        prompt = self.body["prompt"]
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for k, item in enumerate(prompt):
            if isinstance(item, str):
                out.append((item, list(tokenizer(item)["input_ids"])))
                continue
            past = [t for t in item if t >= vocab]
            if past:
                where = "prompt" if len(prompt) == 1 else f"prompt[{k}]"
                raise RequestError(where, f"{where} has token id {past[0]}, past the model's vocabulary of {vocab} "
                                          f"(ids 0 to {vocab - 1})")  # fmt: skip
            out.append((tokenizer.decode(item, skip_special_tokens=True), list(item)))
        return out

    def _chat_ids(self, processor) -> list[int]:
        from transformers.cli.serving.utils import Modality

        h = self.handler
        messages = h.get_processor_inputs_from_messages(self.body["messages"], Modality.LLM)
        kwargs = {**h.chat_template_kwargs, **(self.body.get("chat_template_kwargs") or {})}
        inputs = processor.apply_chat_template(
            messages, add_generation_prompt=True, tools=self.body.get("tools"), return_dict=True, tokenize=True,
            **kwargs,
        )  # fmt: skip
        return list(inputs["input_ids"])

    # ----- echo -----

    def _check_echo(self, model, input_ids: list[int]) -> None:
        """Refuse what echo cannot score: a prompt past the model's length, the prompt's logprobs under ``--tp``."""
        from hf_tpu import _env
        from hf_tpu.serving.kv_sizing import model_max_len

        limit = model_max_len(model)
        if len(input_ids) > limit:
            raise RequestError("prompt", f"the prompt is {len(input_ids)} tokens; this model reads at most {limit} "
                                         f"(max_position_embeddings {limit}): shorten the prompt")  # fmt: skip
        if self.body.get("logprobs") is not None and (_env.SERVE_TP.get() or 1) > 1:
            raise RequestError("echo", "echo with logprobs (the prompt's logprobs) is not supported under --tp; "
                                       "leave echo or logprobs out")  # fmt: skip

    async def _echo(self, model, text: str, input_ids: list[int], sampling: Sampling) -> tuple:
        """A prompt's echo: its text and, with ``logprobs``, its tokens' records (one forward of the model over the
        prompt, :func:`hf_tpu.serving._prompt_logprobs.prompt_logprobs`, in a worker thread)."""
        records = None
        if sampling.logprobs:
            from hf_tpu.serving._prompt_logprobs import prompt_logprobs

            records = await asyncio.to_thread(prompt_logprobs, model, input_ids, sampling.top_logprobs)
        return text, records

    def _echo_logprobs(self, input_ids: list[int], echo: tuple, top: int) -> dict:
        """The prompt's part of a choice's ``logprobs`` (OpenAI's legacy format): the first token's value and
        alternatives are null; ``text_offset`` from decoding the prompt's tokens one by one."""
        from tokenizers.decoders import DecodeStream

        rust = self.name.tokenizer._tokenizer
        decoder, length = DecodeStream([], skip_special_tokens=True), 0
        tokens, values, tops, offsets = [], [], [], []
        for token, record in zip(input_ids, echo[1]):
            tokens.append(self.name(token))
            offsets.append(length)
            length += len(decoder.step(rust, token) or "")
            if record is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(record[0])
            tops.append({self.name(t): lp for t, lp in record[1][:top]} if top else None)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_only(self, prompts: list[tuple[str, list[int]]], echoes: list[tuple], sampling: Sampling) -> dict:
        """The answer to an echo with ``max_tokens`` 0: each choice its prompt (and its logprobs), ``"length"``."""
        choices = []
        for k, ((_, ids), echo) in enumerate(zip(prompts, echoes)):
            logprobs = self._echo_logprobs(ids, echo, sampling.top_logprobs) if sampling.logprobs else None
            text = echo[0] + (self.body.get("suffix") or "")
            choices += [{"index": k * sampling.n + i, "text": text, "logprobs": logprobs, "finish_reason": "length"}
                        for i in range(sampling.n)]  # fmt: skip
        prompt = sum(len(ids) for _, ids in prompts)
        usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": usage}  # fmt: skip

    def _plan(self, processor, model) -> _tools.Plan:
        """How the reply's tool calls are parsed and forced (:func:`hf_tpu.serving._tools.plan`)."""
        from transformers.cli.serving.utils import get_response_template

        from hf_tpu.serving._app import model_or_config

        upstream = get_response_template(processor, model_or_config(get_response_template, model)) is not None
        override = getattr(self.handler, "tool_call_parser", None)
        return _tools.plan(self.body, processor, upstream, override)

    def _parser(self, processor, model, input_ids):
        from hf_tpu.serving._app import response_parser

        return response_parser(processor, model, input_ids, tools=self.body.get("tools"))

    def _stream_parser(self, input_ids):
        """A streaming parser of one choice (``feed(piece)``, then ``finish()``: content, reasoning and calls), or
        None (the text is sent as it is)."""
        if self.plan.fmt is not None:
            return _tools.parser(self.plan.fmt, self.plan.drop)
        if self.plan.upstream:
            return _Upstream(self._parser(self.processor, self.model, input_ids))
        return None

    def _tool_calls(self, calls) -> list[dict]:
        calls = list(calls)[: None if self.plan.parallel else 1]
        return [{"id": f"{self.request_id}_tool_call_{i}", "type": "function",
                 "function": {"name": t.name, "arguments": t.arguments}} for i, t in enumerate(calls)]  # fmt: skip

    # ----- whole answers -----

    def _whole(self, run: _Run) -> dict:
        choices = [self._whole_choice(run, c) for c in run.choices]
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": run.usage()}  # fmt: skip

    def _whole_texts(self, runs: list[_Run]) -> dict:
        """A completions answer: each prompt's choices (``best_of``'s best), numbered across the prompts."""
        n = runs[0].sampling.n
        choices = [self._whole_choice(run, c, k * n + i) for k, run in enumerate(runs)
                   for i, c in enumerate(run.best())]  # fmt: skip
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": _usage(runs)}  # fmt: skip

    def _whole_choice(self, run: _Run, c: _Choice, index: int | None = None) -> dict:
        s = run.sampling
        parsed = self.parser is not None or self.plan.fmt is not None
        text = c.text if (s.stop or parsed) else self._decoded(run, c)
        logprobs = None
        if not self.chat:
            if s.logprobs:
                logprobs = _text_logprobs(c, 0, len(c.tokens), self.name, s.top_logprobs)
            if run.echo is not None:  # the prompt's text and logprobs first, the generated offsets after its text
                prompt = run.echo[0]
                text = prompt + text
                if logprobs is not None:
                    shifted = [len(prompt) + k for k in logprobs["text_offset"]]
                    before = self._echo_logprobs(run.input_ids, run.echo, s.top_logprobs)
                    logprobs = {key: before[key] + logprobs[key] for key in before}
                    logprobs["text_offset"] = before["text_offset"] + shifted
            suffix = self.body.get("suffix")
            return {"index": c.index if index is None else index, "text": text + (suffix or ""), "logprobs": logprobs,
                    "finish_reason": c.finish_reason}  # fmt: skip
        if s.logprobs:
            logprobs = _chat_logprobs(c, 0, len(c.tokens), self.name, s.top_logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish, calls = c.finish_reason, None
        if self.plan.fmt is not None:
            content, calls = _tools.parse(self.plan.fmt, text, self.plan.drop)
            message["content"] = content if content or not calls else None
        elif self.parser is not None:
            from hf_tpu.serving._app import parse_message

            content, reasoning, calls = parse_message(self.processor, self.model, c.tokens, run.input_ids, text,
                                                      tools=self.body.get("tools"))  # fmt: skip
            message["content"] = content
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = self._tool_calls(calls)
            finish = "tool_calls"
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def _decoded(self, run: _Run, c: _Choice) -> str:
        return run.tokenizer.decode(c.tokens, skip_special_tokens=True)

    # ----- streamed answers -----

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        payload = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model_id,
                   "choices": choices}  # fmt: skip
        if usage is not None:
            payload["usage"] = usage
        return _sse(payload)

    def _deltas(self, index: int, items: list, calls: dict, lp) -> list[dict]:
        """The stream's events of a choice's parsed ``items`` (content, reasoning, calls); ``calls`` counts the
        choice's calls sent (without ``parallel_tool_calls``, those after the first are not sent); ``lp``: the
        logprobs of the token, on the first event."""
        from transformers.cli.serving.utils import ToolCall

        events = []
        for item in items:
            if isinstance(item, (ToolCall, _tools.Call)):
                k = calls[index]
                calls[index] += 1
                if k and not self.plan.parallel:
                    continue
                delta = {"tool_calls": [{"index": k, "type": "function", "id": f"{self.request_id}_tool_call_{k}",
                                         "function": {"name": item.name, "arguments": item.arguments}}]}  # fmt: skip
            elif type(item) is not str:
                delta = {"reasoning_content": str(item)}
            else:
                delta = {"content": item}
            events.append({"index": index, "delta": delta, "logprobs": lp, "finish_reason": None})
            lp = None
        return events

    async def _stream(self, run: _Run):
        s = run.sampling
        parsers = {c.index: self._stream_parser(run.input_ids) for c in run.choices}
        parsers = {i: p for i, p in parsers.items() if p is not None}
        calls = dict.fromkeys(parsers, 0)
        try:
            if self.chat:
                yield self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None} for c in run.choices])  # fmt: skip
            while True:
                if not run.done:
                    await run.step()
                events = []
                for c in run.choices:
                    for k, piece in c.pieces(s):  # one event per token, as OpenAI streams
                        if not piece and not s.logprobs:
                            continue
                        if not self.chat:
                            lp = _text_logprobs(c, k, k + 1, self.name, s.top_logprobs) if s.logprobs else None
                            events.append({"index": c.index, "text": piece, "logprobs": lp, "finish_reason": None})
                            continue
                        lp = _chat_logprobs(c, k, k + 1, self.name, s.top_logprobs) if s.logprobs else None
                        if c.index not in parsers:
                            events.append({"index": c.index, "delta": {"content": piece}, "logprobs": lp,
                                           "finish_reason": None})  # fmt: skip
                            continue
                        events += self._deltas(c.index, parsers[c.index].feed(piece), calls, lp)
                    if c.finish_reason is not None and c.index in parsers and c.sent_tokens == len(c.tokens):
                        events += self._deltas(c.index, parsers.pop(c.index).finish(), calls, None)
                if events:
                    yield "".join(self._chunk([e]) for e in events)
                if run.done:
                    break
            failure = run.error()
            if failure is not None:
                yield _sse({"error": {"message": f"generation failed: {failure}", "type": "server_error",
                                      "param": None, "code": 500}})  # fmt: skip
                return
            ends = []
            for c in run.choices:
                finish = "tool_calls" if calls.get(c.index) else c.finish_reason
                if self.chat:
                    ends.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish})
                else:
                    suffix = self.body.get("suffix") or ""
                    ends.append({"index": c.index, "text": suffix, "logprobs": None, "finish_reason": finish})
            yield self._chunk(ends)
            if s.include_usage:  # as OpenAI: the usage chunk (empty choices) only when the request asked for it
                yield self._chunk([], usage=run.usage())
            yield "data: [DONE]\n\n"
        finally:
            run.close()


#: ``/v1/responses`` fields that carry over to the chat request it is run as (``max_output_tokens``: ``max_tokens``).
_RESPONSES_TO_CHAT = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                      "top_k": "top_k", "min_p": "min_p", "seed": "seed", "ignore_eos": "ignore_eos",
                      "generation_config": "generation_config",
                      "chat_template_kwargs": "chat_template_kwargs"}  # fmt: skip


class _ResponsesAnswer(_Answer):
    """A checked ``/v1/responses`` request (:class:`hf_tpu.serving.protocol.ResponsesRequest`), run as the chat request
    it amounts to (transformers' own conversion of ``input`` and ``instructions`` to messages, its tool format), so
    with the same per-request sampling; answered in the Responses API's shape: one JSON ``response`` object unless
    ``stream`` is true (OpenAI's default is false), else transformers' stream of ``response.*`` events."""

    def __init__(self, handler, body: dict, request_id: str) -> None:
        chat: dict[str, Any] = {"messages": handler._normalize_input(body), "stream": bool(body.get("stream"))}
        chat.update({to: body[name] for name, to in _RESPONSES_TO_CHAT.items() if body.get(name) is not None})
        tools = handler._normalize_tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        super().__init__(handler, CHAT, chat, request_id)
        self.request = body

    def _defaults(self) -> dict:
        return {"id": f"resp_{self.request_id}", "created_at": float(self.created), "model": self.model_id,
                "object": "response", "tools": [], "parallel_tool_calls": bool(self.request.get("parallel_tool_calls")),
                "tool_choice": "auto"}  # fmt: skip

    def _whole(self, run: _Run) -> dict:
        from openai.types.responses import (
            Response, ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText, ResponseReasoningItem,
        )  # fmt: skip
        from transformers.cli.serving.response import compute_usage

        choice = self._whole_choice(run, run.choices[0])
        message, items = choice["message"], []
        if message.get("reasoning_content"):
            reasoning = [{"type": "reasoning_text", "text": message["reasoning_content"]}]
            items.append(ResponseReasoningItem(id=f"rs_{self.request_id}", type="reasoning", summary=[],
                                               content=reasoning, status="completed"))  # fmt: skip
        text = ResponseOutputText(type="output_text", text=message.get("content") or "", annotations=[])
        items.append(ResponseOutputMessage(id=f"msg_{self.request_id}", type="message", status="completed",
                                           role="assistant", content=[text]))  # fmt: skip
        for call in message.get("tool_calls") or []:
            function = call["function"]
            items.append(ResponseFunctionToolCall(id=call["id"], call_id=call["id"], type="function_call",
                                                  name=function["name"], arguments=function["arguments"],
                                                  status="completed"))  # fmt: skip
        usage = compute_usage(len(run.input_ids), len(run.choices[0].tokens))
        response = Response(**self._defaults(), status="completed", output=items, usage=usage)
        return response.model_dump(exclude_none=True)

    async def _stream(self, run: _Run):
        from transformers.cli.serving.response import _ResponseStreamBuilder, compute_usage
        from transformers.cli.serving.utils import ReasoningText, ToolCall

        s, c = run.sampling, run.choices[0]
        parser = self._stream_parser(run.input_ids)  # None: no tool calls nor reasoning to find
        builder = _ResponseStreamBuilder(request_id=self.request_id, response_defaults=self._defaults())
        calls = 0
        try:
            yield "".join(builder.start_response())
            while True:
                if not run.done:
                    await run.step()
                parts: list[str] = []
                pieces = [piece for _k, piece in c.pieces(s)]
                items = [p for p in pieces if p] if parser is None else \
                    [i for p in pieces if p for i in parser.feed(p)]  # fmt: skip
                if parser is not None and c.finish_reason is not None and c.sent_tokens == len(c.tokens):
                    items += parser.finish()
                    parser = None
                for item in items:
                    if isinstance(item, (ToolCall, _tools.Call)):
                        if builder.reasoning_open:
                            parts += builder.finish_reasoning()
                        if builder.message_open:
                            parts += builder.finish_message()
                        call_id = f"{self.request_id}_tool_call_{calls}"
                        parts += builder.tool_call(call_id, item.name, item.arguments)
                        calls += 1
                    elif isinstance(item, ReasoningText):
                        parts += [] if builder.reasoning_open else builder.start_reasoning()
                        parts += builder.reasoning_delta(item)
                    else:
                        parts += builder.finish_reasoning() if builder.reasoning_open else []
                        parts += [] if builder.message_open else builder.start_message()
                        parts += builder.text_delta(item)
                if parts:
                    yield "".join(parts)
                if run.done:
                    break
            failure = run.error()
            if failure is not None:
                yield "".join(builder.error(f"generation failed: {failure}"))
                return
            if builder.reasoning_open:
                yield "".join(builder.finish_reasoning())
            if not builder.message_open:
                yield "".join(builder.start_message())
            yield "".join(builder.finish_message())
            yield "".join(builder.completed(compute_usage(len(run.input_ids), len(c.tokens))))
        finally:
            run.close()


@functools.cache
def handler_classes() -> tuple[type, type, type]:
    """``(ChatHandler, TextHandler, ResponsesHandler)``: transformers' chat, completions and responses handlers
    answering per request (made on first use: transformers' serving modules import fastapi and openai)."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    class ChatHandler(ChatCompletionHandler):
        """transformers' chat handler answering with :class:`_Answer` (see the module docstring)."""

        # (set by hf_tpu.serving.server: its metrics, its ServedModel, its --tool-call-parser)
        metrics = served = tool_call_parser = None

        async def handle_request(self, body: dict, request_id: str):
            return await _Answer(self, CHAT, body, request_id)()

    class TextHandler(CompletionHandler):
        """transformers' completions handler answering with :class:`_Answer` (see the module docstring)."""

        metrics = served = tool_call_parser = None

        async def handle_request(self, body: dict, request_id: str):
            return await _Answer(self, COMPLETIONS, body, request_id)()

    class ResponsesHandler(ResponseHandler):
        """transformers' ``/v1/responses`` handler answering with :class:`_ResponsesAnswer` (run as chat)."""

        metrics = served = tool_call_parser = None

        async def handle_request(self, body: dict, request_id: str):
            return await _ResponsesAnswer(self, body, request_id)()

    return ChatHandler, TextHandler, ResponsesHandler

