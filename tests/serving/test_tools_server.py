"""``hf-tpu serve --simulate`` with tools: the shipped tiny model with a Hermes chat template (hf_tpu's parser, picked
from the template), each ``tool_choice`` end to end, against CPU ``generate``.

The tiny model never writes a call of its own, so ``auto`` and ``none`` are checked as the CPU reply parsed (or not),
and ``required`` and a named function check what only the grammar can give it: a call of the tools, every time.
One server for the module (its warm-up is the expensive part): in the slow tier.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from _server import running_server
from _timeouts import SAFETY_TIMEOUT_S
from _tool_models import HERMES_TEMPLATE, TIME, model_dir

from hf_tpu.serving import _tools

pytestmark = pytest.mark.slow

CITIES = ["Paris", "Rome"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
NEW_TOKENS = 48
FORCED_TOKENS = 80  # a forced call of these tools with its markers: about 50 of the tiny model's byte-level tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = model_dir(tmp_path_factory.mktemp("model"), HERMES_TEMPLATE)
    with running_server(tmp_path_factory.mktemp("serve"), str(path)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=SAFETY_TIMEOUT_S,
                               max_retries=0)  # fmt: skip
        yield server, client, path


@pytest.fixture(scope="module")
def cpu(served):
    """The same model on CPU, greedy with its generation config: the reply text to a chat with tools."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = served[2]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def reply(messages, tools, new_tokens: int = NEW_TOKENS) -> str:
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]  # fmt: skip
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    return reply


def _ask(client, **kwargs):
    kwargs.setdefault("max_tokens", NEW_TOKENS)
    return client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS, temperature=0, **kwargs)


def _check_call(call, names: list[str]) -> None:
    assert call.type == "function" and call.id and call.function.name in names
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in CITIES and set(arguments) == {"city"}
    else:
        assert arguments == {}


def test_auto_is_the_reply_parsed_by_the_templates_format(served, cpu):
    _, client, _ = served
    content, calls = _tools.parse("hermes", cpu(ASK, TOOLS))
    choice = _ask(client).choices[0]
    assert (choice.message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == list(calls)
    assert choice.finish_reason == ("tool_calls" if calls else "length")


def test_auto_returns_the_call_a_reply_holds(served):
    """A reply that is a Hermes call (the tiny model made to write one by a grammar of the call's exact text, a vLLM
    ``guided_regex`` beside ``tool_choice`` auto) comes back as OpenAI's ``tool_calls``, streamed or not."""
    _, client, _ = served
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in call)
    forced = {"extra_body": {"guided_regex": regex}, "max_tokens": FORCED_TOKENS}
    choice = _ask(client, tool_choice="auto", **forced).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Rome"})]  # fmt: skip
    calls, finish = [], None
    for chunk in _ask(client, stream=True, **forced):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]


def test_auto_streamed_is_the_same_reply(served):
    _, client, _ = served
    whole = _ask(client).choices[0]
    content, finish = "", None
    for chunk in _ask(client, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert content.strip() == (whole.message.content or "") and finish == whole.finish_reason


def test_none_renders_the_tools_and_parses_no_call(served, cpu):
    _, client, _ = served
    choice = _ask(client, tool_choice="none").choices[0]
    assert choice.message.content == cpu(ASK, TOOLS) and not choice.message.tool_calls


def test_required_always_returns_a_call_of_the_tools(served):
    """Decoded under the call's grammar: without it the tiny model writes Shakespeare, not a call."""
    _, client, _ = served
    choice = _ask(client, tool_choice="required", parallel_tool_calls=False, max_tokens=FORCED_TOKENS).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], ["get_weather", "get_time"])


def test_a_named_function_is_called_streamed_or_not(served):
    """Decoded under the call's grammar, as the test above."""
    _, client, _ = served
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _ask(client, tool_choice=named, max_tokens=FORCED_TOKENS).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], ["get_weather"])
    calls, finish = [], None
    for chunk in _ask(client, tool_choice=named, stream=True, max_tokens=FORCED_TOKENS):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert calls[0].function.arguments == choice.message.tool_calls[0].function.arguments


def test_a_forced_call_the_server_cannot_honour_is_a_400(served):
    _, client, _ = served
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectish"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-tools", messages=ASK, tools=[bad], tool_choice="required",
                                       max_tokens=4)  # fmt: skip
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert info.value.body["param"] == "tool_choice"
