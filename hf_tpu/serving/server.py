"""``hf-tpu serve``: transformers' OpenAI-compatible server (``transformers serve --continuous-batching``) on a TPU.

:func:`run_server` serves transformers' own app (its FastAPI factory ``build_server``: its routes, middleware and
error handling, unchanged in its API) for the one model given, on the ``tpu`` device, with continuous batching, on
127.0.0.1 unless told otherwise, through uvicorn. The model, its continuous batch and its warm-up stay in this
process (on transformers 5.25 ``transformers serve`` runs each model in a process of its own: see
:mod:`hf_tpu.serving._app`, which holds every call into transformers' serving code). Before the app serves, hf_tpu:

* loads the model, creates its continuous-batching manager and warms it up (every step shape of the ladder,
  :mod:`hf_tpu.serving.ladder`), then starts it; prints when warm-up is done and where it listens;
* puts :class:`~hf_tpu.serving._guard.Guard` in front of the app (bad input -> 400 naming the field, unknown model
  -> 404, a bounded number of requests in flight -> 429 with ``Retry-After``, ``/metrics``);
* answers chat, completions and responses with :mod:`hf_tpu.serving._handlers` (per request: sampling, ``n``,
  ``stop``, finish reasons; responses run as chat and answered in the Responses API's shape);
* checks every request's length where it is tokenized: a prompt that leaves no room to generate within the model's
  ``max_position_embeddings`` -> 400; ``max_tokens`` past that length is cut to it.

A SIGINT or SIGTERM while the model loads or warms up raises the built-in ``KeyboardInterrupt`` from the signal
handler, as Python's own SIGINT handler does, so both stop the command the same way.
"""

from __future__ import annotations

import copy
import functools
import time

from hf_tpu._patch import patch, revert
from hf_tpu.errors import HfTpuRuntimeError, InvalidArgumentError
from hf_tpu.serving._app import worker_failure
from hf_tpu.serving.kv_sizing import model_max_len

__all__ = ["WorkerDiedError", "port_taken", "run_server", "say_once", "uds_unusable", "worker_failure"]

FEATURE = "serve"


# How often the main thread wakes from waiting on the server thread to take a signal (a poll, not a deadline).
_SIGNAL_POLL_S = 0.5
_STARTED_POLL_S = 0.05

def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (the port taken, the address not this host's), else None: bound and
    released here as uvicorn binds it (``SO_REUSEADDR``), so that the server refuses before loading anything."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, OverflowError) as exc:
        return f"cannot listen on {host}:{port} ({getattr(exc, 'strerror', None) or exc}): pass another --host"
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return (f"--host {host} is not an address of this machine ({exc.strerror}): pass 127.0.0.1, "
                        "0.0.0.0 (every interface) or one of this machine's addresses")  # fmt: skip
            return (f"port {port} on {host} is taken ({exc.strerror or exc}): pass another --port, or stop what "
                    "listens there")  # fmt: skip
    return None


#: The longest path a unix domain socket may have (``sun_path`` is 108 bytes on Linux, the terminating NUL included).
UDS_MAX_BYTES = 107


def uds_unusable(path: str) -> str | None:
    """Why a unix domain socket cannot be made at ``path`` (its directory missing, the path too long, a file that is
    not a socket there, a server already answering on it), else None. Nothing is bound: asyncio removes a socket
    file left at ``path`` before it binds, which is right for a stale one and wrong for one a live server holds,
    so that case is told by connecting to it."""
    import os
    import socket
    import stat

    where = os.path.dirname(os.path.abspath(path))
    if len(os.fsencode(path)) > UDS_MAX_BYTES:
        return f"--uds {path}: a unix socket path may have at most {UDS_MAX_BYTES} bytes; pass a shorter path"
    if not os.path.isdir(where):
        return f"--uds {path}: the directory {where} does not exist; create it or pass another path"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return f"--uds {path}: a file that is not a socket is there; remove it or pass another path"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError:
            return None  # a socket file nobody listens on: replaced when the server binds
    return f"--uds {path}: a server already listens on this socket; stop it or pass another path"


class WorkerDiedError(HfTpuRuntimeError):
    """The continuous-batching worker of ``hf-tpu serve`` died: the server stopped so that its supervisor restarts
    it (``hf-tpu serve`` exits with status 3)."""


def _checked_add_request(cb, max_len: int, metrics):
    """``cb.add_request`` refusing prompts that do not fit, capping ``max_new_tokens`` to the model's length,
    recording per-token timestamps (for the latency histograms), and taking ``num_choices`` (the request's ``n``:
    upstream forks ``n - 1`` children of the request after its prefill)."""
    from hf_tpu.serving._guard import PromptTooLongError

    upstream = cb.add_request

    @functools.wraps(upstream)
    def add_request(input_ids, request_id=None, max_new_tokens=None, num_choices=1, **kwargs):
        n = len(input_ids)
        if n >= max_len:
            raise PromptTooLongError(
                f"the prompt is {n} tokens; this model continues at most {max_len - 1} (max_position_embeddings "
                f"{max_len}): shorten the prompt"
            )
        default = cb.generation_config.max_new_tokens
        wanted = max_new_tokens if max_new_tokens is not None else default
        if wanted is None or n + wanted > max_len:
            max_new_tokens = max_len - n
        kwargs["record_timestamps"] = True
        if num_choices == 1:
            return upstream(input_ids, request_id=request_id, max_new_tokens=max_new_tokens, **kwargs)
        # upstream reads the manager's num_return_sequences for every request; this runs on the event loop's thread,
        # the only one adding requests, so the value is the request's while upstream reads it
        saved, cb.num_return_sequences = cb.num_return_sequences, num_choices
        try:
            return upstream(input_ids, request_id=request_id, max_new_tokens=max_new_tokens, **kwargs)
        finally:
            cb.num_return_sequences = saved

    return add_request


def _metrics_hook(cb, metrics):
    """Wrap the output router's delivery so that every finished request lands in the metrics."""
    router = cb.output_router
    deliver, deliver_batch = router.deliver, router.deliver_batch

    def note(output):
        if output.is_finished() and output.error is None:
            metrics.finished(output)

    @functools.wraps(deliver)
    def one(output):
        note(output)
        return deliver(output)

    @functools.wraps(deliver_batch)
    def batch(outputs):
        for output in outputs:
            note(output)
        return deliver_batch(outputs)

    patch(router, "deliver", one, feature=FEATURE)
    patch(router, "deliver_batch", batch, feature=FEATURE)


def _warm_up(cb, *, warmup: bool, readiness, out) -> None:
    """Warm up and start the continuous-batching manager, printing the progress (in the main thread, while the
    server answers ``/health`` with 503 from its own)."""
    from hf_tpu.serving.metrics import compiles_so_far

    start, compiles_before = time.perf_counter(), compiles_so_far()
    cb.batch_processor = cb._create_batch_processor()
    runner = cb.batch_processor.model_runner
    shapes = 0
    if warmup:
        from hf_tpu.serving._runner import ladder_of

        shapes = readiness.total = len(ladder_of(runner).shapes)
        print(f"hf-tpu serve: warming up {shapes} step shapes (/health answers 503 until done)", file=out, flush=True)

        def progress(done: int, total: int, shape: tuple[int, int], seconds: float) -> None:
            readiness.done = done
            print(f"hf-tpu serve: warm-up {done}/{total}: step of {shape[0]} query tokens, {shape[1]} KV tokens "
                  f"({seconds:.1f} s)", file=out, flush=True)  # fmt: skip

        runner._hf_tpu_progress = progress
        cb.warmup()
    cb.start()
    readiness.set_ready()
    print(
        f"hf-tpu serve: warm-up done in {time.perf_counter() - start:.1f} s ({shapes} step shapes, "
        f"{compiles_so_far() - compiles_before} graphs compiled); KV cache {cb.batch_processor.cache.num_blocks} "
        "blocks; ready", file=out, flush=True,
    )  # fmt: skip


def _load(path: str, *, tp: int, dtype: str | None, attn_implementation: str | None):
    """The causal LM at ``path`` on the ``tpu`` device (sharded over ``tp`` ranks when ``tp > 1``), and its processor,
    as transformers' serve loads them (``AutoProcessor``; ``dtype`` "auto" or a torch dtype's name)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoProcessor

    if dtype not in (None, "auto") and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise InvalidArgumentError(f"--dtype {dtype}: pass 'auto' or a torch dtype's name (bfloat16, float32, ...)")
    resolved = getattr(torch, dtype) if dtype not in (None, "auto") else dtype
    processor = AutoProcessor.from_pretrained(path)
    if tp > 1:
        from hf_tpu.serving.tensor_parallel import load_sharded

        return load_sharded(path, tp, dtype=resolved, attn_implementation=attn_implementation), processor
    kwargs = {"dtype": resolved, "device_map": "tpu"}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval(), processor


def _prepare(served, *, aliases: set[str], max_pending: int, pending: dict, limits, enable_cors: bool,
             tool_call_parser: str | None = None):  # fmt: skip
    """transformers' app around ``served`` (a :class:`~hf_tpu.serving._app.ServedModel`) with hf_tpu's handlers, and
    the model's continuous-batching manager (left in ``pending`` with its :class:`Readiness`, for :func:`_warm_up`);
    returns the guarded app. ``tool_call_parser``: the tool-call format chat replies are parsed in
    (:mod:`hf_tpu.serving._tools`; None: the model's own)."""
    from fastapi.responses import JSONResponse

    from hf_tpu.serving._app import BatchDiedError, build_app
    from hf_tpu.serving._chunks import read_backs
    from hf_tpu.serving._guard import Guard, PromptTooLongError, Readiness
    from hf_tpu.serving._handlers import handler_classes
    from hf_tpu.serving._openai import RequestError
    from hf_tpu.serving.metrics import ServerMetrics

    model = served.model
    ChatHandler, TextHandler, ResponsesHandler = handler_classes()
    # (hf-tpu serve has no --chat-template-kwargs: the template's defaults; a request's own still apply)
    handlers = (ChatHandler(served, served, chat_template_kwargs={}), TextHandler(served, served),
                ResponsesHandler(served, served, chat_template_kwargs={}))  # fmt: skip
    app = build_app(served, *handlers, enable_cors=enable_cors)
    gen_config = copy.deepcopy(model.generation_config)
    cb = served.cb = model.init_continuous_batching(generation_config=gen_config)

    def queue_depth() -> int:
        processor = cb.batch_processor
        waiting = getattr(getattr(processor, "scheduler", None), "waiting_requests", ())
        return cb.input_queue.qsize() + len(waiting)

    def kv_blocks() -> tuple[int, int]:
        cache = getattr(cb.batch_processor, "cache", None)
        if cache is None:
            return 0, 0
        total = int(cache.num_blocks)
        free = cache.compute_free_capacity(relative=True)
        return total - int(round(free * total)), total

    metrics = ServerMetrics(queue_depth, kv_blocks, model=served.name, steps=lambda: read_backs(cb))
    for handler in handlers:
        handler.metrics, handler.served, handler.tool_call_parser = metrics, served, tool_call_parser
    patch(cb, "add_request", _checked_add_request(cb, model_max_len(model), metrics), feature=FEATURE)
    _metrics_hook(cb, metrics)
    readiness = Readiness()
    pending.update(cb=cb, readiness=readiness)

    @app.exception_handler(PromptTooLongError)
    async def _too_long(_request, exc):
        return JSONResponse(RequestError(None, str(exc)).body(), 400)

    @app.exception_handler(RequestError)
    async def _refused(_request, exc):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(BatchDiedError)
    async def _batch_died(_request, exc):
        return JSONResponse(RequestError(None, str(exc), 503, "service_unavailable").body(), 503)

    return Guard(app, served=served.names | aliases, canonical=served.name, max_pending=max_pending, metrics=metrics,
                 limits=limits, listed=served.name, readiness=readiness, card=served.card)  # fmt: skip


def _set_log_level(level: str) -> None:
    """transformers' log level, as ``transformers serve --log-level`` sets it (its root logger)."""
    from transformers.utils import logging as hf_logging

    try:
        hf_logging.get_logger("transformers").setLevel(hf_logging.log_levels[level.lower()])
    except KeyError:
        raise InvalidArgumentError(
            f"--log-level {level}: pass one of {', '.join(hf_logging.log_levels)}"
        ) from None


class _Uvicorn:
    """uvicorn serving ``app`` from a thread of its own, with its own event loop (as transformers 5.24's
    ``Serve(non_blocking=True)`` did), so that this thread keeps the warm-up and the signals."""

    def __init__(self, app, *, host: str, port: int, uds: str | None) -> None:
        import asyncio
        import threading

        import uvicorn

        # with uds: no TCP socket at all (uvicorn binds the unix socket instead of host:port)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, uds=uds, log_level="info"))

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.server.serve())

        self.thread = threading.Thread(target=run, name="uvicorn-thread", daemon=False)
        self.thread.start()


def run_server(model: str, *, host: str, port: int, max_pending: int, warmup: bool = True, served_name=None,
               aliases=(), out=None, tp: int = 1, limits=None, uds: str | None = None, dtype: str | None = "auto",
               attn_implementation: str | None = None, log_level: str = "warning", enable_cors: bool = False,
               default_seed: int | None = None, tool_call_parser: str | None = None) -> None:  # fmt: skip
    """Run transformers' server for ``model`` on the TPU until it is stopped (SIGINT/SIGTERM), under the name
    ``served_name`` (default: the model directory's name); ``tp > 1``: as rank 0 of ``hf-tpu serve --tp``
    (:mod:`hf_tpu.serving.tensor_parallel`). With ``uds``, on that unix domain socket instead of ``host:port`` (no
    TCP socket is opened; the socket file is removed when the server stops). ``dtype``, ``attn_implementation``,
    ``log_level``, ``enable_cors`` and ``default_seed`` are transformers serve's flags of those names;
    ``tool_call_parser``: the tool-call format of chat replies (``--tool-call-parser``, :mod:`hf_tpu.serving._tools`).

    uvicorn serves from a thread as soon as the model is loaded, while this thread warms up the continuous batch
    (``/health``: 503 until it is done). The warm-up and the manager stay on the main thread: made from another
    thread, the simulator's steps ran ten times slower. SIGINT/SIGTERM stop uvicorn gracefully (its own handler,
    installed here since uvicorn only installs it on the main thread); the signal is raised again once it has
    stopped, as uvicorn does."""
    import os
    import signal
    import sys

    from hf_tpu.serving._app import ServedModel
    from hf_tpu.serving._openai import Limits

    out = out or sys.stdout
    limits = limits or Limits()
    served_as = served_name or os.path.basename(model.rstrip("/"))
    _set_log_level(log_level)
    pending: dict = {}
    where = f"unix socket {uds}" if uds is not None else f"http://{host}:{port}"
    quiet = say_once()
    stopping: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def stop_loading(signum, _frame):
        stopping.append(signum)
        raise KeyboardInterrupt  # the model is loading: nothing to shut down gracefully yet

    for sig in saved:
        signal.signal(sig, stop_loading)
    serve = cb = died = None
    try:
        print(f"hf-tpu serve: loading {model}", file=out, flush=True)
        if default_seed is not None:  # as transformers serve's --default-seed (torch.manual_seed)
            import torch

            torch.manual_seed(default_seed)
        loaded, processor = _load(model, tp=tp, dtype=dtype, attn_implementation=attn_implementation)
        served = ServedModel(served_as, {model}, loaded, processor)
        app = _prepare(served, aliases=set(aliases), max_pending=max_pending, pending=pending, limits=limits,
                       enable_cors=enable_cors, tool_call_parser=tool_call_parser)  # fmt: skip
        serve = _Uvicorn(app, host=host, port=port, uds=uds)
        server, cb, readiness = serve.server, pending["cb"], pending["readiness"]

        def stop_serving(signum, frame):  # uvicorn's own handler: a graceful shutdown, the signal kept to raise again
            server.handle_exit(signum, frame)
            if not readiness.ready:
                raise KeyboardInterrupt  # stop the warm-up too

        for sig in saved:
            signal.signal(sig, stop_serving)
        while not server.started and serve.thread.is_alive():  # uvicorn binds in its thread: wait for it
            serve.thread.join(_STARTED_POLL_S)
        if not server.started:  # it could not listen (taken since port_taken looked): say so, do not warm up
            from hf_tpu.errors import UserError

            if uds is not None:
                raise UserError(uds_unusable(uds) or f"the server could not listen on unix socket {uds} (its log "
                                "above says why): pass another --uds")  # fmt: skip
            raise UserError(port_taken(host, port) or f"the server could not listen on {host}:{port} (its log "
                            "above says why): pass another --port")  # fmt: skip
        ranks = f", tensor parallel over {tp} ranks" if tp > 1 else ""
        print(f"hf-tpu serve: listening on {where} as model {served_as!r} (OpenAI API under /v1, metrics at /metrics"
              f"{ranks})", file=out, flush=True)  # fmt: skip
        try:
            _warm_up(cb, warmup=warmup, readiness=readiness, out=out)
        except Exception as exc:
            readiness.failure = f"{type(exc).__name__}: {exc}"
            print(f"hf-tpu serve: {readiness.describe()}; stopping", file=out, flush=True)
            raise
        readiness.worker_failure = lambda: worker_failure(cb)
        while serve.thread.is_alive():  # joined in short polls, so that this thread takes the signals meanwhile
            serve.thread.join(_SIGNAL_POLL_S)
            died = worker_failure(cb)
            if died is not None:  # never a live process answering 503 forever: stop, a supervisor restarts it
                print(f"hf-tpu serve: the continuous-batching worker died ({died}); stopping the server",
                      file=out, flush=True)  # fmt: skip
                server.should_exit = server.force_exit = True  # in-flight requests were failed with the worker
                break
    except KeyboardInterrupt:
        if not stopping and not (serve is not None and serve.server._captured_signals):
            raise
    finally:
        if serve is not None:
            serve.server.should_exit = True
            serve.thread.join()
            stopping.extend(serve.server._captured_signals)
        if cb is not None and cb.is_running():  # uvicorn has stopped: stop the generation thread, so that we exit
            cb.stop(block=True, hard_stop=True)  # nothing is left to serve: fail what is pending
        if uds is not None and serve is not None and serve.server.started:
            import contextlib

            with contextlib.suppress(OSError):
                os.remove(uds)  # as uvicorn's own runner does
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        quiet()
        revert(FEATURE)
    for sig in reversed(stopping):
        signal.raise_signal(sig)
    if died is not None:
        raise WorkerDiedError(f"the continuous-batching worker died ({died})")


class _Once:
    """A logging filter that lets each message through once (the last :data:`_ONCE_KEPT` remembered)."""

    def __init__(self) -> None:
        import collections

        self.seen: collections.OrderedDict = collections.OrderedDict()

    def filter(self, record) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            self.seen.move_to_end(key)
            return False
        self.seen[key] = None
        if len(self.seen) > _ONCE_KEPT:
            self.seen.popitem(last=False)
        return True


_ONCE_KEPT = 1024


def say_once():
    """Say each of upstream's log messages once (transformers' and its continuous batching's handlers); return the
    undo."""
    import logging

    from transformers.utils import logging as hf_logging

    handlers = [*hf_logging._get_library_root_logger().handlers, *logging.getLogger("ContinuousBatchingLogger").handlers]
    filters = [(handler, _Once()) for handler in handlers]  # one each: a shared one would pass a record to one handler
    for handler, once in filters:
        handler.addFilter(once)

    def undo() -> None:
        for handler, once in filters:
            handler.removeFilter(once)

    return undo
