"""Tool calls of ``/v1/chat/completions`` (hf_tpu/serving/_tools.py): the chat-template families' parsers on what
their templates render, the grammar of a forced call under llguidance, the plan of a request, and the 400s.

The templates (tests/serving/_tool_models.py) are written in each family's format; a reply is the assistant turn such
a template renders from a conversation's calls, so each parser is checked against the calls it was rendered from.
"""

from __future__ import annotations

import json

import pytest
from _tool_models import HERMES_TEMPLATE, LLAMA3_TEMPLATE, TIME

from hf_tpu.assets import default_model_path
from hf_tpu.serving import _tools
from hf_tpu.serving._openai import CHAT, RequestError
from hf_tpu.serving.protocol import validate

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                           "days": {"type": "integer"}},
                          "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
CALLS = [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "get_time", "arguments": {}}]
HI = [{"role": "user", "content": "What is the weather in Rome?"}]


def _tokenizer(template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.chat_template = template
    return tok


def rendered_reply(tok, calls: list[dict], content: str, before: str, after: str) -> str:
    """The assistant turn ``tok``'s template renders for ``calls`` (with ``content``): the text after the generation
    prompt's end ``before`` and up to ``after``."""
    turn = {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": c} for c in calls]}  # fmt: skip
    text = tok.apply_chat_template([*HI, turn], tools=TOOLS, tokenize=False)
    reply = text[text.rindex(before) + len(before) :]
    return reply[: reply.index(after)] if after else reply


def as_calls(calls: list[_tools.Call]) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


# ----- detection -----


def test_the_format_is_read_from_the_chat_template():
    assert _tools.detect(HERMES_TEMPLATE) == "hermes"
    assert _tools.detect(LLAMA3_TEMPLATE) == "llama3_json"
    assert _tools.detect(_tokenizer(None).chat_template) is None  # the shipped model's: no tools
    assert _tools.detect(None) is None
    assert _tools.detect({"default": "x", "tool_use": HERMES_TEMPLATE}) == "hermes"
    # Qwen 3.5's calls are XML inside <tool_call> (transformers' response template parses them), not Hermes JSON
    assert _tools.detect("<tool_call>\n<function={{ name }}>") is None


# ----- parsers, on what the templates render -----


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_hermes_parses_the_calls_its_template_rendered(content):
    tok = _tokenizer(HERMES_TEMPLATE)
    reply = rendered_reply(tok, CALLS, content, "assistant: ", "")
    assert "<tool_call>" in reply
    got_content, calls = _tools.parse("hermes", reply)
    assert as_calls(calls) == CALLS and got_content == content


def test_llama3_json_parses_the_calls_its_template_rendered():
    tok = _tokenizer(LLAMA3_TEMPLATE)
    reply = rendered_reply(tok, CALLS, "", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert reply.startswith("<|python_tag|>")
    content, calls = _tools.parse("llama3_json", reply)
    assert as_calls(calls) == CALLS and content == ""
    content, calls = _tools.parse("llama3_json", reply.removeprefix("<|python_tag|>") + "<|eot_id|>",
                                  drop=("<|eot_id|>",))  # (decoded without the tag, or with the end token)
    assert as_calls(calls) == CALLS[:2] and content == ""


@pytest.mark.parametrize(("name", "template", "before", "after"), [
    ("hermes", HERMES_TEMPLATE, "assistant: ", ""),
    ("llama3_json", LLAMA3_TEMPLATE, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
], ids=["hermes", "llama3_json"])  # fmt: skip
def test_streamed_token_by_token_parses_as_the_whole(name, template, before, after):
    tok = _tokenizer(template)
    reply = rendered_reply(tok, CALLS, "", before, after) + " done"
    whole = _tools.parse(name, reply)
    parser, items = _tools.parser(name), []
    for token in tok.encode(reply, add_special_tokens=False):  # the pieces a stream decodes, one token each
        items += parser.feed(tok.decode([token]))
    items += parser.finish()
    calls = [i for i in items if isinstance(i, _tools.Call)]
    assert calls == whole[1]
    assert "".join(i for i in items if isinstance(i, str)).strip() == whole[0]


def test_text_that_is_not_a_call_stays_content():
    broken = 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    assert _tools.parse("hermes", broken) == (broken, [])
    assert _tools.parse("hermes", "no call here <tool_") == ("no call here <tool_", [])
    unclosed = '<tool_call>\n{"name": "get_time", "arguments": {}}'  # an end of sequence before the close marker
    assert as_calls(_tools.parse("hermes", unclosed)[1]) == [CALLS[1]]
    assert _tools.parse("llama3_json", 'The answer is {"name": "x"}') == ('The answer is {"name": "x"}', [])
    assert _tools.parse("llama3_json", '{"name": "get_time", "parameters": {}} and more')[1] == []
    assert _tools.parse("llama3_json", '{"city": "Rome"}') == ('{"city": "Rome"}', [])


# ----- the grammar of a forced call -----


def _matcher(tok, grammar: str):
    import llguidance
    import llguidance.hf

    return llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar)


def _accepts(tok, grammar: str, text: str) -> bool:
    matcher = _matcher(tok, grammar)
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def _hermes(calls: list[dict]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def _llama3(calls: list[dict]) -> str:
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


@pytest.mark.parametrize(("name", "write"), [("hermes", _hermes), ("llama3_json", _llama3)])
def test_the_grammar_takes_a_call_of_the_tools_and_refuses_others(name, write):
    tok = _tokenizer(None)
    required = _tools.grammar(name, TOOLS, "required", parallel=True)
    assert _accepts(tok, required, write(CALLS[:1]))
    assert _accepts(tok, required, write(CALLS))  # parallel calls
    assert _tools.parse(name, write(CALLS))[1] == [_tools.Call(c["name"], json.dumps(c["arguments"])) for c in CALLS]
    assert not _accepts(tok, required, write([{"name": "get_stock", "arguments": {}}]))  # not a tool
    assert not _accepts(tok, required, write([{"name": "get_weather", "arguments": {"city": "Oslo"}}]))  # not enum
    assert not _accepts(tok, required, write([{"name": "get_weather", "arguments": {"days": 2}}]))  # city missing
    assert not _accepts(tok, required, write([{"name": "get_weather", "arguments": {"city": "Rome", "x": 1}}]))
    assert not _accepts(tok, required, "It is sunny.")  # no call
    assert not _accepts(tok, required, write(CALLS[:1])[:-3])  # a call cut short is not a whole reply
    single = _tools.grammar(name, TOOLS, "required", parallel=False)
    assert _accepts(tok, single, write(CALLS[:1])) and not _accepts(tok, single, write(CALLS))
    named = _tools.grammar(name, TOOLS, {"type": "function", "function": {"name": "get_time"}}, parallel=True)
    assert _accepts(tok, named, write(CALLS[1:])) and not _accepts(tok, named, write(CALLS[:1]))
    assert not _accepts(tok, named, write([CALLS[1], CALLS[1]]))  # a named function: one call


def test_a_schema_llguidance_cannot_compile_is_a_400_naming_tools():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectish"}}}
    with pytest.raises(RequestError) as info:
        _tools.grammar("hermes", [bad], "required", parallel=True)
    assert info.value.param == "tools" and info.value.status == 400


# ----- the plan of a request -----


def test_the_plan_follows_tool_choice():
    tok = _tokenizer(HERMES_TEMPLATE)
    body = {"messages": HI, "tools": TOOLS}
    auto = _tools.plan(body, tok, has_response_template=False)
    assert auto.fmt == "hermes" and auto.grammar is None and auto.parallel and not auto.upstream
    assert _tools.plan({**body, "tool_choice": "none"}, tok, False) == _tools.Plan()  # rendered, not parsed
    required = _tools.plan({**body, "tool_choice": "required"}, tok, False)
    assert required.fmt == "hermes" and required.grammar == _tools.grammar("hermes", TOOLS, "required", True)
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = _tools.plan({**body, "tool_choice": named, "parallel_tool_calls": False}, tok, False)
    assert forced.grammar == _tools.grammar("hermes", TOOLS, named, False) and not forced.parallel
    # transformers' response template parses the reply where the model has one; the grammar is still the format's
    upstream = _tools.plan({**body, "tool_choice": "required"}, tok, has_response_template=True)
    assert upstream.upstream and upstream.fmt is None and upstream.grammar == required.grammar
    # --tool-call-parser wins over both
    llama = _tools.plan({**body, "tool_choice": "required"}, tok, True, override="llama3_json")
    assert llama.fmt == "llama3_json" and not llama.upstream
    assert llama.grammar == _tools.grammar("llama3_json", TOOLS, "required", True)
    # no tools: as before (the response template for reasoning, where there is one)
    assert _tools.plan({"messages": HI}, tok, True) == _tools.Plan(upstream=True, skip_special=False)


def test_a_forced_call_needs_a_known_format():
    plain = _tokenizer(None)  # the shipped model's template writes no calls
    assert _tools.plan({"messages": HI, "tools": TOOLS}, plain, False) == _tools.Plan()  # auto: the text as it is
    with pytest.raises(RequestError) as info:
        _tools.plan({"messages": HI, "tools": TOOLS, "tool_choice": "required"}, plain, False)
    assert info.value.param == "tool_choice" and "--tool-call-parser" in info.value.message
    assert _tools.plan({"messages": HI, "tools": TOOLS, "tool_choice": "required"}, plain, False,
                       override="hermes").grammar is not None  # fmt: skip


def test_special_markers_are_decoded_and_the_other_special_tokens_dropped():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.chat_template = LLAMA3_TEMPLATE
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eot_id|>"]})
    plan = _tools.plan({"messages": HI, "tools": TOOLS}, tok, False)
    assert plan.fmt == "llama3_json" and not plan.skip_special and "<|eot_id|>" in plan.drop
    reply = _llama3(CALLS)
    ids = tok.encode("<|python_tag|>" + reply + "<|eot_id|>", add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=plan.skip_special)
    assert as_calls(_tools.parse(plan.fmt, text, plan.drop)[1]) == CALLS


# ----- the 400s -----

NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(("body", "words"), [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": NAMED}, "needs tools"),
    ({"tool_choice": NAMED, "tools": [WEATHER]}, "not in tools"),
    ({"tool_choice": "required", "tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": NAMED, "tools": TOOLS,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "'required'"),
    ({"tool_choice": {"type": "function", "function": {}}, "tools": TOOLS}, "required"),
])  # fmt: skip
def test_a_wrong_tool_choice_is_a_400_naming_it(body, words):
    with pytest.raises(RequestError) as info:
        validate(CHAT, {"messages": HI, **body})
    assert info.value.param.startswith("tool_choice") and info.value.status == 400 and words in info.value.message


def test_every_tool_choice_passes_with_tools():
    for choice in ("auto", "none", "required", NAMED):
        assert validate(CHAT, {"messages": HI, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False})
    assert validate(CHAT, {"messages": HI, "tool_choice": "none"})  # none and auto need no tools
