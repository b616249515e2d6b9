"""The OpenAI request fields ``hf-tpu serve`` takes, checked at the door, and the sampling settings they resolve to.

:func:`check` looks at the body of ``POST /v1/chat/completions`` or ``POST /v1/completions`` before anything else
does, and names the first field that is wrong (:class:`RequestError`: HTTP 400 in OpenAI's error shape, ``param``
the field). What passes it cannot fail the continuous batch: every value is of its type and in its range.
:func:`resolve` then turns a checked body into the :class:`Sampling` of the request: the request's values, else the
model's generation config (or the body's ``generation_config``, transformers' own extension), as transformers'
server would. :func:`check_responses` does the same for ``POST /v1/responses`` (run as the chat request it amounts
to: ``input`` and ``instructions`` as messages, ``max_output_tokens`` as ``max_tokens``, the sampling fields as chat's).

Fields a request may send (OpenAI's, plus ``top_k``, ``min_p``, ``ignore_eos``, ``generation_config`` and, for chat,
``chat_template_kwargs``):

* honoured: ``messages``/``prompt``, ``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``seed``, ``n``, ``stop``, ``logprobs``/``top_logprobs``, ``stream``/``stream_options``,
  ``ignore_eos``, ``tools`` (rendered by the chat template, parsed by transformers), ``suffix`` (completions),
  ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and vLLM's ``repetition_penalty`` and ``min_tokens``
  (per request, in the compiled step: :mod:`hf_tpu.serving._penalties`);
* accepted, no effect on the text: ``model`` (checked), ``user``, ``metadata``, ``store``, ``service_tier``,
  ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``, ``prompt_cache_options``,
  ``parallel_tool_calls``;
* refused with a 400 naming the field unless at their neutral value: ``response_format`` (other than text),
  ``tool_choice`` (other than auto), ``best_of`` (other than ``n``), ``echo``, ``reasoning_effort``, ``verbosity``,
  ``audio``, ``modalities``, ``prediction``, ``web_search_options``, ``functions``, ``function_call``,
  ``moderation``; any other field is refused as unknown.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import UserError

__all__ = ["CHAT", "COMPLETIONS", "Limits", "PENALTIES", "RESPONSES", "RequestError", "ROLES", "Sampling", "check",
           "check_responses", "check_vocab", "resolve"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # OpenAI's limit on stop sequences
_TEXT_PARTS = ("text", "input_text", "output_text")

_NO_EFFECT = {
    "model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "parallel_tool_calls",
}  # fmt: skip
_COMMON = {
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "logprobs", "stream",
    "stream_options", "ignore_eos", "generation_config", "presence_penalty", "frequency_penalty", "logit_bias",
    "repetition_penalty", "min_tokens",
}  # fmt: skip
_CHAT_ONLY = {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
    "chat_template_kwargs", "reasoning_effort", "verbosity", "audio", "modalities", "prediction", "web_search_options",
    "functions", "function_call", "moderation",
}  # fmt: skip
_TEXT_ONLY = {"prompt", "suffix", "best_of", "echo"}
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
_UNSUPPORTED_UNLESS_NONE = ("reasoning_effort", "verbosity", "audio", "modalities", "prediction", "web_search_options",
                            "functions", "function_call", "moderation")  # fmt: skip


class RequestError(UserError, ValueError):
    """A request field that is wrong (the client's mistake): answered with ``status`` (400) naming ``param``."""

    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.message, self.status, self.kind = param, message, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Limits:
    """The server's limits on a request: ``max_n`` choices, ``max_logprobs`` top log-probabilities per token."""

    max_n: int = 16
    max_logprobs: int = 5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False, what: str = "") -> None:
    value = body.get(name)
    if value is None:
        return
    inside = _is_number(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not inside:
        left = "(" if lo_open else "["
        span = what or f"a number in {left}{lo:g}, {hi:g}]"
        raise RequestError(name, f"{name} must be {span}, got {value!r}")


def _integer(body: dict, name: str, lo: int, hi: int | None = None, what: str = "") -> None:
    value = body.get(name)
    if value is None:
        return
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        span = what or (f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}")
        raise RequestError(name, f"{name} must be {span}, got {value!r}")


def _boolean(body: dict, name: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(name, f"{name} must be true or false, got {value!r}")


def _unsupported(name: str, why: str = "") -> RequestError:
    return RequestError(name, f"{name} is not supported by hf-tpu serve{why}; leave it out")


def _check_messages(messages) -> None:
    if messages is None:
        raise RequestError("messages", "messages is required: a non-empty list of {role, content} objects")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", f"messages must be a non-empty list of {{role, content}} objects, got "
                                       f"{json.dumps(messages)[:60]}")  # fmt: skip
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")


def _check_message(message, where: str) -> None:
    if not isinstance(message, dict):
        raise RequestError(where, f"{where} must be an object with role and content, got {message!r:.60}")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r:.40}")
    content = message.get("content")
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return
        raise RequestError(f"{where}.content", f"{where}.content is required (a string or a list of text parts)")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    _check_text_parts(content, f"{where}.content")


def _check_text_parts(content: list, where: str) -> None:
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(here, f"{here} must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                                     f"this server takes text only, got {kind!r:.40}")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{here}.text", f"{here}.text must be a string")


def _check_stop(stop) -> None:
    if stop is None or (isinstance(stop, str) and stop):
        return
    ok = isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop)
    if not ok:
        raise RequestError("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty "
                                   f"strings, got {json.dumps(stop)[:60]}")  # fmt: skip


def _check_generation_config(value) -> None:
    if value is None:
        return
    try:
        data = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise RequestError("generation_config", "generation_config must be a string holding a JSON object "
                                                "(transformers' GenerationConfig fields)")  # fmt: skip
    from transformers import GenerationConfig

    try:
        GenerationConfig(**data).validate(strict=True)
    except Exception as exc:  # GenerationConfig raises ValueError, TypeError... on bad fields
        raise RequestError("generation_config", f"generation_config is not a valid GenerationConfig: {exc}") from None


def check(path: str, body: dict, limits: Limits = Limits()) -> None:
    """Raise :class:`RequestError` naming the first wrong field of a chat (``path`` :data:`CHAT`) or completions
    (:data:`COMPLETIONS`) request body; return None when every field is of its type and in its range."""
    chat = path == CHAT
    known = _NO_EFFECT | _COMMON | (_CHAT_ONLY if chat else _TEXT_ONLY)
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(unknown[0], f"unrecognized request argument: {unknown[0]} (not a field of {path} here)")
    if chat:
        _check_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError("prompt", "prompt is required: a non-empty string")
        if not isinstance(prompt, str):
            raise RequestError("prompt", "prompt must be a string (lists of prompts and token ids are not supported)")
        if not prompt:
            raise RequestError("prompt", "prompt must not be empty")
        if body.get("suffix") is not None and not isinstance(body["suffix"], str):
            raise RequestError("suffix", "suffix must be a string")
    for name in ("max_tokens", "max_completion_tokens"):
        _integer(body, name, 1, what="a positive integer")
    _number(body, "temperature", 0.0, math.inf, what="a number >= 0 (0 is greedy)")
    _number(body, "top_p", 0.0, 1.0, lo_open=True)
    _integer(body, "top_k", -1, what="an integer >= 1 (-1 or 0: no top-k)")
    _number(body, "min_p", 0.0, 1.0)
    _integer(body, "n", 1, limits.max_n, what=f"an integer from 1 to {limits.max_n} (the server's --max-n)")
    if body.get("seed") is not None and not _is_int(body["seed"]):
        raise RequestError("seed", f"seed must be an integer, got {body['seed']!r}")
    _check_stop(body.get("stop"))
    for name in ("stream", "ignore_eos"):
        _boolean(body, name)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise RequestError("stream_options", "stream_options must be an object like {\"include_usage\": true}")
    if chat:
        _boolean(body, "logprobs")
        top = limits.max_logprobs
        _integer(body, "top_logprobs", 0, top, what=f"an integer from 0 to {top} (the server's --max-logprobs)")
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        top = limits.max_logprobs
        _integer(body, "logprobs", 0, top, what=f"an integer from 0 to {top} (the server's --max-logprobs)")
    _check_generation_config(body.get("generation_config"))
    if chat and body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
        raise RequestError("chat_template_kwargs", "chat_template_kwargs must be an object")
    if chat and body.get("tools") is not None and not isinstance(body["tools"], list):
        raise RequestError("tools", "tools must be a list of tool definitions")
    _check_unsupported(body, chat)


_RESPONSES_FIELDS = {
    "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
    "stream", "stream_options", "tools", "tool_choice", "generation_config", "chat_template_kwargs", "text",
    "truncation", "previous_response_id",
    "background", "include", "reasoning", "max_tool_calls", "prompt", "top_logprobs", "conversation",
}  # fmt: skip
_RESPONSES_UNSUPPORTED = ("previous_response_id", "reasoning", "max_tool_calls", "prompt", "conversation")


def _check_input(value) -> None:
    """``/v1/responses``'s ``input``: a non-empty string, a list of text parts, or a list of items (messages with a
    role, ``function_call``, ``function_call_output``, ``reasoning``), as transformers' handler reads them."""
    if value is None:
        raise RequestError("input", "input is required: a string, or a list of messages ({role, content})")
    if isinstance(value, str):
        if not value:
            raise RequestError("input", "input must not be empty")
        return
    if not isinstance(value, list) or not value:
        raise RequestError("input", f"input must be a non-empty string or a non-empty list of messages, got "
                                    f"{json.dumps(value)[:60]}")  # fmt: skip
    if isinstance(value[0], dict) and "role" not in value[0] and value[0].get("type") in _TEXT_PARTS:
        _check_text_parts(value, "input")  # one user message's content parts
        return
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" or (isinstance(item, dict) and "role" in item):
            _check_message(item, where)
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise RequestError(f"{where}.{name}", f"{where}.{name} must be a string (a function_call item)")
        elif kind == "function_call_output":
            for name in ("call_id", "output"):
                if not isinstance(item.get(name), str):
                    raise RequestError(f"{where}.{name}", f"{where}.{name} must be a string (a "
                                                          "function_call_output item)")  # fmt: skip
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):  # fmt: skip
                raise RequestError(f"{where}.content", f"{where}.content must be a list of {{\"text\": ...}} parts")
        else:
            raise RequestError(where, f"{where} must be a message ({{role, content}}), a function_call, a "
                                      f"function_call_output or a reasoning item; got {item!r:.60}")  # fmt: skip


def check_responses(body: dict, limits: Limits = Limits()) -> None:
    """Raise :class:`RequestError` naming the first wrong field of a ``POST /v1/responses`` body (OpenAI's Responses
    API: ``input`` and ``instructions``, ``max_output_tokens``, the sampling fields as chat takes them, ``stream``,
    ``tools``); return None when the request can be answered as chat answers it."""
    known = _NO_EFFECT | _RESPONSES_FIELDS
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(unknown[0], f"unrecognized request argument: {unknown[0]} (not a field of {RESPONSES} "
                                       "here)")  # fmt: skip
    _check_input(body.get("input"))
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise RequestError("instructions", "instructions must be a string")
    _integer(body, "max_output_tokens", 1, what="a positive integer")
    _number(body, "temperature", 0.0, math.inf, what="a number >= 0 (0 is greedy)")
    _number(body, "top_p", 0.0, 1.0, lo_open=True)
    _integer(body, "top_k", -1, what="an integer >= 1 (-1 or 0: no top-k)")
    _number(body, "min_p", 0.0, 1.0)
    if body.get("seed") is not None and not _is_int(body["seed"]):
        raise RequestError("seed", f"seed must be an integer, got {body['seed']!r}")
    for name in ("stream", "background", "ignore_eos"):
        _boolean(body, name)
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise RequestError("stream_options", "stream_options must be an object")
    _check_generation_config(body.get("generation_config"))
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise RequestError("tools", "tools must be a list of tool definitions")
    if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
        raise RequestError("chat_template_kwargs", "chat_template_kwargs must be an object")
    if body.get("tool_choice") not in (None, "auto"):
        raise _unsupported("tool_choice", " (only \"auto\")")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else body.get("text")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _unsupported("text", " (only {\"format\": {\"type\": \"text\"}})")
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", " (only \"disabled\")")
    if body.get("background"):
        raise _unsupported("background", ": answers are streamed or returned whole")
    if body.get("include"):
        raise _unsupported("include")
    _integer(body, "top_logprobs", 0, 0, what="0 (log-probabilities are not returned by /v1/responses here)")
    for name in _RESPONSES_UNSUPPORTED:
        if body.get(name) is not None:
            raise _unsupported(name)


def _check_penalties(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, -2.0, 2.0)
    _number(body, "repetition_penalty", 0.0, 2.0, lo_open=True)
    _integer(body, "min_tokens", 0)
    wanted = body.get("max_completion_tokens") or body.get("max_tokens")
    if body.get("min_tokens") is not None and wanted is not None and body["min_tokens"] > wanted:
        raise RequestError("min_tokens", f"min_tokens ({body['min_tokens']}) must not exceed max_tokens ({wanted})")
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise RequestError("logit_bias", "logit_bias must be an object mapping token ids to biases from -100 to 100")
    for token, value in bias.items():
        if not (isinstance(token, str) and token.isdigit()):
            raise RequestError("logit_bias", f"logit_bias keys must be token ids (digit strings), got {token!r:.40}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise RequestError("logit_bias", f"logit_bias[{token}] must be a number from -100 to 100, got {value!r}")


def check_vocab(body: dict, vocab: int) -> None:
    """Raise :class:`RequestError` when ``logit_bias`` names a token past the model's ``vocab``."""
    past = sorted(int(t) for t in body.get("logit_bias") or {} if int(t) >= vocab)
    if past:
        raise RequestError("logit_bias", f"logit_bias names token {past[0]}, past the model's vocabulary of {vocab}")


def _check_unsupported(body: dict, chat: bool) -> None:
    _check_penalties(body)
    if chat:
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise _unsupported("response_format", " (only {\"type\": \"text\"})")
        if body.get("tool_choice") not in (None, "auto"):
            raise _unsupported("tool_choice", " (only \"auto\")")
        for name in _UNSUPPORTED_UNLESS_NONE:
            if body.get(name) is not None:
                raise _unsupported(name)
    else:
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            raise _unsupported("best_of", " (only best_of equal to n)")
        if body.get("echo"):
            raise _unsupported("echo")


@dataclass
class Sampling:
    """What one request asks of the continuous batch (after :func:`check`), per choice.

    ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 filter nothing. ``seed`` None: a random
    seed per request. ``max_tokens``: the request's, else the base config's ``max_new_tokens``; None: up to the
    model's context. ``eos_token_id`` None: no end of sequence.
    ``logprobs``: return the chosen token's log-probability; ``top_logprobs``: and that many alternatives.
    ``repetition_penalty`` (the base config's when the request has none), ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias`` (token id -> bias), ``min_tokens``: neutral at 1, 0, 0, ``{}``, 0.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    max_tokens: int | None = None
    eos_token_id: Any = None
    include_usage: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)
    min_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _asked_penalties(body: dict) -> tuple[str, ...]:
    """The penalty fields a request sets to other than their neutral value (the model's defaults are not asked)."""
    neutral = {"repetition_penalty": 1}
    return tuple(n for n in PENALTIES if body.get(n) not in (None, {}, neutral.get(n, 0)))


def _positive(value, default):
    return value if value is not None else default


def resolve(path: str, body: dict, model_config) -> Sampling:
    """The :class:`Sampling` of a checked body: the request's values, else the base generation config's (the
    body's ``generation_config`` when given, else ``model_config``, the model's)."""
    from transformers import GenerationConfig

    chat = path == CHAT
    base = GenerationConfig(**json.loads(body["generation_config"])) if body.get("generation_config") else model_config
    if body.get("temperature") is not None:
        temperature = float(body["temperature"])
    else:
        temperature = float(_positive(base.temperature, 1.0)) if base.do_sample else 0.0
    top_k = body.get("top_k")
    top_k = int(_positive(base.top_k, 0)) if top_k is None else top_k
    if chat:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        logprobs, top_logprobs = bool(body.get("logprobs")), int(body.get("top_logprobs") or 0)
    else:
        max_tokens = body.get("max_tokens")
        count = body.get("logprobs")
        logprobs, top_logprobs = count is not None, int(count or 0)
    if max_tokens is None:
        max_tokens = base.max_new_tokens
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    options = body.get("stream_options") or {}
    return Sampling(
        temperature=temperature,
        top_p=float(_positive(body.get("top_p"), _positive(base.top_p, 1.0))),
        top_k=max(int(top_k), 0),
        min_p=float(_positive(body.get("min_p"), _positive(base.min_p, 0.0))),
        seed=body.get("seed"),
        n=int(body.get("n") or 1),
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        max_tokens=max_tokens,
        eos_token_id=None if body.get("ignore_eos") else base.eos_token_id,
        include_usage=bool(options.get("include_usage")),
        repetition_penalty=float(_positive(body.get("repetition_penalty"), _positive(base.repetition_penalty, 1.0))),
        presence_penalty=float(body.get("presence_penalty") or 0.0),
        frequency_penalty=float(body.get("frequency_penalty") or 0.0),
        logit_bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()},
        min_tokens=int(body.get("min_tokens") or _positive(base.min_new_tokens, 0)),
        extra={"penalties": _asked_penalties(body)},
    )
