"""The ASGI layer ``hf-tpu serve`` puts in front of transformers' app: input checks, a bounded queue, ``/metrics``.

transformers' server answers a malformed body with 422 (or 500), an unknown model with 400, and queues without
bound. In front of it, for ``POST /v1/...``:

* a body that is not a JSON object (or nested more than :data:`~hf_tpu.serving.protocol.MAX_DEPTH` levels) -> 400
  naming the problem;
* ``max_tokens``/``max_completion_tokens``/``max_output_tokens`` that is not a positive integer -> 400;
* a ``model`` other than the one served -> 404 listing the served name;
* for chat, completions, responses and embeddings, every field, by the request models of
  :mod:`hf_tpu.serving.protocol`: a wrong one -> 400 naming it (embeddings, once checked: 404, not served here);
* more than ``max_pending`` requests in flight (counted from their arrival, body not yet read included) -> 429 with
  ``Retry-After`` (the queue is bounded);
* any request while the server warms up -> 503 with ``Retry-After`` (and ``GET /health`` -> 503 ``"warming up"``
  with the warm-up's progress, :class:`Readiness`);

``GET /v1/models/{id}`` answers the served model's object (any name it is served under; else 404), and
``GET /metrics`` answers with the Prometheus exposition of :class:`~hf_tpu.serving.metrics.ServerMetrics`. Each
request's arrival time is in :data:`ARRIVAL` for the handlers (time to first token from the arrival), and its
end-to-end latency goes to the metrics.
A prompt longer than the model allows is refused where it is tokenized (:class:`PromptTooLongError`, -> 400).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time

from hf_tpu.errors import UserError
from hf_tpu.serving._openai import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, Limits, RequestError

__all__ = ["ARRIVAL", "Guard", "PromptTooLongError", "Readiness"]

_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
RETRY_AFTER_S = 1
MODELS = "/v1/models/"
#: The status counted for a request whose client went away before its answer ended (nginx's 499).
CLIENT_CLOSED = 499
#: ``time.perf_counter()`` at the arrival of the request being answered (set by :class:`Guard`).
ARRIVAL: contextvars.ContextVar[float] = contextvars.ContextVar("hf_tpu_arrival")


class PromptTooLongError(UserError, ValueError):
    """A prompt the model cannot continue (answered with HTTP 400)."""


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
           ) -> tuple[int, bytes]:  # fmt: skip
    """A refusal in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return status, json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


class Readiness:
    """Where the server's warm-up is: ``done`` of ``total`` step shapes, then ready (or failed, with why)."""

    def __init__(self) -> None:
        self.done, self.total, self.failure = 0, 0, None
        self._ready = threading.Event()
        #: () -> why the continuous-batching worker died, or None while it lives (set by the server)
        self.worker_failure = lambda: None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set_ready(self) -> None:
        self._ready.set()

    def describe(self) -> str:
        if self.failure is not None:
            return f"warm-up failed: {self.failure}"
        return f"warming up: {self.done} of {self.total or '?'} step shapes compiled"


class Guard:
    """ASGI middleware; ``served`` are the model names accepted in ``body["model"]`` (``listed`` the one named in a
    404), ``canonical`` the one transformers' handlers are given."""

    def __init__(self, app, *, served: set[str], canonical: str, max_pending: int, metrics,
                 limits: Limits = Limits(), listed: str | None = None, readiness: Readiness | None = None,
                 card=None) -> None:  # fmt: skip
        self.app, self.served, self.canonical, self.limits = app, served, canonical, limits
        self.card = card  # () -> the served model's object in /v1/models (GET /v1/models/{id} answers it)
        self.listed = listed or canonical
        self.max_pending, self.metrics = max_pending, metrics
        self.readiness = readiness
        self.pending = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if path == "/metrics" and method == "GET":
            return await self._reply(send, 200, self.metrics.exposition(), "text/plain; version=0.0.4")
        warming = self.readiness is not None and not self.readiness.ready
        died = self.readiness.worker_failure() if self.readiness is not None and not warming else None
        if died is not None and path == "/health":  # the process is exiting (hf-tpu serve stops on it)
            detail = f"the continuous-batching worker died ({died}); the server is exiting for a restart"
            payload = json.dumps({"status": "unhealthy", "reason": "cb_worker_dead", "detail": detail}).encode()
            return await self._reply(send, 503, payload, "application/json")
        if warming and path == "/health":
            status = "warm-up failed" if self.readiness.failure else "warming up"
            payload = json.dumps({"status": status, "detail": self.readiness.describe()}).encode()
            return await self._reply(send, 503, payload, "application/json", [(b"retry-after", b"1")])
        if method == "GET" and path.startswith(MODELS) and self.card is not None:
            return await self._model(send, path[len(MODELS) :])
        if method != "POST" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        if warming:
            message = f"the server is {self.readiness.describe()}; retry later"
            status, payload = _error(503, message, "service_unavailable")
            self.metrics.answered(path, status)
            return await self._reply(send, status, payload, "application/json", retry)
        if self.pending >= self.max_pending:  # counted from arrival: a client still sending its body holds a place
            status, payload = _error(
                429, f"the server has {self.pending} requests in flight (its limit, --max-pending); retry later",
                "rate_limit_error",
            )  # fmt: skip
            self.metrics.answered(path, status)
            return await self._reply(send, status, payload, "application/json", retry)
        self.pending += 1
        self.metrics.in_flight.inc()
        ARRIVAL.set(time.perf_counter())
        try:
            await self._admitted(scope, receive, send, path)
        finally:
            self.pending -= 1
            self.metrics.in_flight.dec()

    async def _admitted(self, scope, receive, send, path: str) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        refusal, body = self._check(path, body)
        if refusal is not None:
            status, payload = refusal
            self.metrics.answered(path, status)
            return await self._reply(send, status, payload, "application/json")

        sent = started = False
        status, ended = [500], [None]

        async def send_status(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started, status[0] = True, message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended[0] = time.perf_counter()
            await send(message)

        # The client going away ends the request, streamed or not: a watcher reads the connection while the app
        # runs, and cancels the app when the client disconnects before the answer ended (the handler's ``finally``
        # then cancels its choices in the continuous batch, freeing their slots and KV blocks). The app's own reads
        # (a stream listening for the disconnect) are answered from the watcher.
        gone = asyncio.Event()

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        answering = asyncio.ensure_future(self.app(scope, replay, send_status))

        async def watch():
            while True:
                try:
                    message = await receive()
                except Exception:  # noqa: BLE001 - a broken connection: the app's own send will say so
                    return
                if message["type"] == "http.disconnect":
                    gone.set()
                    if ended[0] is None and not answering.done():
                        answering.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            try:
                await answering
            except asyncio.CancelledError:
                if not gone.is_set():
                    raise  # cancelled from outside (the server stopping), not by the client leaving
            # The client left: the app was cancelled here, or cancelled itself and returned (transformers 5.25's app
            # has a CancelOnDisconnect middleware of its own, which ends the request without an answer).
            if gone.is_set() and not started:
                status[0] = CLIENT_CLOSED  # nothing was answered (a stream that began keeps its status)
        finally:
            watcher.cancel()
            seconds = ended[0] - ARRIVAL.get() if ended[0] is not None else None
            self.metrics.answered(path, status[0], seconds)

    def _check(self, path: str, body: bytes) -> tuple[tuple[int, bytes] | None, bytes]:
        """(refusal or None, the body to pass on: ``model`` rewritten to the name transformers was started with)."""
        try:
            data = json.loads(body or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not valid JSON ({exc}); send a JSON object"), body
        except RecursionError:
            return _error(400, "the request body is nested too deeply to read; send a flatter JSON object"), body
        if not isinstance(data, dict):
            return _error(400, f"the request body must be a JSON object, got {type(data).__name__}"), body
        model = data.get("model")
        if isinstance(model, str) and model not in self.served:  # (a model that is not a string: a 400 below)
            message = f"model {model!r:.80} is not served here; this server serves {self.listed!r}"
            return _error(404, message, "not_found_error", "model"), body
        if path in (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS):
            from hf_tpu.serving.protocol import validate

            try:
                validate(path, data, self.limits)
            except RequestError as exc:
                return _error(exc.status, exc.message, exc.kind, exc.param), body
        else:  # transformers' other endpoints: the token counts at least
            for field in _TOKEN_FIELDS:
                value = data.get(field)
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                    return _error(400, f"{field} must be a positive integer, got {value!r}", param=field), body
        if model is not None and not isinstance(model, str):
            return _error(400, f"model must be a string, got {json.dumps(model)[:60]}", param="model"), body
        if path == EMBEDDINGS:
            message = f"{EMBEDDINGS} is not served here: hf-tpu serve serves {self.listed!r}, a causal LM"
            return _error(404, message, "not_found_error"), body
        if model is not None and model != self.canonical:
            data["model"] = self.canonical
            body = json.dumps(data).encode()
        return None, body

    async def _model(self, send, name: str) -> None:
        """``GET /v1/models/{name}``: the served model's object for any name it is served under, else 404."""
        if name in self.served:
            status, payload = 200, json.dumps(self.card()).encode()
        else:
            message = f"model {name!r} does not exist here; this server serves {self.listed!r}"
            status, payload = _error(404, message, "invalid_request_error", "model")
        self.metrics.answered(MODELS + "{id}", status)
        await self._reply(send, status, payload, "application/json")

    @staticmethod
    async def _reply(send, status: int, payload: bytes, content_type: str, headers=()) -> None:
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(payload)).encode()), *headers]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
