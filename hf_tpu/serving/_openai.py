"""The OpenAI errors and limits of ``hf-tpu serve``, and the sampling settings a checked request resolves to.

Bodies are checked by the request models of :mod:`hf_tpu.serving.protocol` (pydantic: every field typed and bounded
by what the compiled step holds), which raise :class:`RequestError` (HTTP 400 in OpenAI's error shape, ``param`` the
field). :func:`resolve` then turns a checked chat or completions body into the :class:`Sampling` of the request: the
request's values, else the model's generation config (or the body's ``generation_config``, transformers' own
extension), as transformers' server would; a temperature below :data:`GREEDY_BELOW` is greedy (vLLM's rule: a
smaller one overflows the scaled logits in float32). ``/v1/responses`` is run as the chat request it amounts to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import InvalidArgumentError, UserError

__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "GREEDY_BELOW", "Limits", "PENALTIES", "RESPONSES", "RequestError",
           "ROLES", "Sampling", "check_vocab", "resolve"]  # fmt: skip

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
ROLES = ("system", "developer", "user", "assistant", "tool")
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
#: A temperature below this is greedy (vLLM's ``_SAMPLING_EPS``): logits divided by less overflow float32.
GREEDY_BELOW = 1e-5


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


def check_vocab(body: dict, vocab: int) -> None:
    """Raise :class:`RequestError` when ``logit_bias`` names a token past the model's ``vocab``."""
    past = sorted(int(t) for t in body.get("logit_bias") or {} if int(t) >= vocab)
    if past:
        raise RequestError("logit_bias", f"logit_bias names token {past[0]}, past the model's vocabulary of {vocab}")


@dataclass
class Sampling:
    """What one request asks of the continuous batch (after :func:`hf_tpu.serving.protocol.validate`), per choice.

    ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 filter nothing. ``seed`` None: a random
    seed per request. ``max_tokens``: the request's, else the base config's ``max_new_tokens``; None: up to the
    model's context. ``eos_token_id`` None: no end of sequence.
    ``logprobs``: return the chosen token's log-probability; ``top_logprobs``: and that many alternatives.
    ``best_of`` (at least ``n``): how many choices are generated, the ``n`` of them with the highest cumulative
    log-probability returned (completions' ``best_of``).
    ``repetition_penalty`` (the base config's when the request has none), ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias`` (token id -> bias), ``min_tokens``: neutral at 1, 0, 0, ``{}``, 0.
    ``grammar``: an llguidance grammar (``llguidance.LLMatcher.grammar_from_lark``'s or ``grammar_from_json_schema``'s
    string) the choice is decoded under, or None: structured output's (:mod:`hf_tpu.serving._grammar`) or a forced tool
    call's (:func:`hf_tpu.serving._tools.grammar`).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    best_of: int = 1
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
    grammar: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def scored(self) -> bool:
        """Whether the generated tokens' log-probabilities are read back: asked for, or ranking ``best_of``."""
        return self.logprobs or self.best_of > self.n


def _asked_penalties(body: dict) -> tuple[str, ...]:
    """The penalty fields a request sets to other than their neutral value (the model's defaults are not asked)."""
    neutral = {"repetition_penalty": 1}
    return tuple(n for n in PENALTIES if body.get(n) not in (None, {}, neutral.get(n, 0)))


def _grammar_param(body: dict) -> str:
    """The field a structured-output error names: the first constraint the body gives."""
    from hf_tpu.serving._grammar import GUIDED

    for name in ("response_format", *GUIDED, "structured_outputs"):
        if body.get(name) is not None:
            return name
    return "response_format"


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
    if temperature < GREEDY_BELOW:
        temperature = 0.0
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
    from hf_tpu.serving._grammar import grammar_of

    try:
        grammar, grammar_field = grammar_of(body)
    except InvalidArgumentError as exc:
        raise RequestError(_grammar_param(body), str(exc)) from None
    return Sampling(
        temperature=temperature,
        top_p=float(_positive(body.get("top_p"), _positive(base.top_p, 1.0))),
        top_k=max(int(top_k), 0),
        min_p=float(_positive(body.get("min_p"), _positive(base.min_p, 0.0))),
        seed=body.get("seed"),
        n=int(body.get("n") or 1),
        best_of=int(body.get("best_of") or body.get("n") or 1),
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
        grammar=grammar,
        extra={"penalties": _asked_penalties(body), "grammar_field": grammar_field},
    )
