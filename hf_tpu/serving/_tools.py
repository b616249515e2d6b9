"""Tool calls of ``/v1/chat/completions`` for the chat-template families transformers has no response template for,
and the grammar that makes ``tool_choice`` ``"required"`` or a named function always end in a call.

transformers parses tool calls by a model's response template (``transformers.cli.serving.utils``: Qwen 2/3 by
``model_type``, Qwen 3.5, Gemma 4, or a template the tokenizer ships); a model of another ``model_type`` whose chat
template writes calls in a known format (a Llama 3.x model, a Hermes fine-tune of Llama or Mistral...) would get its
calls back as text. So, as vLLM's ``--tool-call-parser``, each format this module knows is one :class:`ToolFormat`
entry of :data:`FORMATS`: how its chat template is recognised, a streaming parser of a reply (text in, content and
:class:`Call` out) and the Lark grammar of one call. ``hf-tpu serve`` picks the format from the chat template's text
(:func:`detect`) unless ``--tool-call-parser NAME`` names one.

``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` is a promise of a call, which
a model's own choice cannot keep: :func:`grammar` builds the llguidance grammar of the format's call (its markers
around a JSON object whose ``name`` is one of the tools and whose arguments follow that tool's ``parameters``
schema; one call, or one or more with ``parallel_tool_calls``), which the request is decoded under
(:attr:`hf_tpu.serving._openai.Sampling.grammar`).

Example:
    >>> from hf_tpu.serving._tools import parse
    >>> reply = 'Let me look.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
    >>> content, calls = parse("hermes", reply)
    >>> content, calls[0].name, calls[0].arguments
    ('Let me look.', 'f', '{"x": 1}')
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from hf_tpu.serving._openai import RequestError

__all__ = ["AUTO", "Call", "FORMATS", "FUNCTION", "NONE", "Plan", "REQUIRED", "ToolFormat", "choice_of", "detect",
           "grammar", "parse", "parser", "plan"]  # fmt: skip

AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"


class Call(NamedTuple):
    """One parsed tool call: the function's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str


def choice_of(tool_choice: Any) -> tuple[str, str | None]:
    """``(mode, function name)`` of a checked ``tool_choice``: ``auto`` (also when absent), ``none``, ``required``,
    or ``function`` with the name it forces."""
    if isinstance(tool_choice, dict):
        return FUNCTION, tool_choice["function"]["name"]
    return (tool_choice or AUTO), None


def _call(name: Any, arguments: Any) -> Call | None:
    """A :class:`Call` of a parsed object's name and arguments, or None when they are not a name and an object (or a
    string holding one, as some models write them)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return Call(name, json.dumps(arguments, ensure_ascii=False))


class _Parser(ABC):
    """A streaming parser of one reply: :meth:`feed` the text as it is decoded, then :meth:`finish`; each returns
    the items ready to send, content text (``str``) and :class:`Call`. ``drop``: strings taken out of the content
    (the tokenizer's special tokens, when the reply is decoded with them)."""

    def __init__(self, drop: tuple[str, ...] = ()) -> None:
        self.drop = tuple(d for d in drop if d)
        self.buffer = ""

    def _content(self, text: str) -> list:
        for d in self.drop:
            text = text.replace(d, "")
        return [text] if text else []

    @abstractmethod
    def feed(self, text: str) -> list:
        """The items ready once ``text`` (the next piece of the reply) is read."""

    @abstractmethod
    def finish(self) -> list:
        """The items left once the reply has ended."""


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (kept back until the next piece)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class HermesParser(_Parser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro, Qwen 2 and 3, and their
    fine-tunes), any number of them, with content before, between or after. A call whose JSON does not parse stays
    in the content as written."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, drop: tuple[str, ...] = ()) -> None:
        super().__init__(drop)
        self.inside = False

    def feed(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    keep = _held(self.buffer, self.OPEN)
                    out += self._content(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                out += self._content(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(self.OPEN) :], True
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                return out
            out += self._close(self.buffer[:at])
            self.buffer, self.inside = self.buffer[at + len(self.CLOSE) :], False

    def _close(self, body: str) -> list:
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        call = _call(value.get("name"), value.get("arguments", value.get("parameters"))) \
            if isinstance(value, dict) else None  # fmt: skip
        return [call] if call is not None else self._content(f"{self.OPEN}{body}{self.CLOSE}")

    def finish(self) -> list:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return self._content(rest)
        self.inside = False
        try:  # a call the reply ended in without its close marker (cut at an end of sequence or a stop string)
            value = json.loads(rest)
        except ValueError:
            value = None
        call = _call(value.get("name"), value.get("arguments")) if isinstance(value, dict) else None
        return [call] if call is not None else self._content(self.OPEN + rest)


class Llama3JsonParser(_Parser):
    """Llama 3.x's JSON calls: a reply that is (after ``<|python_tag|>``, when it was decoded) one JSON object
    ``{"name": ..., "parameters": {...}}``, or several separated by ``;``. A reply that starts otherwise, or does
    not parse whole, is content. Calls are known only at the end (the reply is held until then)."""

    TAG = "<|python_tag|>"

    def __init__(self, drop: tuple[str, ...] = ()) -> None:
        super().__init__(tuple(d for d in drop if d != self.TAG))
        self.calls: bool | None = None  # undecided until the reply's first non-blank characters

    def feed(self, text: str) -> list:
        self.buffer += text
        if self.calls is None:
            head = self.buffer.lstrip()
            if not head or (len(head) < len(self.TAG) and self.TAG.startswith(head)):
                return []
            self.calls = head.startswith("{") or head.startswith(self.TAG)
        if self.calls:
            return []
        out, self.buffer = self._content(self.buffer), ""
        return out

    def finish(self) -> list:
        rest, self.buffer = self.buffer, ""
        if not self.calls:
            return self._content(rest)
        calls = self._calls(rest)
        return calls if calls else self._content(rest)

    def _calls(self, text: str) -> list[Call]:
        for d in self.drop:
            text = text.replace(d, "")
        text = text.strip().removeprefix(self.TAG).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                return []
            call = _call(value.get("name"), value.get("parameters", value.get("arguments"))) \
                if isinstance(value, dict) else None  # fmt: skip
            if call is None:
                return []
            calls.append(call)
            rest = text[at:].lstrip()
            if rest and not rest.startswith(";"):
                return []
            at = len(text) - len(rest.removeprefix(";").lstrip())
        return calls


# ----- the grammar of a forced call -----


def _call_schema(tool: dict, arguments_key: str) -> dict:
    """The JSON schema of one call of ``tool`` (a chat ``tools`` entry): its name, then its arguments."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}  # fmt: skip


#: A forced call's JSON is written as the chat templates write calls (``tojson``: ", " and ": ", no other
#: whitespace), so that the model continues in the layout it was trained on and a call's length is bounded.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _hermes_lark(schema: dict, parallel: bool) -> str:
    call = 'call: "<tool_call>\\n" %json ' + json.dumps(schema) + ' "\\n</tool_call>"'
    return ('start: call ("\\n" call)*\n' if parallel else "start: call\n") + call + "\n"


def _llama3_lark(schema: dict, parallel: bool) -> str:
    call = "call: %json " + json.dumps(schema)
    return ('start: call ("; " call)*\n' if parallel else "start: call\n") + call + "\n"


@dataclass(frozen=True)
class ToolFormat:
    """One family of chat templates' tool-call format (see the module docstring).

    ``detect``: whether a chat template's text writes calls this way; ``parser``: its streaming parser class;
    ``arguments``: the key of a call's arguments; ``lark``: the Lark grammar of its calls from the JSON schema of
    one call and whether several may follow one another.
    """

    name: str
    detect: Callable[[str], bool]
    parser: type
    arguments: str
    lark: Callable[[dict, bool], str]
    markers: tuple[str, ...] = field(default=())


def _is_hermes(template: str) -> bool:
    return "<tool_call>" in template and "<function=" not in template  # (Qwen 3.5's XML calls are not JSON)


def _is_llama3(template: str) -> bool:
    return "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template)


#: The tool-call formats hf_tpu parses itself, by ``--tool-call-parser`` name (vLLM's names), in detection order.
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", _is_hermes, HermesParser, "arguments", _hermes_lark, ("<tool_call>",)),
    "llama3_json": ToolFormat("llama3_json", _is_llama3, Llama3JsonParser, "parameters", _llama3_lark,
                              ("<|python_tag|>",)),
}  # fmt: skip


def detect(chat_template: str | dict | None) -> str | None:
    """The name of the :data:`FORMATS` entry a chat template writes tool calls in, or None (a dict of named
    templates, as some tokenizers have: their texts together)."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(v) for v in chat_template.values())
    if not chat_template:
        return None
    return next((name for name, fmt in FORMATS.items() if fmt.detect(chat_template)), None)


def parser(name: str, drop: tuple[str, ...] = ()) -> _Parser:
    """A fresh streaming parser of format ``name`` (one per choice)."""
    return FORMATS[name].parser(drop)


def parse(name: str, text: str, drop: tuple[str, ...] = ()) -> tuple[str, list[Call]]:
    """``(content, calls)`` of a whole reply in format ``name`` (content stripped of blanks at both ends)."""
    p = parser(name, drop)
    items = p.feed(text) + p.finish()
    return "".join(i for i in items if isinstance(i, str)).strip(), [i for i in items if isinstance(i, Call)]


def grammar(name: str, tools: list[dict], tool_choice: Any, parallel: bool) -> str:
    """The llguidance grammar that a reply with ``tool_choice`` ``"required"`` or a named function is decoded
    under: format ``name``'s markers around a call of one of ``tools`` (the named one), its arguments following
    that tool's ``parameters`` schema; one or more calls when ``parallel`` (a named function: one).

    Raises:
        RequestError: llguidance cannot compile a tool's ``parameters`` schema (400 naming ``tools``).
    """
    import llguidance

    mode, forced = choice_of(tool_choice)
    fmt = FORMATS[name]
    chosen = [t for t in tools if mode != FUNCTION or t["function"]["name"] == forced]
    schemas = [_call_schema(t, fmt.arguments) for t in chosen]
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = _COMPACT
    try:
        text = llguidance.LLMatcher.grammar_from_lark(fmt.lark(schema, parallel and mode == REQUIRED))
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError, RuntimeError... on what it cannot read
        failed, messages = True, [str(exc)]
    if failed:
        raise RequestError("tools", "a tool's parameters are not a JSON schema hf-tpu serve can decode a forced call "
                                    f"under: {'; '.join(messages)[:300]}")  # fmt: skip
    return text


# ----- what one chat request does with its tools -----


@dataclass(frozen=True)
class Plan:
    """How one chat request's reply is parsed and decoded (:func:`plan`).

    ``fmt``: the :data:`FORMATS` entry hf_tpu parses the reply with, or None; ``upstream``: transformers' response
    template parses it (content, reasoning, calls) instead; neither: the reply is text. ``grammar``: what the reply
    is decoded under (a forced call), or None. ``parallel``: several calls may be returned (else the first alone).
    ``skip_special``: the reply is decoded without special tokens; ``drop``: the special tokens taken out of its
    content when it is decoded with them (a format whose markers are special tokens).
    """

    fmt: str | None = None
    upstream: bool = False
    grammar: str | None = None
    parallel: bool = True
    skip_special: bool = True
    drop: tuple[str, ...] = ()


def plan(body: dict, processor, has_response_template: bool, override: str | None = None) -> Plan:
    """The :class:`Plan` of a checked chat ``body`` for a model whose tokenizer or processor is ``processor``.

    Without tools, or with ``tool_choice`` ``"auto"``: transformers' response template where the model has one
    (``has_response_template``), else the format :func:`detect` reads in the chat template; ``override`` (the
    server's ``--tool-call-parser``) replaces both. ``"none"``: the tools are rendered, the reply is not parsed for
    calls (vLLM's default). ``"required"`` or a named function: parsed as with ``"auto"``, decoded under the
    grammar of the format ``override`` names, else the detected one.

    Raises:
        RequestError: a forced call for a chat template whose call format hf_tpu does not know (400 naming
            ``tool_choice``), or tools whose schema llguidance cannot compile (``tools``).
    """
    tools = body.get("tools") or None
    mode, _ = choice_of(body.get("tool_choice"))
    parallel = body.get("parallel_tool_calls") is not False
    if not tools:
        return Plan(upstream=has_response_template, parallel=parallel, skip_special=not has_response_template)
    if mode == NONE:
        return Plan(parallel=parallel)
    tokenizer = getattr(processor, "tokenizer", processor)
    detected = override or detect(getattr(processor, "chat_template", None) or tokenizer.chat_template)
    forced = None
    if mode in (REQUIRED, FUNCTION):
        if detected is None:
            known = ", ".join(FORMATS)
            raise RequestError("tool_choice", f"tool_choice {mode} needs the model's tool-call format, and its chat "
                                              f"template writes calls in none hf-tpu serve knows ({known}): start "
                                              "the server with --tool-call-parser NAME, or send tool_choice auto")
        forced = grammar(detected, tools, body.get("tool_choice"), parallel)
    if has_response_template and override is None:
        return Plan(upstream=True, grammar=forced, parallel=parallel, skip_special=False)
    if detected is None:
        return Plan(parallel=parallel)
    specials = tuple(getattr(tokenizer, "all_special_tokens", ()) or ())
    marked = any(m in specials for m in FORMATS[detected].markers)
    return Plan(fmt=detected, grammar=forced, parallel=parallel, skip_special=not marked,
                drop=specials if marked else ())  # fmt: skip
