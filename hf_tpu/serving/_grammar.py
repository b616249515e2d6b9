"""Structured output in the compiled continuous-batching step: a request's grammar masks its tokens on the device.

vLLM's ``response_format`` (``json_object``, ``json_schema``) and its ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and ``structured_outputs`` extras each become one grammar (:func:`grammar_of`),
in llguidance's format (the grammar library hf_tpu uses: docs/serving.md "Structured output" says why, with the
measurement). A request carries it as its ``grammar`` kwarg; upstream's manager keeps it in the request's
``logit_processor_kwargs``. Per step:

* on the host, in :meth:`hf_tpu.serving._sampling.RowSampling.prepare_tensor_args` (where every other per-row value
  of the step is written), each row of a request with a grammar has its matcher (``llguidance.LLMatcher``, one per
  request and choice, made at its first step) advanced by the tokens the request generated since (read back by the
  step before, as every step's tokens are), and its next-token bitmask computed into row ``i`` of a host buffer
  (:meth:`GrammarRows.prepare`, the rows computed in parallel in llguidance's threads, off the GIL); the buffer
  goes to the device in one copy, only on steps with such a row;
* on the device, inside the step graph, :func:`allowed` unpacks each row's bitmask and the scores of the tokens it
  forbids become ``-inf`` after the penalties and before sampling, on the rows whose ``grammar`` argument
  (:data:`hf_tpu.serving._sampling.ROWS`) is 1. A step without such a row runs the same graph (no new shape, no
  compile): the flag is data.

A request with a grammar takes the per-step path of the loop (:mod:`hf_tpu.serving._chunks`: its next mask needs its
last token), so its tokens cost no extra round trip: one read-back per step, as upstream's loop does; the other
requests of the step are unaffected in what they produce. The log-probabilities a request asks for stay those of the
raw logits (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from hf_tpu.errors import InvalidArgumentError, SetupError

__all__ = ["GrammarRows", "allowed", "check", "grammar_of", "llguidance_tokenizer"]

#: vLLM's guided-decoding fields hf-tpu serve reads, and the keys of its ``structured_outputs`` object.
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
#: ``guided_decoding_backend`` values this server takes (it has one backend, llguidance).
BACKENDS = (None, "", "auto", "guidance", "llguidance")


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # (an optional extra: structured output needs it, nothing else does)
        raise SetupError(
            "structured output (response_format, guided_*, tool_choice 'required') needs llguidance: "
            "pip install 'hf_tpu[serve]'"
        ) from exc
    return llguidance


def _settings():
    from hf_tpu.serving._runner import SETTINGS

    return SETTINGS


def _schema(value: Any, field: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidArgumentError(f"{field}: not a JSON schema ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{field}: a JSON schema is an object, got {type(value).__name__}")
    return value


def _choice_lark(choices: Any, field: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgumentError(f"{field}: a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def grammar_of(body: dict) -> tuple[str | None, str | None]:
    """``(grammar, field)``: the llguidance grammar a request body asks for and the field it came from, or
    ``(None, None)``. At most one of ``response_format`` (not ``text``), :data:`GUIDED` and ``structured_outputs``
    may be given; what llguidance cannot turn into a grammar is an :class:`~hf_tpu.errors.InvalidArgumentError`
    naming the field."""
    try:
        return _grammar_of(body)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # llguidance's own errors (its GBNF converter's are none of the builtin kinds)
        raise InvalidArgumentError(f"not a grammar llguidance can build: {exc}") from None


def _grammar_of(body: dict) -> tuple[str | None, str | None]:
    asked = {}
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        asked["response_format"] = fmt
    for name in GUIDED:
        if body.get(name) is not None:
            asked[name] = body[name]
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise InvalidArgumentError("structured_outputs: an object with one of json, regex, choice, grammar")
        keys = [k for k, v in structured.items() if v is not None]
        unknown = [k for k in keys if k not in _STRUCTURED]
        if unknown or len(keys) != 1:
            raise InvalidArgumentError(f"structured_outputs: exactly one of {', '.join(_STRUCTURED)} (got "
                                       f"{', '.join(keys) or 'none'})")  # fmt: skip
        asked["structured_outputs"] = (_STRUCTURED[keys[0]], structured[keys[0]])
    if len(asked) > 1:
        raise InvalidArgumentError(f"{' and '.join(asked)}: one structured-output constraint per request")
    if not asked:
        return None, None
    (field, value), = asked.items()  # fmt: skip
    ll = _llguidance().LLMatcher
    options: dict[str, Any] = {"whitespace_flexible": bool(_settings().json_whitespace)}
    if body.get("guided_whitespace_pattern") is not None:
        options = {"whitespace_pattern": body["guided_whitespace_pattern"]}
    from_schema = functools.partial(ll.grammar_from_json_schema, defaults=options)
    if field == "response_format":
        if value["type"] == "json_object":
            return from_schema({"type": "object"}), field
        spec = value.get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise InvalidArgumentError("response_format: json_schema needs its 'schema'")
        return from_schema(_schema(schema, field)), field
    kind = field
    if field == "structured_outputs":
        kind, value = value
    if kind == "guided_json":
        return from_schema(_schema(value, field)), field
    if kind == "guided_regex":
        if not isinstance(value, str):
            raise InvalidArgumentError(f"{field}: a regular expression string")
        return ll.grammar_from_regex(value), field
    if kind == "guided_choice":
        return ll.grammar_from_lark(_choice_lark(value, field)), field
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{field}: a grammar (Lark, or GBNF) string")
    from llguidance.gbnf_to_lark import any_to_lark  # (Lark as it is; GBNF, llama.cpp's, converted)

    return ll.grammar_from_lark(any_to_lark(value)), field


_TOKENIZERS: dict[tuple[int, int], Any] = {}


def llguidance_tokenizer(tokenizer, vocab: int):
    """llguidance's tokenizer of a transformers fast tokenizer, its masks ``vocab`` wide (the model's logits; built
    once per tokenizer, about a second for a 150k vocabulary)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # (a processor's)
    key = (id(tok), int(vocab))
    found = _TOKENIZERS.get(key)
    if found is None:
        from llguidance.hf import from_tokenizer

        found = _TOKENIZERS[key] = (tok, from_tokenizer(tok, n_vocab=int(vocab)))  # (kept: the id stays its own)
    return found[1]


def check(grammar: str, ll_tokenizer, field: str) -> None:
    """Raise :class:`~hf_tpu.errors.InvalidArgumentError` (a 400 naming ``field``) when llguidance cannot compile
    ``grammar`` for the model's tokenizer."""
    ll = _llguidance()
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        raise InvalidArgumentError(f"{field}: the grammar does not compile: {messages[0] if messages else '?'}")


def allowed(masks: torch.Tensor, flags: torch.Tensor, vocab: int) -> torch.Tensor:
    """In the graph: ``[rows, vocab]`` bool, True where row ``i`` may choose the token: bit ``t % 32`` of word
    ``t // 32`` of ``masks[i]`` (llguidance's bitmask layout), or any token where ``flags[i]`` is 0."""
    rows = flags.shape[0]
    ids = torch.arange(vocab, device=masks.device)
    words = masks[:rows].index_select(1, ids >> 5)
    bits = torch.bitwise_and(torch.bitwise_right_shift(words, (ids & 31).to(words.dtype)), 1)
    return (bits != 0) | (flags[:, None] == 0)


class GrammarRows:
    """The grammar state of a continuous-batching manager: each constrained request's matcher, a host buffer of one
    bitmask per row of the step, and the device tensor the step graph reads (``masks``, ``[slots, words]`` int32,
    allocated once so that the graph's inputs never change)."""

    def __init__(self, slots: int, vocab: int, device) -> None:
        self.slots, self.vocab = int(slots), int(vocab)
        self.words = (self.vocab + 31) // 32
        self.masks = torch.full((self.slots, self.words), -1, dtype=torch.int32, device=device)
        self.host = torch.full((self.slots, self.words), -1, dtype=torch.int32)
        self.tokenizer = None  # llguidance's, set by the server (attach) before its first request with a grammar
        self.matchers: dict[str, list] = {}  # request id -> [matcher, tokens consumed]
        self._executor = None
        self.masked_steps = 0

    def attach(self, ll_tokenizer) -> None:
        self.tokenizer = ll_tokenizer

    def _matcher(self, request_id: str, grammar: str) -> list:
        entry = self.matchers.get(request_id)
        if entry is None:
            if self.tokenizer is None:
                raise InvalidArgumentError(
                    "a request with a grammar reached a manager without a tokenizer for it: call "
                    "hf_tpu.serving._grammar.attach(manager, tokenizer) first"
                )
            ll = _llguidance()
            matcher = ll.LLMatcher(self.tokenizer, grammar)
            if matcher.is_error():
                raise InvalidArgumentError(f"the request's grammar does not compile: {matcher.get_error()}")
            entry = self.matchers[request_id] = [matcher, 0]
        return entry

    def prepare(self, rows: list[tuple[int, str, str, list[int]]], live) -> None:
        """Compute the bitmask of each ``(step row, request id, grammar, generated tokens)`` into the host buffer
        (each matcher first consumes the tokens its request generated since its last step) and copy the buffer to
        the device; drop the matchers of requests not in ``live``."""
        for request_id in [r for r in self.matchers if r not in live]:
            del self.matchers[request_id]
        if not rows:
            return
        ll = _llguidance()
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        batch = []
        for row, request_id, grammar, generated in rows:
            entry = self._matcher(request_id, grammar)
            matcher, seen = entry
            if len(generated) > seen:
                matcher.consume_tokens(generated[seen:])  # (a token the mask allowed: an error state only if not)
                entry[1] = len(generated)
            batch.append((matcher, row))
        if len(batch) == 1:
            fill_next_token_bitmask(batch[0][0], self.host, batch[0][1])
        else:
            if self._executor is None:
                self._executor = ll.LLExecutor()
            fill_next_token_bitmask_par(self._executor, batch, self.host)
        self.masks.copy_(self.host.to(self.masks.device))  # one host->device copy, on steps with a grammar only
        self.masked_steps += 1


def attach(manager, tokenizer) -> None:
    """Give ``manager``'s grammar rows the llguidance tokenizer of ``tokenizer`` (the model's; hf-tpu serve does this
    for its manager). Raises :class:`~hf_tpu.errors.InvalidArgumentError` when the manager has no grammar rows
    (async batching, a model off TPU)."""
    sampler = getattr(manager, "logit_processor", None)  # (hf_tpu.serving._sampling.RowSampling's: grammar rows)
    if getattr(sampler, "grammar", None) is None:
        raise InvalidArgumentError("structured output needs hf_tpu's row sampling (a tpu model, async batching off)")
    if sampler.grammar.tokenizer is None:
        sampler.grammar.attach(llguidance_tokenizer(tokenizer, sampler.grammar.vocab))
