"""``hf-tpu serve --simulate`` on 127.0.0.1, talked to with the ``openai`` client, against CPU ``generate``.

One server for the module (its warm-up is the expensive part); the SIGTERM test runs last and stops it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import openai
import pytest
import torch
from _server import running_server
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import default_model_path

MODEL = "tiny-lm"  # the model directory's name: accepted besides the served name
SERVED = "tiny-shakespeare"
# Above the 16 concurrent clients of the load test: a client may get its answer and send its next request before the
# server has counted the previous one out.
MAX_PENDING = 24
PROMPTS = [
    "The king said", "My lord, the", "O Romeo,", "What is the", "I am not", "Good morrow,", "Why, then", "Speak, I",
    "To be or not", "He that",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ("--max-pending", str(MAX_PENDING), "--served-model-name", SERVED)
    with running_server(tmp_path_factory.mktemp("serve"), *flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=SAFETY_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def cpu():
    """The shipped model on CPU, greedy with its generation config (its repetition penalty of 1.3 included: the
    server honours it, where upstream's continuous batching drops it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def complete(ids: list[int], new_tokens: int, **kwargs) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, **kwargs)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    def text(prompt: str, new_tokens: int) -> str:
        return complete(tok(prompt)["input_ids"], new_tokens)

    def chat(content: str, new_tokens: int) -> str:
        messages = [{"role": "user", "content": content}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return complete(list(ids["input_ids"]), new_tokens)

    text.chat, text.complete = chat, complete
    text.tok, text.model = tok, model
    return text


def cpu_logits(cpu, ids: list[int]) -> torch.Tensor:
    """CPU's next-token logits after every position of ``ids`` (float32)."""
    with torch.no_grad():
        return cpu.model(torch.tensor([ids])).logits[0].float()


def cpu_scores(cpu, ids: list[int]) -> torch.Tensor:
    """CPU's last logits row after the model's repetition penalty (the server's default for every request)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(float(cpu.model.generation_config.repetition_penalty))
    return penalty(torch.tensor([ids]), cpu_logits(cpu, ids)[-1:])


def cpu_sampled(cpu, prompt_ids: list[int], new_tokens: int, *, temperature: float, seed: int, choice: int = 0,
                top_k: int = 0, top_p: float = 1.0) -> list[int]:  # fmt: skip
    """The tokens a request draws, replayed on CPU: the same keys (seed, choice, position) through hf_tpu's sampler
    on CPU's logits after the model's repetition penalty (no end of sequence)."""
    from hf_tpu.serving._sampling import noise_key, sample

    ids = list(prompt_ids)
    for _ in range(new_tokens):
        key = noise_key(seed, choice, len(ids))
        floats = torch.tensor([temperature, top_p, 0.0], dtype=torch.float32).view(torch.int32)
        args = torch.stack([floats[0:1], torch.tensor([top_k], dtype=torch.int32), floats[1:2], floats[2:3],
                            torch.tensor([key], dtype=torch.int32)])  # fmt: skip
        ids.append(int(sample(cpu_scores(cpu, ids), args)[0]))
    return ids[len(prompt_ids) :]


def test_chat_completion_and_models(client, cpu):
    assert [m.id for m in client.models.list().data] == [SERVED]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == cpu.chat("Hello there", 8)
    assert reply.model == SERVED
    done = client.completions.create(model=SERVED, prompt="The king said", max_tokens=8, temperature=0)
    assert done.choices[0].text == cpu("The king said", 8)
    assert done.usage.completion_tokens <= 8 and done.model == SERVED
    by_path = client.completions.create(model=str(default_model_path()), prompt="The king said", max_tokens=2)
    assert by_path.model == SERVED
    chunks = list(client.completions.create(model=SERVED, prompt="The king said", max_tokens=2, stream=True))
    assert {c.model for c in chunks} == {SERVED}


def test_health_said_warming_up_and_the_console_showed_the_warm_up(server):
    assert server.health_before_ready, "the server was never seen warming up"
    status, body = server.health_before_ready[0]
    assert status == 503 and body["status"] == "warming up", body
    assert server.get("/health")[0] == 200
    out = server.output()
    assert "warm-up 1/3" in out and "warm-up 3/3" in out and "warm-up done" in out
    assert out.index("listening on") < out.index("warm-up 1/3")


def test_metrics_have_latency_throughput_process_and_the_model(server, client):
    client.completions.create(model=MODEL, prompt="The king said", max_tokens=4, temperature=0)
    _, text = server.get("/metrics")
    lines = [line for line in text.decode().splitlines() if line and not line.startswith("#")]
    ours = [line for line in lines if line.startswith("hf_tpu_")]
    assert ours and all(f'model="{SERVED}"' in line for line in ours)
    for name in ("hf_tpu_e2e_request_latency_seconds_count", "hf_tpu_prompt_throughput_tokens_per_second",
                 "hf_tpu_generation_throughput_tokens_per_second", "process_resident_memory_bytes",
                 "process_cpu_seconds_total"):  # fmt: skip
        assert any(line.startswith(name) for line in lines), name
    assert server.metric("hf_tpu_e2e_request_latency_seconds_count") >= 1
    assert server.metric("hf_tpu_prompt_throughput_tokens_per_second") > 0
    # time to first token runs from the arrival, so it is not longer than the whole answer
    assert server.metric("hf_tpu_time_to_first_token_seconds_sum") <= server.metric(
        "hf_tpu_e2e_request_latency_seconds_sum")
    assert str(default_model_path()) not in text.decode()


def test_upstream_warnings_are_said_once(server):
    for _ in range(3):
        status, body, _ = server.post("/v1/responses", {"model": MODEL, "input": "The king", "max_output_tokens": 2,
                                                        "stream": False})  # fmt: skip
        assert status == 200, body
        assert body["model"] == SERVED
    # (transformers 5.24's Serve logged "Loading <path>"; hf-tpu serve loads the model itself, and the warnings
    # upstream's continuous batching gives per manager are held back or said once: tests/serving/test_app.py)
    warnings = [line for line in server.output().splitlines() if line.startswith("[transformers]")]
    assert len(warnings) == len(set(warnings)), warnings


def test_streaming_joins_to_the_non_streamed_text(client):
    whole = client.completions.create(model=MODEL, prompt="O Romeo,", max_tokens=10, temperature=0).choices[0].text
    chunks = client.completions.create(model=MODEL, prompt="O Romeo,", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    messages = [{"role": "user", "content": "Good morrow"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True)
    assert "".join((c.choices[0].delta.content or "") for c in chunks if c.choices) == whole


def test_decode_steps_read_back_once_per_chunk(server, client, cpu):
    """A 64-token answer, plain and streamed, equals CPU's; the step loop read the tokens back at most once per 4
    steps (``hf_tpu_step_read_backs_total`` against ``hf_tpu_steps_total``: chunks of 8 decode steps)."""
    ids = cpu.tok("The king said")["input_ids"]
    want = cpu.complete(ids, 64, eos_token_id=None)
    body = {"model": MODEL, "prompt": "The king said", "max_tokens": 64, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    steps, reads = server.metric("hf_tpu_steps_total"), server.metric("hf_tpu_step_read_backs_total")
    assert client.completions.create(**body).choices[0].text == want
    chunks = client.completions.create(stream=True, **body)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    steps = server.metric("hf_tpu_steps_total") - steps
    reads = server.metric("hf_tpu_step_read_backs_total") - reads
    assert steps >= 2 * 64 and reads * 4 <= steps, (steps, reads)


def test_eight_concurrent_greedy_requests_each_equal_cpu_generate(client, cpu):
    def one(i):
        prompt = PROMPTS[i]
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4 + i, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    for i, text in enumerate(got):
        assert text == cpu(PROMPTS[i], 4 + i), PROMPTS[i]


def test_bad_input_is_answered_and_the_server_keeps_serving(server, client):
    status, body, _ = server.post("/v1/completions", b'{"prompt": "x", "max_tokens": ', raw=True)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = server.post("/v1/completions", [1, 2], raw=False)
    assert status == 400 and "JSON object" in body["error"]["message"]
    for bad in (0, -3):
        status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": bad})
        assert status == 400 and body["error"]["param"] == "max_tokens" and "at least 1" in body["error"]["message"]
    status, body, _ = server.post("/v1/chat/completions", {"model": "gpt-9", "messages": []})
    assert status == 404 and "gpt-9" in body["error"]["message"] and SERVED in body["error"]["message"]
    assert str(default_model_path()) not in body["error"]["message"]
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "the king " * 200, "max_tokens": 4})
    assert status == 400 and "max_position_embeddings" in body["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="Why, then", max_tokens=3).choices[0].text is not None


def test_every_field_is_checked_at_the_door(server, client):
    def param_of(**body) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, **body)
        assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"
        return info.value.param

    hi = [{"role": "user", "content": "hi"}]
    assert param_of(messages=[]) == "messages"
    assert param_of(messages=hi, temperature=-1) == "temperature"
    assert param_of(messages=hi, top_p=0) == "top_p"
    assert param_of(messages=hi, n=1000) == "n"
    assert param_of(messages=[{"role": "wizard", "content": "x"}]) == "messages[0].role"
    status, body, _ = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "messages", body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert info.value.param == "prompt"
    reply = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=3, temperature=0)
    assert reply.choices[0].message.content is not None  # alive


_UNTIL_LENGTH = {"model": MODEL, "prompt": "The king said", "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_finish_reason_is_length_at_max_tokens(client):
    short = client.completions.create(max_tokens=5, **_UNTIL_LENGTH)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 5


def test_finish_reason_is_length_at_the_context(client):
    """(A decode to the model's whole context, streamed, with the usage chunk: in the slow tier, tests/_tiers.py.)"""
    chunks = list(client.completions.create(max_tokens=100000, stream=True, stream_options={"include_usage": True},
                                            **_UNTIL_LENGTH))  # cut at the model's 256 positions  # fmt: skip
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens + usage.completion_tokens == 256


def _stream(server, prompt: str, tokens: int):
    """An open streaming completion (no end of sequence, so that it runs its length); its first chunk read."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True,
        "generation_config": json.dumps({"eos_token_id": -1, "max_new_tokens": tokens, "do_sample": False}),
    }  # fmt: skip
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})  # fmt: skip
    response = urllib.request.urlopen(request, timeout=SAFETY_TIMEOUT_S)
    assert response.status == 200
    response.readline()
    return response


def _half_sent(server) -> socket.socket:
    """A client that has sent its request line and headers but not all of its body (it holds a place in the queue)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_TIMEOUT_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{\"prompt\": ")  # fmt: skip
    return sock


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_full_queue_gets_429_with_retry_after(server, client):
    # an earlier test's request still leaving would make MAX_PENDING half-sent ones count one too many, then free
    # a place when it goes (a 200 where the test wants the 429): start from an empty server
    _wait_for(lambda: server.metric("hf_tpu_requests_in_flight") == 0, "an earlier request stays in flight")
    clients = [_half_sent(server) for _ in range(MAX_PENDING)]
    try:
        _wait_for(lambda: server.metric("hf_tpu_requests_in_flight") == MAX_PENDING, "half-sent requests not counted")
        status, body, headers = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 429 and int(headers["retry-after"]) >= 1, body
        assert "--max-pending" in body["error"]["message"]
    finally:
        for sock in clients:
            sock.close()
    _wait_for(lambda: server.metric("hf_tpu_requests_in_flight") == 0, "gone clients still count as in flight")
    assert client.completions.create(model=MODEL, prompt="He that", max_tokens=3).choices[0].text is not None


def test_a_client_disconnecting_mid_stream_frees_its_slot(server):
    generated = server.metric("hf_tpu_generated_tokens_total")
    response = _stream(server, "The king said", 240)
    assert server.metric("hf_tpu_kv_blocks_in_use") > 0
    response.close()  # the client goes away after its first chunk
    _wait_for(lambda: server.metric("hf_tpu_requests_in_flight") == 0, "a disconnected stream stays in flight")
    _wait_for(lambda: server.metric("hf_tpu_kv_blocks_in_use") == 0, "a disconnected stream keeps its KV blocks")
    # Cancelled, not run to its end: fewer than the 240 tokens asked for were generated.
    assert server.metric("hf_tpu_generated_tokens_total") - generated < 240


def test_an_abandoned_non_streamed_request_frees_its_slot(server):
    """A client that sends a long non-streamed request and goes away: the request is cancelled in the batch (its
    slot and KV blocks freed), not run to its max_tokens."""
    generated = server.metric("hf_tpu_generated_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": "The king said", "max_tokens": 240, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_TIMEOUT_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    try:
        _wait_for(lambda: server.metric("hf_tpu_kv_blocks_in_use") > 0, "the request never reached the batch")
    finally:
        sock.close()  # the client goes away before its answer
    _wait_for(lambda: server.metric("hf_tpu_requests_in_flight") == 0, "an abandoned request stays in flight")
    _wait_for(lambda: server.metric("hf_tpu_kv_blocks_in_use") == 0, "an abandoned request keeps its KV blocks")
    assert server.metric("hf_tpu_generated_tokens_total") - generated < 240  # cancelled, not run to its end
    assert 'status="499"' in server.get("/metrics")[1].decode()  # counted as the client closing it


def test_models_retrieve_names_the_served_model(client):
    for name in (SERVED, MODEL, str(default_model_path())):  # any name the model is served under
        model = client.models.retrieve(name)
        assert model.id == SERVED and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert "gpt-9" in info.value.body["message"] and info.value.body["param"] == "model"


def test_usage_chunk_only_when_stream_options_ask_for_it(client):
    hi = [{"role": "user", "content": "hi"}]
    for create, kwargs in ((client.completions.create, {"prompt": "He that"}),
                           (client.chat.completions.create, {"messages": hi})):  # fmt: skip
        plain = list(create(model=MODEL, max_tokens=3, stream=True, **kwargs))
        assert plain and all(c.choices for c in plain)  # the usual chunk.choices[0] loop never meets an empty one
        assert all(c.usage is None for c in plain)
        asked = list(create(model=MODEL, max_tokens=3, stream=True, stream_options={"include_usage": True}, **kwargs))
        assert asked[-1].choices == [] and 0 < asked[-1].usage.completion_tokens <= 3
        assert all(c.choices for c in asked[:-1])


def test_responses_answer_as_chat_does(server, client, cpu):
    """``/v1/responses`` with the openai client: a JSON ``response`` unless streamed (OpenAI's default), the text
    CPU's greedy chat answer, streamed deltas joining to it, the sampling fields honoured per request."""
    reply = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0)
    assert reply.object == "response" and reply.status == "completed" and reply.model == SERVED
    assert reply.output_text == cpu.chat("Hello there", 8)
    assert reply.usage.output_tokens <= 8 and reply.usage.input_tokens > 0
    events = list(client.responses.create(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0,
                                          stream=True))  # fmt: skip
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=5,
                                          extra_body=NO_EOS)  # fmt: skip
    sampled = client.responses.create(model=MODEL, instructions="Be brief.", input="Speak", max_output_tokens=6,
                                      temperature=1.0, extra_body={"seed": 5, **NO_EOS})  # fmt: skip
    assert sampled.output_text == chat.choices[0].message.content  # the same seeded draw as chat's


def test_responses_are_checked_at_the_door(server, client):
    def refused(**body):
        status, answer, _ = server.post("/v1/responses", {"model": MODEL, **body})
        assert status == 400 and set(answer) == {"error"}, (status, answer)  # OpenAI's error shape, never 5xx
        return answer["error"]["param"]

    assert refused(max_output_tokens=4) == "input"
    assert refused(input="hi", temperature=-1) == "temperature"
    assert refused(input="hi", top_p=0) == "top_p"
    assert refused(input=5) == "input"
    assert refused(input=[{"role": "wizard", "content": "x"}]) == "input[0].role"
    assert refused(input=[{"type": "image", "url": "x"}]) == "input[0]"
    assert refused(input="hi", previous_response_id="resp_1") == "previous_response_id"
    assert refused(input="hi", frobnicate=1) == "frobnicate"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", temperature=-1)
    assert info.value.param == "temperature"


def test_after_warmup_a_mixed_load_compiles_nothing_and_loses_nothing(server, client, cpu):
    before = server.metric("hf_tpu_compiles_total")
    finished = server.metric("hf_tpu_generated_tokens_total")
    lock, answers = threading.Lock(), {}

    def one(i):
        prompt = " ".join(PROMPTS[j % len(PROMPTS)] for j in range(i % 5 + 1))  # 1 to 5 phrases
        kind, tokens = i % 2, 2 + i % 7
        if kind:
            text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0)
            text = text.choices[0].text
        else:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, stream=True)
            text = "".join(c.choices[0].text for c in stream if c.choices)
        with lock:
            answers[i] = (prompt, tokens, text)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(64)))
    assert sorted(answers) == list(range(64))  # every request answered
    for i in (0, 1, 17, 63):  # a sample checked against CPU (all 64 would double the test's time)
        prompt, tokens, text = answers[i]
        assert text == cpu(prompt, tokens), i
    assert server.metric("hf_tpu_compiles_total") == before
    assert server.metric("hf_tpu_generated_tokens_total") > finished
    assert server.metric("hf_tpu_queue_depth") == 0 and server.metric("hf_tpu_requests_in_flight") == 0


NO_EOS = {"ignore_eos": True}


def test_greedy_and_sampled_requests_in_one_batch(server, client, cpu):
    before = server.metric("hf_tpu_compiles_total")
    prompt = "The king said"
    ids = cpu.tok(prompt)["input_ids"]

    def one(kind):
        temperature, seed = (0.0, None) if kind == "greedy" else (1.0, 1234)
        extra = {"seed": seed} if seed is not None else {}
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=temperature,
                                          extra_body=NO_EOS, **extra)  # fmt: skip
        return reply.choices[0].text

    with ThreadPoolExecutor(4) as pool:  # 4 slots: all four requests share the steps
        greedy, sampled, greedy_again, sampled_again = pool.map(one, ["greedy", "sampled", "greedy", "sampled"])
    assert greedy == greedy_again == cpu(prompt, 12)
    assert sampled == sampled_again != greedy  # seed 1234 repeats its draw exactly
    assert sampled == cpu.tok.decode(cpu_sampled(cpu, ids, 12, temperature=1.0, seed=1234))
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=99,
                                      extra_body=NO_EOS)  # fmt: skip
    assert other.choices[0].text != sampled  # another seed, another answer
    assert server.metric("hf_tpu_compiles_total") == before


def test_penalties_and_biases_per_request_equal_cpu_processors(server, client, cpu):
    """presence/frequency/repetition penalties, logit_bias and min_tokens, mixed in one batch, each equal to CPU
    greedy generate with transformers' processors (presence and frequency: OpenAI's formula over the new tokens)."""
    from test_penalties import OpenAIPenalties
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    before = server.metric("hf_tpu_compiles_total")
    prompt = "The king said"
    ids = cpu.tok(prompt)["input_ids"]
    eos = int(cpu.model.generation_config.eos_token_id)
    cases = [
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, [RepetitionPenaltyLogitsProcessor(1.3),
                                                              OpenAIPenalties(len(ids), 0.5, 1.5)]),
        ({"repetition_penalty": 1.05, "logit_bias": {"100": 8.0}}, [SequenceBiasLogitsProcessor({(100,): 8.0}),
                                                                    RepetitionPenaltyLogitsProcessor(1.05)]),
        ({"min_tokens": 3, "logit_bias": {str(eos): 100}, "repetition_penalty": 1.0},
         [SequenceBiasLogitsProcessor({(eos,): 100.0}), MinNewTokensLengthLogitsProcessor(len(ids), 3, eos)]),
    ]  # fmt: skip

    def one(body):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=body)

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(one, [body for body, _ in cases]))
    for reply, (body, procs) in zip(replies, cases, strict=True):
        want = cpu.complete(ids, 10, repetition_penalty=1.0, logits_processor=LogitsProcessorList(procs))
        assert reply.choices[0].text == want, body
    assert replies[2].choices[0].finish_reason == "stop"  # min_tokens held the end of sequence back 3 tokens
    assert server.metric("hf_tpu_compiles_total") == before


def test_n_choices_plain_and_streamed(client, cpu):
    prompt = "O Romeo,"
    ids = cpu.tok(prompt)["input_ids"]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=7, n=3,
                                      extra_body=NO_EOS)  # fmt: skip
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) > 1 and reply.usage.completion_tokens == 18
    for i, text in enumerate(texts):  # choice i: upstream's fork of the request, its own noise
        assert text == cpu.tok.decode(cpu_sampled(cpu, ids, 6, temperature=1.0, seed=7, choice=i))
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak"}],
                                            max_tokens=5, temperature=1.0, seed=7, n=3, stream=True)  # fmt: skip
    joined, finished = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            joined[c.index] = joined.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(joined) == [0, 1, 2] and sorted(finished) == [0, 1, 2]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak"}],
                                           max_tokens=5, temperature=1.0, seed=7, n=3)  # fmt: skip
    assert [joined[c.index] for c in plain.choices] == [c.message.content for c in plain.choices]


def test_stop_cuts_before_the_stop_string(client, cpu):
    prompt = "The king said"
    whole = cpu(prompt, 30)
    stop = whole.split()[3]  # a word a few tokens in
    cut = whole[: whole.index(stop)]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    short = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stop="zzz")
    assert short.choices[0].finish_reason == "length"


def test_logprobs_equal_cpu_log_softmax(client, cpu):
    prompt = "My lord, the"
    ids = cpu.tok(prompt)["input_ids"]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.8, seed=3, logprobs=2,
                                      extra_body=NO_EOS)  # fmt: skip
    got = reply.choices[0].logprobs
    tokens = cpu_sampled(cpu, ids, 5, temperature=0.8, seed=3)
    log_probs = torch.log_softmax(cpu_logits(cpu, ids + tokens)[len(ids) - 1 : -1], dim=-1)
    assert got.tokens == [cpu.tok.decode([t]) for t in tokens]
    for k, token in enumerate(tokens):
        assert got.token_logprobs[k] == pytest.approx(log_probs[k, token].item(), abs=1e-4)
        values, top = log_probs[k].topk(2)
        assert list(got.top_logprobs[k]) == [cpu.tok.decode([t]) for t in top.tolist()]
        assert list(got.top_logprobs[k].values()) == pytest.approx(values.tolist(), abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)  # greedy: the chosen is the top one


def test_echo_with_max_tokens_0_scores_the_prompt_as_cpu_log_softmax(client, cpu):
    """What lm-evaluation-harness's local-completions sends for a loglikelihood: echo, max_tokens 0, logprobs."""
    prompt = "My lord, the king is here"
    ids = cpu.tok(prompt)["input_ids"]
    log_probs = torch.log_softmax(cpu_logits(cpu, ids), dim=-1)  # row k: the distribution of token k + 1
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    choice = reply.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 0)
    got = choice.logprobs
    assert got.tokens == [cpu.tok.decode([t]) for t in ids]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.text_offset == [len(cpu.tok.decode(ids[:k], skip_special_tokens=True)) for k in range(len(ids))]
    for k in range(1, len(ids)):
        assert got.token_logprobs[k] == pytest.approx(log_probs[k - 1, ids[k]].item(), abs=1e-5), k
        values, top = log_probs[k - 1].topk(3)
        assert list(got.top_logprobs[k]) == [cpu.tok.decode([t]) for t in top.tolist()]
        assert list(got.top_logprobs[k].values()) == pytest.approx(values.tolist(), abs=1e-5)
        greedy = ids[k] == top[0].item()  # lm-eval's check: the token's value is the largest of its top_logprobs
        assert (got.token_logprobs[k] == max(got.top_logprobs[k].values())) == greedy, k
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, n=2)
    assert [c.text for c in plain.choices] == [prompt, prompt] and plain.choices[0].logprobs is None


def test_echo_with_generated_tokens_returns_both_logprobs(client, cpu):
    prompt = "The king said"
    ids = cpu.tok(prompt)["input_ids"]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    with torch.no_grad():
        tokens = cpu.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids) :].tolist()
    assert choice.text == prompt + cpu.tok.decode(tokens, skip_special_tokens=True)
    full = ids + tokens
    log_probs = torch.log_softmax(cpu_logits(cpu, full), dim=-1)
    got = choice.logprobs
    assert got.tokens == [cpu.tok.decode([t]) for t in full] and got.token_logprobs[0] is None
    for k in range(1, len(full)):
        assert got.token_logprobs[k] == pytest.approx(log_probs[k - 1, full[k]].item(), abs=1e-4), k
        values, top = log_probs[k - 1].topk(2)
        assert list(got.top_logprobs[k].values()) == pytest.approx(values.tolist(), abs=1e-4), k
    assert got.text_offset[len(ids)] == len(prompt) and got.text_offset == sorted(got.text_offset)
    assert reply.usage.completion_tokens == len(tokens)


def test_echo_bad_combinations_name_the_field(server):
    for body, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"echo": True, "stream": True, "max_tokens": 0}, "echo"),
        ({"echo": True, "max_tokens": 0, "logprobs": 6}, "logprobs"),
        ({"echo": True, "max_tokens": 0, "best_of": 2, "n": 3}, "best_of"),
        ({"best_of": 3, "n": 2, "stream": True}, "best_of"),
        ({"echo": True, "max_tokens": 0, "logprobs": 1, "prompt": "the king " * 200}, "prompt"),
    ):  # fmt: skip
        status, answer, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x", **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
        assert param in answer["error"]["message"], answer


def _cpu_under(cpu, ids: list[int], grammar: str, new_tokens: int) -> str:
    """CPU greedy ``generate`` under ``grammar`` (llguidance's mask applied by a logits processor after the model's
    repetition penalty, the step's order)."""
    from test_structured_output import CpuGrammar
    from transformers import LogitsProcessorList

    from hf_tpu.serving import _grammar

    ll_tok = _grammar.llguidance_tokenizer(cpu.tok, cpu.model.config.vocab_size)
    grammar_mask = CpuGrammar(grammar, ll_tok, len(ids), cpu.model.config.vocab_size)
    out = cpu.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([grammar_mask]))  # fmt: skip
    return cpu.tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_structured_output_equals_cpu_under_the_same_grammar(server, client, cpu):
    from hf_tpu.serving._grammar import grammar_of

    before = server.metric("hf_tpu_compiles_total")
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "loud": {"type": "boolean"}},
              "required": ["mood", "loud"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # fmt: skip  (llguidance's option: compact JSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": schema}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "How art thou?"}],
                                          max_tokens=40, temperature=0, response_format=fmt)  # fmt: skip
    ids = list(cpu.tok.apply_chat_template([{"role": "user", "content": "How art thou?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
    text = chat.choices[0].message.content
    assert text == _cpu_under(cpu, ids, grammar_of({"response_format": fmt})[0], 40)
    assert set(json.loads(text)) == {"mood", "loud"} and chat.choices[0].finish_reason == "stop"
    choices = ["Ay", "Nay", "Perchance"]
    for prompt in PROMPTS[:3]:  # vLLM's extra fields ride in the body (extra_body with the openai client)
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": choices})  # fmt: skip
        expected = _cpu_under(cpu, cpu.tok(prompt)["input_ids"], grammar_of({"guided_choice": choices})[0], 8)
        assert done.choices[0].text == expected and expected in choices
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, stream=True, temperature=0,
                                       extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"})  # fmt: skip
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == _cpu_under(cpu, cpu.tok(PROMPTS[0])["input_ids"], grammar_of({"guided_regex":
                                  "[0-9]{2}-[a-z]{3}"})[0], 12)  # fmt: skip
    assert server.metric("hf_tpu_compiles_total") == before
    for body, param in [({"guided_regex": "(["}, "guided_regex"), ({"guided_grammar": "root ::= ("}, "guided_grammar"),
                        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex")]:  # fmt: skip
        status, answer, _ = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
        assert status == 400 and answer["error"]["param"] == param, answer


def test_prompts_as_token_ids_and_lists_answer_as_their_texts(server, cpu):
    """vLLM's prompt forms (what lm-eval's local-completions sends: token ids, several prompts in one request): each
    prompt is run as its own, its choices numbered after the previous prompt's."""
    texts = ["The king said", "O Romeo,"]
    ids = [cpu.tok(t)["input_ids"] for t in texts]
    greedy = {"model": MODEL, "max_tokens": 5, "temperature": 0, "n": 2}
    by_text = [server.post("/v1/completions", {**greedy, "prompt": t})[1]["choices"][0]["text"] for t in texts]
    assert by_text == [cpu(t, 5) for t in texts]
    for prompt in (ids, texts):
        status, body, _ = server.post("/v1/completions", {**greedy, "prompt": prompt})
        assert status == 200, body
        assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, by_text[0]), (1, by_text[0]),
                                                                       (2, by_text[1]), (3, by_text[1])]  # fmt: skip
        assert body["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    status, body, _ = server.post("/v1/completions", {**greedy, "n": 1, "prompt": ids[1]})
    assert [c["text"] for c in body["choices"]] == [by_text[1]]
    echo = {"model": MODEL, "max_tokens": 0, "echo": True, "logprobs": 1}
    by_ids = server.post("/v1/completions", {**echo, "prompt": ids})[1]["choices"]
    for k, text in enumerate(texts):
        alone = server.post("/v1/completions", {**echo, "prompt": text})[1]["choices"][0]
        assert by_ids[k]["text"] == cpu.tok.decode(ids[k], skip_special_tokens=True)
        assert by_ids[k]["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
    vocab = cpu.model.config.vocab_size
    for prompt, param in (([5, vocab], "prompt"), ([[5], [6, vocab + 1]], "prompt[1]"), ([5, "x"], "prompt"),
                          ([[]], "prompt[0]"), ([-1], "prompt[0]")):  # fmt: skip
        status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == param, (prompt, body)
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": texts, "stream": True})
    assert status == 400 and body["error"]["param"] == "prompt", body


def test_best_of_answers_the_n_most_likely_of_its_choices(server):
    """A seeded request's choices are the same whether they are answered (n) or ranked (best_of): best_of answers the
    n of them with the highest sum of the chosen tokens' logprobs, most likely first."""
    body = {"model": MODEL, "prompt": "The king said", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    status, every, _ = server.post("/v1/completions", {**body, "n": 4, "logprobs": 0})
    assert status == 200, every
    ranked = sorted(every["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert len({c["text"] for c in ranked}) > 1  # (distinct choices: the ranking is a real choice)
    for extra in ({}, {"logprobs": 0}):
        status, best, _ = server.post("/v1/completions", {**body, "n": 2, "best_of": 4, **extra})
        assert status == 200, best
        assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
        assert [c["index"] for c in best["choices"]] == [0, 1]
        assert (best["choices"][0]["logprobs"] is None) == (not extra)
        assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]  # all four were generated


def _import_lm_eval() -> None:
    """Import lm-eval (skip without it), keeping ``os.environ`` as it was (importing lm_eval and scikit-learn set
    variables of their own)."""
    with mock.patch.dict(os.environ):
        pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'hf-tpu[eval]')")
        import lm_eval.models.huggingface  # noqa: F401
        import lm_eval.models.openai_completions  # noqa: F401
        import lm_eval.tasks  # noqa: F401


def _lm_eval_tasks(directory) -> list[str]:
    """A multiple-choice task and a generate_until task of lm-eval over jsonl files in ``directory`` (nothing from
    the Hub: lm-eval reads them with ``datasets``' json loader, its cache in ``directory`` too)."""
    mc = [("The king said", [" to", " that", " my lord"], 0), ("O Romeo,", [" Romeo", " the king", " and"], 1),
          ("My lord, the", [" king", " queen", " duke"], 2)]  # fmt: skip
    gen = [("The king", "'st"), ("O Romeo", ","), ("Good morrow,", " my lord")]
    rows = {"mc": [{"question": q, "choices": c, "answer": a} for q, c, a in mc],
            "gen": [{"prompt": p, "target": t} for p, t in gen]}  # fmt: skip
    for name, docs in rows.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = ("dataset_path: json\ndataset_kwargs:\n  cache_dir: {dir}/cache\n  data_files:\n"
              "    test: {dir}/{name}.jsonl\ntest_split: test\n")  # fmt: skip
    (directory / "mc.yaml").write_text(
        "task: hf_tpu_tiny_mc\n" + common.format(dir=directory, name="mc") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )  # fmt: skip
    # max_gen_toks 48: the model's generation config sets max_new_tokens 48, which transformers' generate prefers to
    # the max_length lm-eval's hf backend derives from max_gen_toks (so both backends generate up to 48 tokens)
    (directory / "gen.yaml").write_text(
        "task: hf_tpu_tiny_gen\n" + common.format(dir=directory, name="gen") + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 48\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )  # fmt: skip
    return ["hf_tpu_tiny_mc", "hf_tpu_tiny_gen"]


def _lm_eval(model, model_args: str, tasks: list[str], directory) -> tuple[dict, dict]:
    """lm-eval's scores and its per-document answers (log-likelihoods, generated texts) for ``model``."""
    with mock.patch.dict(os.environ):  # (importing lm_eval and scikit-learn sets variables of their own)
        import lm_eval
        from lm_eval.tasks import TaskManager

        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=1,
                                      log_samples=True, task_manager=TaskManager(include_path=str(directory)))
    scores = {t: {k: float(v) for k, v in r.items() if k.endswith(",none")} for t, r in out["results"].items()}
    answers = {t: [[r[0] for r in s["resps"]] for s in samples] for t, samples in out["samples"].items()}
    return scores, answers


def test_lm_eval_local_completions_scores_equal_its_hf_backend_on_cpu(server, tmp_path):
    """lm-evaluation-harness 0.4.13's local-completions with its defaults (token-id prompts, echo with logprobs for
    the log-likelihoods, stop strings and a seed for generate_until) against this server, and its hf backend on CPU:
    the same scores, the same log-likelihood per choice (float32 on the simulated device at 'highest', as the
    suite runs it), the same generated texts."""
    _import_lm_eval()
    path = default_model_path()
    tasks = _lm_eval_tasks(tmp_path)
    # add_bos_token: the hf backend encodes with the tokenizer's BOS, local-completions only when asked
    api_args = (f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={path},tokenizer_backend=huggingface,"
                "max_length=256,add_bos_token=True,num_concurrent=1,max_retries=1")  # fmt: skip
    served, served_answers = _lm_eval("local-completions", api_args, tasks, tmp_path)
    cpu, cpu_answers = _lm_eval("hf", f"pretrained={path},device=cpu,max_length=256", tasks, tmp_path)
    assert served == cpu
    mc, gen = tasks
    for got, want in zip(served_answers[mc], cpu_answers[mc]):
        assert [g[1] for g in got] == [w[1] for w in want]  # is_greedy
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert served_answers[gen] == cpu_answers[gen] and any(a[0] for a in cpu_answers[gen])


def test_lm_eval_hf_backend_on_the_tpu_device_scores_as_on_cpu(tmp_path):
    """lm-eval 0.4.13's hf backend with the model on the (simulated) ``tpu`` device, hf_tpu enabled: its single-device
    names are cuda, cpu, mps, npu, xpu and hpu (``device=tpu`` alone runs on CPU), so the model args route through
    ``parallelize=True,device_map=tpu``, which places the model on ``tpu`` and sends the inputs there."""
    _import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    path = default_model_path()
    tasks = _lm_eval_tasks(tmp_path)
    lm = HFLM(pretrained=str(path), parallelize=True, device_map="tpu", device="tpu", max_length=256, batch_size=1)
    assert lm.model.device.type == "tpu" and lm.device.type == "tpu"
    on_tpu, tpu_answers = _lm_eval(lm, None, tasks, tmp_path)
    cpu, cpu_answers = _lm_eval("hf", f"pretrained={path},device=cpu,max_length=256", tasks, tmp_path)
    assert on_tpu == cpu
    for got, want in zip(tpu_answers[tasks[0]], cpu_answers[tasks[0]]):
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert tpu_answers[tasks[1]] == cpu_answers[tasks[1]]


def test_first_token_distribution_matches_cpu_warpers(server, client, cpu):
    """Many seeded draws of one first token, counted against transformers' warpers on CPU's logits (chi-square)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    before = server.metric("hf_tpu_compiles_total")
    prompt = "What is the"
    temperature, top_k, top_p = 1.3, 6, 0.95
    logits = cpu_scores(cpu, cpu.tok(prompt)["input_ids"])
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        logits = warper(None, logits)
    probs = torch.softmax(logits[0], dim=-1).double()

    def draw(seed):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=temperature,
                                          top_p=top_p, seed=seed, n=8, extra_body={"top_k": top_k, **NO_EOS})
        return [c.text for c in reply.choices]  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        drawn = [text for batch in pool.map(draw, range(40)) for text in batch]
    support = (probs > 0).nonzero()[:, 0].tolist()
    names = [cpu.tok.decode([t]) for t in support]  # counted by text, as the answers carry it
    assert len(set(names)) == len(names) and set(drawn) <= set(names), (set(drawn), names)
    observed = torch.tensor([float(drawn.count(name)) for name in names], dtype=torch.float64)
    expected = probs[support] * len(drawn)
    small = expected < 5  # pooled into one bin, so that every bin expects at least 5 draws
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    stat = (((observed - expected) ** 2) / expected).sum().item()
    df = expected.numel() - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / (2 / (9 * df)) ** 0.5  # Wilson-Hilferty
    assert 0.5 * math.erfc(z / 2**0.5) > 1e-3, (stat, df, observed.tolist(), expected.tolist())
    assert server.metric("hf_tpu_compiles_total") == before


def test_sigterm_stops_the_server(server):
    server.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: the process ends by SIGTERM.
    assert server.proc.wait(timeout=SAFETY_TIMEOUT_S) in (0, -signal.SIGTERM), server.output()[-3000:]
    assert "Finished server process" in server.output()
