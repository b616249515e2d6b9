"""The request bodies ``hf-tpu serve`` takes, as pydantic models: chat, completions, responses and embeddings.

Every body is validated here before anything else sees it (:func:`validate`, called by the guard), as vLLM's
``protocol`` module and FastAPI do. A wrong body is one :class:`~hf_tpu.serving._openai.RequestError` (HTTP 400 in
OpenAI's error shape) naming the field (``param``: ``messages[2].role``, ``tools[0].function.name``...).

What passes cannot fail the compiled step: each numeric field is bounded by what the step packs it into (int32 for
``top_k``, ``n``, the token counts and token ids; float32's normal range for the floats; int64 for ``seed``, as
vLLM bounds it), strings are strings, lists are lists of what the handler reads. Fields are:

* honoured: OpenAI's sampling fields, ``stop``, ``n``, ``logprobs``, completions' ``echo`` (not streamed; with
  ``logprobs``, the prompt's too; ``max_tokens`` 0 only with it), completions' ``prompt`` as a text, token ids or
  a list of either (a list not streamed) and ``best_of`` (not streamed above ``n``), ``tools`` (rendered by the
  chat template), chat's ``tool_choice`` and ``parallel_tool_calls`` (:mod:`hf_tpu.serving._tools`),
  ``response_format`` and vLLM's ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``/
  ``structured_outputs`` (structured output, :mod:`hf_tpu.serving._grammar`), the penalties, ``logit_bias``,
  ``seed``, ``stream``/``stream_options``, and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
  ``ignore_eos``, ``chat_template_kwargs`` (and transformers' ``generation_config``);
* accepted with no effect on the text (``user``, ``metadata``, ``store``, ...);
* refused with a 400 saying so unless at their neutral value: OpenAI's fields this server does not implement
  (``audio``, ...) and every other field vLLM accepts (``use_beam_search``, ``stop_token_ids``, ``structural_tag``,
  ``priority``, ...);
* anything else: 400 "unrecognized request argument".

Example:
    >>> from hf_tpu.serving.protocol import validate
    >>> validate("/v1/completions", {"prompt": "Hi", "max_tokens": 4}).max_tokens
    4
    >>> validate("/v1/completions", {"prompt": "Hi", "top_k": 2**31})
    Traceback (most recent call last):
    ...
    hf_tpu.serving._openai.RequestError: top_k: must be at most 2147483647 (int32, what the compiled step holds), got 2147483648
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hf_tpu.errors import InvalidArgumentError
from hf_tpu.serving._openai import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, Limits, RequestError

__all__ = ["ChatRequest", "CompletionRequest", "EmbeddingRequest", "FLOAT32_MAX", "FLOAT32_TINY", "INT32_MAX",
           "MAX_DEPTH", "ResponsesRequest", "depth", "validate"]  # fmt: skip

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: float32's largest finite value and its smallest normal one: a float field outside them is not what it says once
#: the step holds it in float32 (inf, or a value that flushes to 0).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
#: JSON nested deeper than this is refused (no field of these APIs needs more; deeper values recurse in the chat
#: template, ``json.dumps``...).
MAX_DEPTH = 64
MAX_STOP = 4  # OpenAI's limit on stop sequences
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses

Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Float = Annotated[float, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Text = Annotated[str, Field(min_length=1)]


class _Model(BaseModel):
    """Strict types (no ``"1"`` for 1, no ``true`` for 1), no NaN or infinity, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=False)


class _Open(BaseModel):
    """An object whose extra keys pass (a JSON schema's keywords, template kwargs)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# ----- messages -----


class TextPart(_Model):
    type: Literal["text", "input_text", "output_text"]
    text: str


def _json_arguments(value: str) -> str:
    """A tool call's ``arguments``: a string holding a JSON object (transformers parses it for the chat template)."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict) or depth(parsed) > MAX_DEPTH:
        raise InvalidArgumentError("must be a string holding a JSON object (the call's arguments)")
    return value


class FunctionCall(_Model):
    name: Text
    arguments: str

    _arguments = field_validator("arguments")(_json_arguments)


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value, info: ValidationInfo):
        calls = info.data.get("tool_calls", True)  # absent from the data: tool_calls failed (that error names it)
        if value is None and not (info.data.get("role") == "assistant" and calls):
            raise InvalidArgumentError("is required (a string or a list of text parts) unless an assistant message has "
                             "tool_calls")  # fmt: skip
        return value


# ----- tools -----


class FunctionDefinition(_Model):
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class ResponsesTool(_Model):
    """The Responses API's flat function tool (``{"type": "function", "name", "parameters"}``)."""

    type: Literal["function"]
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Model):
    name: Text


class NamedToolChoice(_Model):
    """``tool_choice`` naming the function the reply must call."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's: no effect here
    continuous_usage_stats: bool | None = None  # vLLM's: no effect here


class ResponseFormat(_Model):
    """OpenAI's ``response_format``: ``json_schema`` is ``{"name": ..., "schema": {...}, "strict": ...}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema"), dict):
            raise InvalidArgumentError("json_schema needs its 'schema', a JSON schema object")
        return self


# ----- the fields every text endpoint shares -----

#: vLLM's request fields that hf-tpu serve does not implement, with their neutral value (refused unless at it).
VLLM_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "stop_token_ids": [], "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "add_special_tokens": None,
    "structural_tag": None, "priority": 0,
    "request_id": None, "logits_processors": None, "return_tokens_as_token_ids": None, "return_token_ids": None,
    "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None, "mm_processor_kwargs": None,
    "prompt_embeds": None, "thinking_token_budget": None,
}  # fmt: skip
_CHAT_VLLM_UNSUPPORTED = {"add_generation_prompt": True, "continue_final_message": False, "documents": None,
                          "chat_template": None, "include_reasoning": True}  # fmt: skip


def _refuse_unsupported(data: Any, fields: dict[str, Any], where: str) -> Any:
    """Refuse (400 naming it) the first of ``fields`` in ``data`` that is not at its neutral value."""
    if isinstance(data, dict):
        for name, neutral in fields.items():
            if name in data and data[name] is not None and data[name] != neutral:
                raise _Unsupported(name, f"{name} is not supported by hf-tpu serve ({where}); leave it out")
    return data


class _Unsupported(InvalidArgumentError):
    """A field this server does not implement (raised inside a validator; :func:`validate` names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Sampling(_Model):
    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=FLOAT32_MAX)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    generation_config: str | None = None
    parallel_tool_calls: bool | None = None  # (chat: at most one call when false; responses: no effect)
    # no effect on the text
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: str | None) -> str | None:
        if value is not None:
            GenerationFields.parse(value)
        return value


class _Text(_Sampling):
    """Chat and completions: OpenAI's and vLLM's sampling fields."""

    max_tokens: Positive | None = None
    n: Positive | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=FLOAT32_TINY, le=2.0)] | None = None
    min_tokens: Count | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM's structured output (hf_tpu.serving._grammar: one constraint per request, compiled by llguidance)
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None
    guided_whitespace_pattern: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_fields(cls, data):
        return _refuse_unsupported(data, VLLM_UNSUPPORTED, "a vLLM extension")

    @field_validator("n")
    @classmethod
    def _n(cls, value, info: ValidationInfo):
        top = _limits(info).max_n
        if value is not None and value > top:
            raise InvalidArgumentError(f"must be at most {top} (the server's --max-n)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        for token in value or {}:
            if not _TOKEN_ID.fullmatch(token) or int(token) > INT32_MAX:
                raise InvalidArgumentError(f"keys must be token ids (digit strings), got {token!r:.40}")
        return value

    def _min_tokens(self, wanted: int | None):
        if self.min_tokens is not None and wanted is not None and self.min_tokens > wanted:
            raise _Unsupported("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({wanted})")


def _only(name: str, value: Any, neutral: str) -> None:
    """Refuse ``name`` unless absent or at ``neutral`` (the one value this server implements)."""
    if value is not None and value != neutral:
        raise _Unsupported(name, f"{name} is not supported by hf-tpu serve (only {json.dumps(neutral)}); leave it "
                                 "out")  # fmt: skip


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


class ChatRequest(_Text):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # refused unless neutral (below)
    reasoning_effort: Any = None
    verbosity: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None

    @model_validator(mode="before")
    @classmethod
    def _chat_vllm_fields(cls, data):
        return _refuse_unsupported(data, _CHAT_VLLM_UNSUPPORTED, "a vLLM extension")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and self.logprobs is not True:
            raise _Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        self._tool_choice()
        for name in ("reasoning_effort", "verbosity", "audio", "modalities", "prediction", "web_search_options",
                     "functions", "function_call", "moderation"):  # fmt: skip
            if getattr(self, name) is not None:
                raise _Unsupported(name, f"{name} is not supported by hf-tpu serve; leave it out")
        self._min_tokens(self.max_completion_tokens or self.max_tokens)
        return self

    def _tool_choice(self) -> None:
        """A call forced (``required``, a named function) needs tools (the named one among them), and is decoded
        under the grammar of the call, so not under a ``response_format`` as well."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return
        wanted = "required" if choice == "required" else f"the function {choice.function.name!r}"
        if not self.tools:
            raise _Unsupported("tool_choice", f"tool_choice {wanted} needs tools: send the functions in tools, or "
                                              "leave tool_choice out")  # fmt: skip
        names = [t.function.name for t in self.tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _Unsupported("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools "
                                              f"({', '.join(map(repr, names))}): name one of them")  # fmt: skip
        if self.response_format is not None and self.response_format.type != "text":
            raise _Unsupported("tool_choice", f"tool_choice {wanted} cannot be combined with response_format "
                                              f"{self.response_format.type!r} (the reply is a tool call): leave one "
                                              "of them out")  # fmt: skip

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info: ValidationInfo):
        top = _limits(info).max_logprobs
        if value is not None and value > top:
            raise InvalidArgumentError(f"must be at most {top} (the server's --max-logprobs)")
        return value


class CompletionRequest(_Text):
    """``POST /v1/completions``."""

    # a text, a list of texts, a prompt as token ids, or a list of those (vLLM's four forms; each prompt is run
    # on its own, its choices numbered after the previous prompt's); ids past the vocabulary: refused by the handler
    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Annotated[int, Field(le=INT32_MAX)] | None = None  # at least 1; 0 with echo (checked below)
    suffix: str | None = None
    logprobs: Count | None = None
    best_of: Positive | None = None
    echo: bool | None = None
    response_format: ResponseFormat | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value):
        if isinstance(value, list) and value:
            kinds = {"token id" if type(v) is int else type(v).__name__ for v in value}
            if len(kinds) > 1 or kinds - {"str", "token id", "list"}:
                raise InvalidArgumentError("must be a text, a list of texts, a list of token ids or a list of lists "
                                           f"of token ids, got a list of {' and '.join(sorted(kinds))}")  # fmt: skip
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value, info: ValidationInfo):
        top = _limits(info).max_n
        if value is not None and value > top:
            raise InvalidArgumentError(f"must be at most {top} (the server's --max-n: best_of sequences are "
                                       "generated)")  # fmt: skip
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value, info: ValidationInfo):
        top = _limits(info).max_logprobs
        if value is not None and value > top:
            raise InvalidArgumentError(f"must be at most {top} (the server's --max-logprobs)")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise _Unsupported("best_of", f"best_of ({self.best_of}) must be at least n ({self.n or 1})")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise _Unsupported("best_of", "best_of greater than n is not supported with stream: true (the best "
                                          "choices are known once all have ended); send stream: false")  # fmt: skip
        if self.stream and isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            raise _Unsupported("prompt", "a list of prompts is not supported with stream: true by hf-tpu serve; send "
                                         "one prompt per request, or stream: false")  # fmt: skip
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise _Unsupported("max_tokens", f"max_tokens must be at least 1 (0 only with echo: true, which returns "
                                             f"the prompt and its logprobs alone), got {self.max_tokens}")  # fmt: skip
        if self.echo and self.stream:
            raise _Unsupported("echo", "echo is not supported with stream: true by hf-tpu serve; send stream: false "
                                       "(or leave echo out)")  # fmt: skip
        self._min_tokens(self.max_tokens)
        return self


# ----- /v1/responses -----


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: Text
    arguments: str
    id: str | None = None
    status: str | None = None

    _arguments = field_validator("arguments")(_json_arguments)


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(_Open):
    text: str


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[dict[str, Any]] | None = None
    id: str | None = None


class InputMessage(Message):
    type: Literal["message"] | None = None


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind in (None, "message") or "role" in value:
        return "message"
    return {"text": "text", "input_text": "text", "output_text": "text"}.get(kind, kind)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[TextPart, Tag("text")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="item", custom_error_message="must be a message ({role, content}), "
                  "a text part, a function_call, a function_call_output or a reasoning item"),
]  # fmt: skip


class ResponsesRequest(_Sampling):
    """``POST /v1/responses`` (run as the chat request it amounts to)."""

    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    tools: list[ResponsesTool | ChatTool] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: Any = None
    background: bool | None = None
    include: list[Any] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    # refused unless absent (below)
    previous_response_id: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_fields(cls, data):
        return _refuse_unsupported(data, VLLM_UNSUPPORTED, "a vLLM extension")

    @model_validator(mode="after")
    def _consistent(self):
        if isinstance(self.input, list):
            parts = [isinstance(item, TextPart) for item in self.input]
            if any(parts) and not all(parts):
                raise _Unsupported("input", "input must be a list of text parts or a list of items, not both")
        fmt = (self.text or {}).get("format")
        if fmt is not None and fmt != {"type": "text"}:
            raise _Unsupported("text", "text is not supported by hf-tpu serve (only {\"format\": {\"type\": "
                                       "\"text\"}}); leave it out")  # fmt: skip
        _only("tool_choice", self.tool_choice, "auto")
        _only("truncation", self.truncation, "disabled")
        if self.background:
            raise _Unsupported("background", "background is not supported by hf-tpu serve: answers are streamed or "
                                             "returned whole; leave it out")  # fmt: skip
        if self.include:
            raise _Unsupported("include", "include is not supported by hf-tpu serve; leave it out")
        for name in ("previous_response_id", "reasoning", "max_tool_calls", "prompt", "conversation"):
            if getattr(self, name) is not None:
                raise _Unsupported(name, f"{name} is not supported by hf-tpu serve; leave it out")
        return self


# ----- /v1/embeddings -----


class EmbeddingRequest(_Model):
    """``POST /v1/embeddings``: checked, then answered 404 (``hf-tpu serve`` serves a causal LM, not embeddings)."""

    input: Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Positive | None = None
    user: str | None = None


# ----- transformers' generation_config extension -----


class GenerationFields(_Open):
    """The body's ``generation_config`` (a JSON string of ``GenerationConfig`` fields): the fields hf_tpu reads are
    typed and bounded as the request's own; the others must be valid for ``GenerationConfig``."""

    do_sample: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=FLOAT32_MAX)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    min_p: Probability | None = None
    max_new_tokens: Positive | None = None
    min_new_tokens: Count | None = None
    repetition_penalty: Annotated[float, Field(ge=FLOAT32_TINY, le=2.0)] | None = None
    eos_token_id: Int32 | list[Int32] | None = None
    pad_token_id: Int32 | None = None
    bos_token_id: Int32 | None = None

    @classmethod
    def parse(cls, value: str) -> dict:
        try:
            data = json.loads(value)
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            raise InvalidArgumentError("must be a string holding a JSON object (transformers' GenerationConfig fields)")
        if depth(data) > MAX_DEPTH:
            raise InvalidArgumentError(f"is nested more than {MAX_DEPTH} levels deep")
        try:
            cls.model_validate(data)
        except ValidationError as exc:
            param, message = _describe(exc.errors()[0])
            raise InvalidArgumentError(f"{param}: {message}") from None
        from transformers import GenerationConfig

        try:
            GenerationConfig(**data).validate(strict=True)
        except Exception as exc:  # noqa: BLE001 - GenerationConfig raises ValueError, TypeError... on bad fields
            raise InvalidArgumentError(f"is not a valid GenerationConfig: {exc}") from None
        return data


# ----- validation -----

_MODELS = {CHAT: ChatRequest, COMPLETIONS: CompletionRequest, RESPONSES: ResponsesRequest,
           EMBEDDINGS: EmbeddingRequest}  # fmt: skip


def depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and objects (a scalar: 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:
                stack.extend((child, level + 1) for child in item)
    return deepest


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _where(loc: tuple) -> str:
    """``("messages", 2, "role")`` -> ``messages[2].role`` (pydantic's union branch tags dropped)."""
    out, after_index = "", False
    for part in loc:
        if isinstance(part, int):
            out, after_index = out + f"[{part}]", True
            continue
        tag = after_index and part in ("message", "text", "function_call", "function_call_output", "reasoning")
        after_index = False
        if tag or part in _TYPE_TAGS or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) or part[:1].isupper():
            continue  # a union's branch or a discriminated union's tag, not a field
        out += f".{part}" if out else part
    return out


_BOUNDS = {INT32_MAX: "int32, what the compiled step holds", INT64_MAX: "int64", FLOAT32_MAX: "float32's largest",
           FLOAT32_TINY: "float32's smallest normal value"}  # fmt: skip


def _describe(error: dict) -> tuple[str, str]:
    """(param, message) of one pydantic error."""
    param = _where(tuple(error.get("loc", ())))
    kind, ctx, value = error.get("type"), error.get("ctx") or {}, error.get("input")
    shown = json.dumps(value)[:60] if _jsonable(value) else repr(value)[:60]
    if kind == "extra_forbidden":
        name = param.rpartition(".")[2]
        return param, f"unrecognized request argument: {name} (not a field of this endpoint here)"
    if kind == "missing":
        return param, "is required"
    for key, word in (("le", "at most"), ("ge", "at least"), ("lt", "below"), ("gt", "above")):
        if key in ctx:
            bound = ctx[key]
            why = _BOUNDS.get(bound)
            return param, f"must be {word} {bound}" + (f" ({why})" if why else "") + f", got {shown}"
    message = str(error.get("msg", "is invalid"))
    message = message.removeprefix("Value error, ").replace("Input should be", "must be")
    message = re.sub(r"a valid dictionary or instance of \w+", "an object", message)
    if not message.startswith("must"):
        message = message[:1].lower() + message[1:]
    return param, message if ", got " in message else f"{message}, got {shown}"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def validate(path: str, body: dict, limits: Limits = Limits()) -> BaseModel:
    """The request model of ``body`` for endpoint ``path`` (:data:`CHAT`, :data:`COMPLETIONS`, :data:`RESPONSES`,
    :data:`EMBEDDINGS`).

    Args:
        path: the endpoint's path.
        body: the parsed JSON body (a dict).
        limits: the server's limits (``--max-n``, ``--max-logprobs``).

    Returns:
        The validated model (``ChatRequest``...).

    Raises:
        RequestError: the first wrong field, named in ``param`` (HTTP 400).
    """
    if depth(body) > MAX_DEPTH:
        raise RequestError(None, f"the request body is nested more than {MAX_DEPTH} levels deep")
    try:
        return _MODELS[path].model_validate(body, context={"limits": limits})
    except _Unsupported as exc:
        raise RequestError(exc.param, str(exc)) from None
    except ValidationError as exc:
        errors = exc.errors()
        for error in errors:  # a refusal raised inside a validator keeps its own field and words
            original = (error.get("ctx") or {}).get("error")
            if isinstance(original, _Unsupported):
                raise RequestError(original.param, str(original)) from None
        # of a union's branches, the one that got furthest names the field best (a list's item, not "not a string")
        param, message = _describe(max(errors, key=lambda e: (len(e.get("loc", ())), not e["type"].endswith("_type"))))
        raise RequestError(param or None, f"{param}: {message}" if param else message) from None
