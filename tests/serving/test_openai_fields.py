"""The request fields ``hf-tpu serve`` checks at the door (the request models of hf_tpu/serving/protocol.py), and what
they resolve to (hf_tpu/serving/_openai.py)."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from hf_tpu.serving._openai import CHAT, COMPLETIONS, RESPONSES, Limits, RequestError, check_vocab, resolve
from hf_tpu.serving.protocol import validate


def check(path: str, body: dict, limits: Limits = Limits()) -> None:
    validate(path, body, limits)


def check_responses(body: dict, limits: Limits = Limits()) -> None:
    validate(RESPONSES, body, limits)

HI = [{"role": "user", "content": "hi"}]


def refused(path: str, body: dict, limits: Limits = Limits()) -> RequestError:
    with pytest.raises(RequestError) as info:
        check(path, body, limits)
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": HI, "temperature": -1}, "temperature"),
        ({"messages": HI, "temperature": "hot"}, "temperature"),
        ({"messages": HI, "top_p": 0}, "top_p"),
        ({"messages": HI, "top_p": 1.5}, "top_p"),
        ({"messages": HI, "top_k": -2}, "top_k"),
        ({"messages": HI, "min_p": 2}, "min_p"),
        ({"messages": HI, "n": 1000}, "n"),
        ({"messages": HI, "n": 0}, "n"),
        ({"messages": HI, "seed": 1.5}, "seed"),
        ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": HI, "stop": ""}, "stop"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "max_completion_tokens": True}, "max_completion_tokens"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": HI, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ({"messages": HI, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": HI, "frequency_penalty": 3}, "frequency_penalty"),
        ({"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": HI, "min_tokens": -1}, "min_tokens"),
        ({"messages": HI, "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"messages": HI, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": HI, "logit_bias": [1]}, "logit_bias"),
        ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"messages": HI, "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": HI, "guided_choice": "yes"}, "guided_choice"),
        ({"messages": HI, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ({"messages": HI, "stream": "yes"}, "stream"),
        ({"messages": HI, "generation_config": "{not json"}, "generation_config"),
        ({"messages": HI, "prompt": "x"}, "prompt"),
        ({"messages": HI, "wibble": 1}, "wibble"),
    ],
)  # fmt: skip
def test_a_wrong_chat_field_is_named(body, param):
    error = refused(CHAT, body)
    assert error.param == param and error.status == 400
    assert error.body()["error"]["param"] == param and error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": [5, -1]}, "prompt[1]"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": "x", "messages": HI}, "messages"),
    ],
)
def test_a_wrong_completions_field_is_named(body, param):
    assert refused(COMPLETIONS, body).param == param


def test_limits_are_the_servers():
    assert refused(CHAT, {"messages": HI, "n": 3}, Limits(max_n=2)).param == "n"
    check(CHAT, {"messages": HI, "n": 3}, Limits(max_n=3))
    assert "--max-logprobs" in refused(COMPLETIONS, {"prompt": "x", "logprobs": 3}, Limits(max_logprobs=2)).message
    assert "--max-n" in refused(COMPLETIONS, {"prompt": "x", "best_of": 3}, Limits(max_n=2)).message


def test_valid_bodies_pass():
    check(CHAT, {"messages": HI + [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}],
                 "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "n": 2, "stop": ["\n"],
                 "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
                 "max_completion_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -1, "user": "u",
                 "model": "m", "repetition_penalty": 1.2, "logit_bias": {"5": -100, "7": 2.5},
                 "min_tokens": 8})  # fmt: skip
    check(COMPLETIONS, {"prompt": "x", "logprobs": 0, "stop": "\n", "best_of": 1, "echo": False, "suffix": "!"})
    check(COMPLETIONS, {"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0})
    for prompt in (["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        check(COMPLETIONS, {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1})
    check(COMPLETIONS, {"prompt": [1, 2], "stream": True})
    check(COMPLETIONS, {"prompt": "x", "best_of": 3, "n": 2, "seed": 1})
    check(COMPLETIONS, {"prompt": "x", "generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})})


def test_resolve_takes_the_request_else_the_model():
    model = GenerationConfig(do_sample=False, max_new_tokens=48, eos_token_id=2, top_k=40)
    s = resolve(CHAT, {"messages": HI}, model)
    assert s.greedy and s.max_tokens == 48 and s.eos_token_id == 2 and s.n == 1 and s.top_k == 40
    s = resolve(CHAT, {"messages": HI, "temperature": 0.5, "top_p": 0.9, "max_tokens": 4, "stop": "x"}, model)
    assert (s.temperature, s.top_p, s.max_tokens, s.stop) == (0.5, 0.9, 4, ("x",))
    sampled = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.95)
    s = resolve(COMPLETIONS, {"prompt": "x", "logprobs": 2, "ignore_eos": True}, sampled)
    assert (s.temperature, s.top_p, s.logprobs, s.top_logprobs, s.eos_token_id) == (0.8, 0.95, True, 2, None)
    s = resolve(COMPLETIONS, {"prompt": "x", "top_k": -1}, GenerationConfig(do_sample=True))
    assert (s.temperature, s.top_k, s.max_tokens) == (1.0, 0, None)
    s = resolve(COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 3}, model)
    assert (s.n, s.best_of, s.logprobs, s.scored) == (2, 3, False, True)  # best_of ranks on the chosen logprobs
    s = resolve(COMPLETIONS, {"prompt": "x", "n": 2}, model)
    assert (s.n, s.best_of, s.scored) == (2, 2, False)


def test_penalties_resolve_from_the_request_else_the_model():
    model = GenerationConfig(do_sample=False, repetition_penalty=1.3, min_new_tokens=2)
    s = resolve(CHAT, {"messages": HI}, model)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.logit_bias, s.min_tokens) == (
        1.3, 0.0, 0.0, {}, 2)  # fmt: skip
    assert s.extra["penalties"] == ()  # (the model's defaults are not the request's asking)
    body = {"prompt": "x", "repetition_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {"9": -5}, "min_tokens": 1}
    s = resolve(COMPLETIONS, body, model)
    assert (s.repetition_penalty, s.presence_penalty, s.logit_bias, s.min_tokens) == (1.0, 0.5, {9: -5.0}, 1)
    assert s.extra["penalties"] == ("presence_penalty", "logit_bias", "min_tokens")
    error = pytest.raises(RequestError, check_vocab, {"logit_bias": {"5": 1, "96": 1}}, 96).value
    assert error.param == "logit_bias" and "96" in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "input_text", "text": 3}]}, "input[0].text"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f"}]}, "input[1].call_id"),
        ({"input": "x", "instructions": 1}, "instructions"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "top_p": 1.5}, "top_p"),
        ({"input": "x", "seed": "s"}, "seed"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "messages": HI}, "messages"),
    ],
)
def test_a_wrong_responses_field_is_named(body, param):
    with pytest.raises(RequestError) as info:
        check_responses(body)
    assert info.value.param == param and info.value.status == 400


def test_valid_responses_bodies_pass():
    check_responses({"input": "x", "instructions": "be brief", "max_output_tokens": 4, "temperature": 0.5, "top_p": 0.9,
                     "seed": 1, "stream": False, "store": False, "text": {"format": {"type": "text"}},
                     "truncation": "disabled", "tool_choice": "auto", "tools": [], "top_logprobs": 0})  # fmt: skip
    check_responses({"input": [{"type": "input_text", "text": "x"}]})
    check_responses({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "sunny"},
    ]})  # fmt: skip
