"""``hf-tpu serve``'s refusals before it loads anything, and its guard on its own (no server started)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

from _server import ROOT
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.cli.serve import EXIT_PORT_TAKEN


def test_a_taken_port_is_refused_in_one_line_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "hf_tpu.cli", "serve", "--simulate", "--port", str(port)], capture_output=True,
            text=True, timeout=SAFETY_TIMEOUT_S, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
    assert proc.returncode == EXIT_PORT_TAKEN != 0, (proc.stdout, proc.stderr)
    [line] = proc.stderr.strip().splitlines()
    assert f"port {port}" in line and "--port" in line and "taken" in line
    assert proc.stdout == ""  # nothing loaded, nothing warmed up, never "listening"


def test_a_unix_socket_path_that_cannot_serve_is_named(tmp_path):
    from hf_tpu.serving.server import uds_unusable

    short = tempfile.mkdtemp(prefix="hf-tpu-", dir="/tmp")  # a pytest tmp_path may pass 107 bytes with a name
    try:
        path = os.path.join(short, "s.sock")
        assert uds_unusable(path) is None  # nothing there: the server makes it
        assert "does not exist" in uds_unusable(os.path.join(short, "no", "s.sock"))
        assert "at most 107 bytes" in uds_unusable(os.path.join(short, "x" * 120))
        with open(path, "w"):
            pass
        assert "not a socket" in uds_unusable(path)
        os.remove(path)
        with socket.socket(socket.AF_UNIX) as live:
            live.bind(path)
            live.listen()
            assert "already listens" in uds_unusable(path)
        assert uds_unusable(path) is None  # a stale socket file: replaced when the server binds
    finally:
        shutil.rmtree(short)


def test_health_says_the_worker_died():
    """(No server: the guard alone.) Once the continuous-batching worker died, /health answers 503 saying so, not
    transformers' answer, while ``hf-tpu serve`` exits (tests/serving/test_serve_hardening.py: the exit)."""
    import asyncio
    import json

    from hf_tpu.serving._guard import Guard, Readiness

    readiness = Readiness()
    readiness.set_ready()
    guard = Guard(None, served={"m"}, canonical="m", max_pending=1, metrics=None, readiness=readiness)
    sent = []

    async def send(message):
        sent.append(message)

    async def ask():
        await guard({"type": "http", "path": "/health", "method": "GET"}, None, send)

    readiness.worker_failure = lambda: "RuntimeError: boom"
    asyncio.run(ask())
    assert sent[0]["status"] == 503
    answer = json.loads(sent[1]["body"])
    assert answer["reason"] == "cb_worker_dead" and "RuntimeError: boom" in answer["detail"]


def test_embeddings_bodies_are_checked_then_not_served():
    """(The guard alone.) ``/v1/embeddings`` bodies go through their request model (a wrong one: 400 naming the
    field); a valid one is answered 404: ``hf-tpu serve`` serves a causal LM."""
    import json

    from hf_tpu.serving._guard import Guard
    from hf_tpu.serving._openai import EMBEDDINGS

    guard = Guard(None, served={"m"}, canonical="m", max_pending=1, metrics=None)

    def answer(body) -> tuple[int, dict]:
        refusal, _ = guard._check(EMBEDDINGS, json.dumps(body).encode())
        return refusal[0], json.loads(refusal[1])["error"]

    status, error = answer({"input": []})
    assert status == 400 and error["param"] == "input"
    assert answer({"input": "x", "dimensions": 2**31})[1]["param"] == "dimensions"
    assert answer({"input": "x", "encoding_format": "hex"})[1]["param"] == "encoding_format"
    status, error = answer({"input": ["a", "b"], "model": "m"})
    assert status == 404 and "causal LM" in error["message"]
