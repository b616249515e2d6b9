"""Start ``hf-tpu serve --simulate`` on 127.0.0.1 (a free port), or on a unix domain socket, for a test, and always
stop it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.serving.uds import UnixHTTPConnection

ROOT = Path(__file__).resolve().parents[2]
# The smallest ladder the shipped model allows: one query rung (32 tokens), KV rungs 0/256/1024 (3 step shapes).
SMALL_FLAGS = ["--slots", "4", "--max-batch-tokens", "32", "--min-step-tokens", "32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int | None, log: Path, uds: str | None = None) -> None:
        self.proc, self.port, self.log, self.uds = proc, port, log, uds
        # over a unix socket the host part is a placeholder (clients connect through a uds transport)
        self.url = "http://localhost" if uds is not None else f"http://127.0.0.1:{port}"
        self.health_before_ready: list[tuple[int, dict]] = []  # /health's answers while the server warmed up

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _over_uds(self, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes, dict]:
        conn = UnixHTTPConnection(self.uds, SAFETY_TIMEOUT_S)
        try:
            conn.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
            r = conn.getresponse()
            return r.status, r.read(), dict(r.headers)
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        if self.uds is not None:
            return self._over_uds("GET", path)[:2]
        try:
            with urllib.request.urlopen(self.url + path, timeout=SAFETY_TIMEOUT_S) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body, raw: bool = False) -> tuple[int, dict, dict]:
        data = body if raw else json.dumps(body).encode()
        if self.uds is not None:
            status, payload, headers = self._over_uds("POST", path, data)
            return status, json.loads(payload or b"null"), headers
        request = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=SAFETY_TIMEOUT_S) as r:
                return r.status, json.loads(r.read() or b"null"), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null"), dict(e.headers)

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.contextmanager
def running_server(tmp_path: Path, *flags: str, uds: bool = False, env: dict | None = None, killable: bool = False):
    """A server started with ``flags``, ready (warm) when the block starts, stopped (SIGTERM, then kill) after.
    ``uds``: on a unix domain socket (in a short temporary directory: a socket path has at most 107 bytes) instead
    of a TCP port; ``env``: variables added to the server's environment; ``killable``: started through
    ``_killable_serve.py`` (SIGUSR1 kills its continuous-batching worker)."""
    if uds:
        sock_dir = tempfile.mkdtemp(prefix="hf-tpu-", dir="/tmp")
        port, path = None, os.path.join(sock_dir, "serve.sock")
        where = ["--uds", path]
        log = tmp_path / "serve-uds.log"
    else:
        port, path = free_port(), None
        where = ["--port", str(port)]
        log = tmp_path / f"serve-{port}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    command = [str(Path(__file__).with_name("_killable_serve.py"))] if killable else ["-m", "hf_tpu.cli"]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, *command, "serve", "--simulate", *where, *SMALL_FLAGS, *flags],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    server = Server(proc, port, log, uds=path)
    try:
        deadline = time.monotonic() + SAFETY_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{server.output()[-4000:]}"
            assert time.monotonic() < deadline, f"the server was not up in time:\n{server.output()[-4000:]}"
            if "listening on" in server.output():
                with contextlib.suppress(OSError):
                    status, body = server.get("/health")
                    if status == 200:
                        break
                    server.health_before_ready.append((status, json.loads(body or b"null")))
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=SAFETY_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        if path is not None:
            with contextlib.suppress(OSError):
                os.remove(path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))
