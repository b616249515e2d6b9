"""``hf-tpu serve`` as a Ray Serve deployment: N replicas, one per TPU VM (or per chip), behind one endpoint.

Each replica of :class:`HfTpuServer` runs ``hf-tpu serve`` (hf_tpu's OpenAI-compatible server: transformers' server,
continuous batching, warm-up, ``/metrics``; with ``tp=N``, N ranks over the replica's chips) as a child process on
127.0.0.1 of its node, waits until its ``/health`` answers 200 (warm-up done), and forwards the HTTP requests Ray
Serve's proxy routes to it, streamed answers (``"stream": true``) included. The server keeps its main thread, its
signals and its own warm-up and compile cache, as it has outside Ray; Ray Serve adds the one endpoint, the routing
and the replica count (``num_replicas``, or ``autoscaling_config``: Ray's to decide). Ray Serve's health check asks
the replica, which fails when its server has exited, so Ray replaces it. A replica's child is stopped with the
replica (SIGTERM, and the kernel's parent-death signal if the replica dies first).

Replicas given one compile-cache directory (``compile_cache=``, ``--compile-cache`` among ``serve_args`` or
``HF_TPU_COMPILE_CACHE``; on a filesystem every node mounts) start one after the other, as
:class:`hf_tpu.ray.HfTpuGenerate`'s actors warm up: each holds the directory's warm-up lock from starting its server
until the server is ready, so the first compiles and stores the step graphs and the later ones load them (0
compiles), instead of all compiling the same graphs at once. Not with ``tp > 1``, whose step graphs are not cached.

Ray Serve is imported by this module: import it where Ray is installed (``pip install 'hf-tpu[ray]'``).

Example (Python, on a Ray cluster whose nodes each have TPU chips)::

    from ray import serve
    from hf_tpu.ray.serve import build_app
    serve.run(build_app("/models/llama", num_replicas=4, chips_per_replica=4, tp=4), route_prefix="/")

or Ray Serve's own command line, through the application builder :func:`app`::

    serve run hf_tpu.ray.serve:app model=/models/llama num_replicas=4 chips_per_replica=4 tp=4
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray import serve

from hf_tpu.errors import HfTpuRuntimeError, UserError
from hf_tpu.ray.local import free_port

__all__ = ["REPLICA_HEADER", "HfTpuServer", "app", "build_app"]

#: The response header naming the replica that answered (its Ray Serve replica id).
REPLICA_HEADER = "x-hf-tpu-replica"
#: Ray's valid per-task TPU counts (ray/_private/accelerators/tpu.py, TPU_VALID_CHIP_OPTIONS, Ray 2.60).
CHIP_COUNTS = (1, 2, 4, 8)
# Response headers not passed on: the proxy frames the body itself.
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}
_POLL_S = 0.5
#: One health probe of the replica's server (a probe, polled until the start deadline; not real work).
_PROBE_S = 5
#: How long a replica's server has to exit after SIGTERM before it is killed.
_STOP_GRACE_S = 60


def _compile_cache_dir(serve_args: Sequence[str]) -> str | None:
    """The compile-cache directory the server will use: its ``--compile-cache`` flag (the last one, as argparse
    takes it), else ``HF_TPU_COMPILE_CACHE``, else None."""
    found = None
    for i, arg in enumerate(serve_args):
        if arg == "--compile-cache" and i + 1 < len(serve_args):
            found = serve_args[i + 1]
        elif arg.startswith("--compile-cache="):
            found = arg.partition("=")[2]
    if found is None:
        from hf_tpu import _env

        found = _env.COMPILE_CACHE.get()
    return found or None


def _warmup_lock(cache_dir: str):
    """The compile cache's warm-up lock, the one :class:`hf_tpu.ray.HfTpuGenerate`'s actors take (released by the OS
    if the replica dies holding it)."""
    from hf_tpu.compile_cache import exclusive
    from hf_tpu.ray.batch import WARMUP_LOCK

    return exclusive(Path(cache_dir).expanduser() / WARMUP_LOCK)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when the replica's process dies (prctl PR_SET_PDEATHSIG), so that a killed
    replica leaves no server holding its chips."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class HfTpuServer:
    """One replica: ``hf-tpu serve`` on 127.0.0.1 of this node, and Ray Serve's requests forwarded to it.

    Args:
        model: the model directory (default: the model shipped with hf_tpu).
        serve_args: more ``hf-tpu serve`` flags (``["--slots", "16", "--compile-cache", "/mnt/cache"]``).
        tp: chips per model (``hf-tpu serve --tp``); at most the replica's chips.
        simulate: run the server on the simulated ``tpu`` device (``--simulate``).
        startup_timeout_s: how long loading and warm-up may take before the replica gives up (not counting the wait
            for another replica's warm-up on the same compile cache).

    Raises:
        RuntimeError: the server exited or was not ready in ``startup_timeout_s`` (the end of its log is quoted).
    """

    def __init__(self, model: str | None = None, serve_args: Sequence[str] = (), tp: int = 1, simulate: bool = False,
                 startup_timeout_s: float = 1800.0) -> None:  # fmt: skip
        cache = _compile_cache_dir(serve_args) if tp == 1 else None  # (under tp the step graphs are not cached)
        with contextlib.nullcontext() if cache is None else _warmup_lock(cache):
            self._start(model, serve_args, tp, simulate, startup_timeout_s)
        self.session = None  # an aiohttp session, made on the replica's event loop at its first request
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a Serve replica (a direct test): name it by its port
            self.replica = f"port-{self.port}"

    def _start(self, model: str | None, serve_args: Sequence[str], tp: int, simulate: bool, timeout_s: float) -> None:
        """Start the server and return once it is ready (stopped again if it is not)."""
        self.port = free_port()
        command = [sys.executable, "-m", "hf_tpu.cli", "serve", *([model] if model else []), "--host", "127.0.0.1",
                   "--port", str(self.port), *(["--tp", str(tp)] if tp > 1 else []),
                   *(["--simulate"] if simulate else []), *serve_args]  # fmt: skip
        log = tempfile.NamedTemporaryFile(prefix=f"hf-tpu-serve-{self.port}-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )  # fmt: skip
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self._stop()
            raise

    def _output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise HfTpuRuntimeError(f"hf-tpu serve exited ({self.process.returncode}):\n{self._output()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self.url + "/health", timeout=_PROBE_S) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise HfTpuRuntimeError(f"hf-tpu serve was not ready within {timeout_s:.0f} s:\n{self._output()}")
            time.sleep(_POLL_S)

    async def __call__(self, request) -> Any:
        """Forward one HTTP request to this replica's server and return its answer (streamed when it streams).

        Args:
            request: the ``starlette.requests.Request`` Ray Serve's proxy routed here.

        Returns:
            A ``starlette.responses.Response`` (or ``StreamingResponse``) with the server's status, headers and body,
            plus :data:`REPLICA_HEADER`.
        """
        import aiohttp
        from starlette.responses import Response, StreamingResponse

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        root = request.scope.get("root_path", "")
        path = request.url.path[len(root) :] if root and request.url.path.startswith(root) else request.url.path
        if request.url.query:
            path += "?" + request.url.query
        sent = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        answer = await self.session.request(request.method, self.url + path, data=await request.body(), headers=sent)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers[REPLICA_HEADER] = self.replica
        if answer.headers.get("content-type", "").startswith("text/event-stream"):

            async def chunks():
                try:
                    async for chunk in answer.content.iter_any():
                        yield chunk
                finally:
                    answer.release()

            return StreamingResponse(chunks(), status_code=answer.status, headers=headers)
        body = await answer.read()
        answer.release()
        return Response(body, status_code=answer.status, headers=headers)

    def check_health(self) -> None:
        """Ray Serve's health check: fails once the server has exited, so that Ray replaces the replica.

        Raises:
            RuntimeError: the server process has exited.
        """
        if self.process.poll() is not None:
            raise HfTpuRuntimeError(f"hf-tpu serve exited ({self.process.returncode}):\n{self._output()}")

    def _stop(self) -> None:
        if not hasattr(self, "log"):  # the constructor failed before starting the server
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.log.close()
            os.unlink(self.log.name)

    def __del__(self) -> None:
        self._stop()


def build_app(model: str | None = None, *, num_replicas: int | str = 1, chips_per_replica: int = 1, tp: int = 1,
              serve_args: Sequence[str] = (), compile_cache: str | os.PathLike | None = None, simulate: bool = False,
              startup_timeout_s: float = 1800.0, **deployment_options: Any):  # fmt: skip
    """A Ray Serve application of ``hf-tpu serve`` replicas, each holding ``chips_per_replica`` of Ray's ``"TPU"``.

    Args:
        model: the model directory, the same path on every node (default: the model shipped with hf_tpu).
        num_replicas: replicas (``"auto"`` for Ray Serve's autoscaling; or pass ``autoscaling_config``).
        chips_per_replica: Ray ``"TPU"`` resources per replica: the chips of one VM for one replica per VM (4 on a
            v6e-16 host's 4 chips), 1 for one per chip. One of 1, 2, 4, 8 (what Ray accepts).
        tp: chips one model spans (``hf-tpu serve --tp``); at most ``chips_per_replica``.
        serve_args: more ``hf-tpu serve`` flags, the same for every replica.
        compile_cache: the compile-cache directory of every replica (``hf-tpu serve --compile-cache``), the same path
            on every node (a filesystem they all mount): replicas warm up one after the other, the first compiles
            the step graphs and the others load them. ``--compile-cache`` in ``serve_args`` does the same.
        simulate: the replicas' servers run on the simulated ``tpu`` device.
        startup_timeout_s: how long a replica's loading and warm-up may take.
        deployment_options: more of ``serve.deployment``'s options (``autoscaling_config``, ``max_ongoing_requests``,
            ``health_check_period_s``, ...); ``ray_actor_options`` entries are merged with the TPU resource.

    Returns:
        The bound application, for ``serve.run(app, route_prefix="/")``.

    Raises:
        UserError: ``chips_per_replica`` is not one of Ray's TPU counts, or ``tp`` is larger than it.
    """
    if chips_per_replica not in CHIP_COUNTS:
        raise UserError(
            f"chips_per_replica={chips_per_replica}: Ray schedules 1, 2, 4 or 8 TPU chips per actor "
            "(ray/_private/accelerators/tpu.py); pass one of those"
        )
    if tp > chips_per_replica:
        raise UserError(f"tp={tp} needs {tp} chips but a replica holds chips_per_replica={chips_per_replica}: "
                        f"pass chips_per_replica={tp} (or more)")  # fmt: skip
    actor = dict(deployment_options.pop("ray_actor_options", {}))
    actor["resources"] = {**actor.get("resources", {}), "TPU": chips_per_replica}
    actor.setdefault("num_cpus", 0)
    if "autoscaling_config" not in deployment_options:
        deployment_options["num_replicas"] = num_replicas
    serve_args = [*serve_args, *(["--compile-cache", os.fspath(compile_cache)] if compile_cache is not None else [])]
    deployment = serve.deployment(HfTpuServer, name="hf_tpu_serve", ray_actor_options=actor, **deployment_options)
    return deployment.bind(model, serve_args, tp, simulate, startup_timeout_s)


def app(args: dict[str, str]):
    """Ray Serve's application builder: ``serve run hf_tpu.ray.serve:app model=DIR num_replicas=2 ...``.

    Args:
        args: ``key=value`` pairs of the command line: ``model``, ``num_replicas``, ``chips_per_replica``, ``tp``,
            ``serve_args`` (one string, split like a shell: ``serve_args="--compile-cache /mnt/c"``), ``simulate``
            (``true``/``false``).

    Returns:
        The application of :func:`build_app`.

    Raises:
        UserError: an unknown key (the message lists the known ones).
    """
    import shlex

    known = {"model", "num_replicas", "chips_per_replica", "tp", "serve_args", "simulate", "startup_timeout_s"}
    unknown = set(args) - known
    if unknown:
        raise UserError(f"hf_tpu.ray.serve:app: unknown argument(s) {', '.join(sorted(unknown))}; known: "
                        f"{', '.join(sorted(known))}")  # fmt: skip
    replicas = args.get("num_replicas", "1")
    return build_app(
        args.get("model"), num_replicas=replicas if replicas == "auto" else int(replicas),
        chips_per_replica=int(args.get("chips_per_replica", 1)), tp=int(args.get("tp", 1)),
        serve_args=shlex.split(args.get("serve_args", "")),
        simulate=str(args.get("simulate", "false")).lower() in ("1", "true", "yes"),
        startup_timeout_s=float(args.get("startup_timeout_s", 1800.0)),
    )  # fmt: skip
