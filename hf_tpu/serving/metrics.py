"""Prometheus metrics of ``hf-tpu serve`` (served at ``/metrics``), in a registry of their own.

Every ``hf_tpu_*`` metric carries a ``model`` label (the served model name). Requests by endpoint and status;
end-to-end request latency (from the request's arrival at the server to the end of its answer); prompt and
generated tokens, and their throughput over the last :data:`WINDOW_S` seconds; time to first token (from the
request's arrival) and time per output token (histograms, from the per-token timestamps of transformers' continuous
batching); queue depth and requests in flight; KV blocks in use; ``hf_tpu_compiles_total`` /
``hf_tpu_compile_cache_hits_total`` (graphs compiled by dynamo in this process, graphs loaded from hf_tpu's
persistent compile cache), read when scraped; the step loop's ``hf_tpu_steps_total``, ``hf_tpu_step_read_backs_total``
(device->host reads of step tokens: one per chunk of decode steps, one per step run alone) and
``hf_tpu_dropped_tokens_total`` (tokens a request computed after it ended in the same chunk), read when scraped
(:mod:`hf_tpu.serving._chunks`); and prometheus_client's process metrics (``process_*``: resident
memory, CPU seconds, open files...).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HANDLED", "WINDOW_S", "ServerMetrics", "compiles_so_far"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Seconds over which the throughput gauges count tokens.
WINDOW_S = 10.0
#: How transformers' continuous batching names a request's forked children (``f"{id}__child#{i}"``).
_CHILD = "__child#"
#: The prefix of the continuous-batching ids of requests answered by hf_tpu's handlers (they count their prompt).
HANDLED = "hf-tpu-"


def compiles_so_far() -> int:
    """Graphs dynamo has compiled in this process (each new shape and each piece between graph breaks)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class ServerMetrics:
    """The server's metrics for the model served as ``model``; ``queue_depth``/``kv_blocks`` are callables read at
    scrape time."""

    def __init__(self, queue_depth: Callable[[], int], kv_blocks: Callable[[], tuple[int, int]], model: str = "",
                 process: bool = True, steps: Callable[[], Any] | None = None) -> None:  # fmt: skip
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        self.model = model
        self.registry = r = CollectorRegistry()
        m = ["model"]
        self._requests = Counter("hf_tpu_requests", "HTTP requests answered", [*m, "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hf_tpu_prompt_tokens", "Prompt tokens of answered requests", m,
                                     registry=r).labels(model)  # fmt: skip
        self.generated_tokens = Counter("hf_tpu_generated_tokens", "Tokens generated (every choice)", m,
                                        registry=r).labels(model)  # fmt: skip
        self.ttft = Histogram(
            "hf_tpu_time_to_first_token_seconds", "From the request's arrival at the server to its first token", m,
            registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(model)  # fmt: skip
        self.tpot = Histogram(
            "hf_tpu_time_per_output_token_seconds", "Between consecutive tokens of a request", m, registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model)  # fmt: skip
        self._e2e = Histogram(
            "hf_tpu_e2e_request_latency_seconds", "From a request's arrival at the server to the end of its answer",
            [*m, "endpoint"], registry=r, buckets=_E2E_BUCKETS,
        )  # fmt: skip
        self.in_flight = Gauge("hf_tpu_requests_in_flight", "Requests admitted and not answered yet", m,
                               registry=r).labels(model)  # fmt: skip
        gauges = {
            "hf_tpu_queue_depth": ("Requests waiting for a slot in the continuous batch", lambda: queue_depth()),
            "hf_tpu_kv_blocks_in_use": ("Paged KV cache blocks holding requests", lambda: kv_blocks()[0]),
            "hf_tpu_kv_blocks_total": ("Paged KV cache blocks", lambda: kv_blocks()[1]),
            "hf_tpu_prompt_throughput_tokens_per_second": (
                f"Prompt tokens of requests answered in the last {WINDOW_S:g} s, per second", self._prompt_rate),
            "hf_tpu_generation_throughput_tokens_per_second": (
                f"Tokens generated in the last {WINDOW_S:g} s (finished choices), per second", self._generation_rate),
        }  # fmt: skip
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, m, registry=r).labels(model).set_function(lambda read=read: float(read()))
        r.register(_CompileCollector(model))
        if steps is not None:
            r.register(_StepCollector(model, steps))
        if process:
            ProcessCollector(registry=r)
        self._lock = threading.Lock()
        self._prompts: collections.deque = collections.deque()  # (time, tokens)
        self._tokens: collections.deque = collections.deque()  # time of each generated token
        self._arrivals: dict[str, float] = {}

    # ----- requests (the guard and the handlers) -----

    def answered(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        """An HTTP request answered with ``status``; ``seconds`` from its arrival to the end of its answer."""
        self._requests.labels(self.model, endpoint, str(status)).inc()
        if seconds is not None and 200 <= status < 300:
            self._e2e.labels(self.model, endpoint).observe(seconds)

    def arrived(self, request_id: str, at: float) -> None:
        """A request (continuous-batching id ``request_id``) that arrived at ``at`` (``time.perf_counter``)."""
        with self._lock:
            self._arrivals[request_id] = at

    def admitted(self, prompt_tokens: int) -> None:
        """A request of ``prompt_tokens`` added to the continuous batch (by hf_tpu's handlers)."""
        self.prompt_tokens.inc(prompt_tokens)
        with self._lock:
            self._prompts.append((time.perf_counter(), prompt_tokens))
            self._prune()

    def left(self, request_id: str) -> None:
        """The request is answered (or gone): forget its arrival."""
        with self._lock:
            self._arrivals.pop(request_id, None)

    def stopped(self, request_id: str, tokens: int, first_token_at: float | None) -> None:
        """A choice the server ended itself (a stop string), with ``tokens`` generated."""
        now = time.perf_counter()
        self.generated_tokens.inc(tokens)
        with self._lock:
            self._tokens.extend([now] * tokens)
            self._prune()
            arrival = self._arrivals.get(request_id.split(_CHILD)[0])
        if arrival is not None and first_token_at is not None:
            self.ttft.observe(max(first_token_at - arrival, 0.0))

    def finished(self, output) -> None:
        """Record a finished choice (a transformers ``GenerationOutput`` with per-token timestamps)."""
        base = output.request_id.split(_CHILD)[0]
        with self._lock:
            arrival = self._arrivals.get(base)
        if not base.startswith(HANDLED) and _CHILD not in output.request_id:  # not counted by hf_tpu's handlers
            self.prompt_tokens.inc(len(output.prompt_ids))
            with self._lock:
                self._prompts.append((time.perf_counter(), len(output.prompt_ids)))
        self.generated_tokens.inc(len(output.generated_tokens))
        stamps = output.timestamps or []
        with self._lock:
            self._tokens.extend(stamps)
            self._prune()
        if stamps:
            self.ttft.observe(max(stamps[0] - (arrival if arrival is not None else output.created_time), 0.0))
        for a, b in zip(stamps, stamps[1:]):
            self.tpot.observe(max(b - a, 0.0))

    # ----- throughput -----

    def _prune(self) -> float:
        """Drop what is older than the window (the lock held); return the window's start. The token times are
        appended per finished choice, so not in order: an old one behind a newer one waits for it."""
        start = time.perf_counter() - WINDOW_S
        while self._prompts and self._prompts[0][0] < start:
            self._prompts.popleft()
        while self._tokens and self._tokens[0] < start:
            self._tokens.popleft()
        return start

    def _prompt_rate(self) -> float:
        with self._lock:
            self._prune()
            return sum(n for _, n in self._prompts) / WINDOW_S

    def _generation_rate(self) -> float:
        with self._lock:
            start = self._prune()
            return sum(1 for t in self._tokens if t >= start) / WINDOW_S

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _CompileCollector:
    """``hf_tpu_compiles_total`` and ``hf_tpu_compile_cache_hits_total``, read from the process's counters."""

    def __init__(self, model: str) -> None:
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        from hf_tpu import compile_cache

        compiles = CounterMetricFamily("hf_tpu_compiles", "Graphs compiled in this process", labels=["model"])
        compiles.add_metric([self.model], compiles_so_far())
        yield compiles
        hits = CounterMetricFamily(
            "hf_tpu_compile_cache_hits", "Graphs loaded from the persistent compile cache", labels=["model"]
        )
        hits.add_metric([self.model], compile_cache.HITS[0])
        yield hits


class _StepCollector:
    """``hf_tpu_steps_total``, ``hf_tpu_step_read_backs_total`` and ``hf_tpu_dropped_tokens_total``, read from the
    manager's :class:`~hf_tpu.serving._chunks.ReadBacks` (``steps``: a callable returning it)."""

    def __init__(self, model: str, steps: Callable[[], Any]) -> None:
        self.model, self.steps = model, steps

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        record = self.steps()
        for name, doc, value in (
            ("hf_tpu_steps", "Continuous-batching steps run", record.steps),
            ("hf_tpu_step_read_backs", "Device->host reads of step tokens (one per chunk, one per step run alone)",
             record.read_backs),
            ("hf_tpu_dropped_tokens", "Tokens computed for a request after it ended in the same chunk",
             record.extra_tokens),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
