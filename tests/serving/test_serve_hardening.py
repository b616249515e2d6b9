"""``hf-tpu serve --simulate --uds PATH``: one server on a unix domain socket for the module, answered through the
openai client over that socket, against CPU ``generate``.
"""

from __future__ import annotations

import os

import openai
import pytest
import torch
from _server import running_server
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import default_model_path

MODEL = "tiny-lm"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve"), uds=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import httpx2

    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=server.uds), timeout=SAFETY_TIMEOUT_S)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http, max_retries=0)
    http.close()


@pytest.fixture(scope="module")
def cpu():
    """The shipped model on CPU, greedy with its generation config (the server honours its repetition penalty)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def complete(ids: list[int], new_tokens: int) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    def text(prompt: str, new_tokens: int) -> str:
        return complete(tok(prompt)["input_ids"], new_tokens)

    def chat(content: str, new_tokens: int) -> str:
        messages = [{"role": "user", "content": content}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return complete(list(ids["input_ids"]), new_tokens)

    text.chat = chat
    return text


def _tcp_sockets(pid: int) -> list[str]:
    """The TCP sockets (IPv4 and IPv6) process ``pid`` holds, as lines of /proc/PID/net/tcp*."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            found += [line for line in f.read().splitlines()[1:] if line.split()[9] in inodes]
    return found


def test_openai_client_over_a_unix_socket_gets_cpu_greedy_and_no_tcp_socket_is_open(server, client, cpu):
    done = client.completions.create(model=MODEL, prompt="The king said", max_tokens=8, temperature=0)
    assert done.choices[0].text == cpu("The king said", 8)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == cpu.chat("Hello there", 8)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert f"listening on unix socket {server.uds}" in server.output()
    assert _tcp_sockets(server.proc.pid) == []
