"""``hf-tpu serve``: transformers' OpenAI-compatible server (``transformers serve --continuous-batching``) on a TPU.

:func:`run_server` starts transformers' own ``Serve`` command, unchanged in its API, with the model forced to the
one given, ``device="tpu"``, continuous batching on, and the host 127.0.0.1 unless told otherwise. Before the app
serves, hf_tpu (through a reversible patch of ``transformers.cli.serving.server.build_server``):

* loads the model, creates its continuous-batching manager and warms it up (every step shape of the ladder,
  :mod:`hf_tpu.serving.ladder`), then starts it; prints when warm-up is done and where it listens;
* puts :class:`~hf_tpu.serving._guard.Guard` in front of the app (bad input -> 400 naming the field, unknown model
  -> 404, a bounded number of requests in flight -> 429 with ``Retry-After``, ``/metrics``);
* answers chat and completions with :mod:`hf_tpu.serving._handlers` (per request: ``n``, ``stop``, finish reasons);
* checks every request's length where it is tokenized: a prompt that leaves no room to generate within the model's
  ``max_position_embeddings`` -> 400; ``max_tokens`` past that length is cut to it.
"""

from __future__ import annotations

import copy
import functools
import time

from hf_tpu._patch import patch, revert

__all__ = ["run_server"]

FEATURE = "serve"


def _max_len(model) -> int:
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    from hf_tpu.serving.kv_sizing import MAX_LEN_CAP

    return MAX_LEN_CAP


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


def _prepare(app, model_manager, generation_state, *, aliases: set[str], max_pending: int, warmup: bool, out,
             started: list, limits, tp: int = 1):  # fmt: skip
    """Load, warm up and start the model's continuous-batching manager; return the guarded app. With ``tp > 1``
    (rank 0 of ``hf-tpu serve --tp``) the model is loaded sharded (:mod:`hf_tpu.serving.tensor_parallel`)."""
    from fastapi.responses import JSONResponse

    from hf_tpu.serving._guard import Guard, PromptTooLongError
    from hf_tpu.serving._openai import RequestError
    from hf_tpu.serving.metrics import ServerMetrics, compiles_so_far

    forced = model_manager.force_model
    model_id = model_manager.process_model_name(forced)
    if tp > 1:
        from hf_tpu.serving.tensor_parallel import load_sharded

        def _load_model(*_args, **_kwargs):
            dtype, attn = model_manager.dtype, model_manager.attn_implementation
            return load_sharded(forced, tp, dtype=dtype, attn_implementation=attn)

        patch(model_manager, "_load_model", _load_model, feature=FEATURE)
    start = time.perf_counter()
    model, _processor = model_manager.load_model_and_processor(model_id)
    gen_manager = generation_state.get_manager(model_id, use_cb=True)
    gen_config = copy.deepcopy(model.generation_config)
    cb_config = gen_manager._cb_config  # transformers serve's --cb-* flags, if any
    cb = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    compiles_before = compiles_so_far()
    if warmup:
        cb.warmup()
    else:
        cb.batch_processor = cb._create_batch_processor()
    cache = cb.batch_processor.cache

    def queue_depth() -> int:
        scheduler = cb.batch_processor.scheduler
        return cb.input_queue.qsize() + len(getattr(scheduler, "waiting_requests", ()))

    def kv_blocks() -> tuple[int, int]:
        total = int(cache.num_blocks)
        free = cache.compute_free_capacity(relative=True)
        return total - int(round(free * total)), total

    metrics = ServerMetrics(queue_depth, kv_blocks)
    patch(cb, "add_request", _checked_add_request(cb, _max_len(model), metrics), feature=FEATURE)
    _metrics_hook(cb, metrics)
    cb.start()
    started.append(cb)
    gen_manager._cb = cb  # upstream's CBGenerateManager.init_cb is a no-op once its manager exists
    shapes = len(cb.batch_processor.model_runner.__dict__.get("_hf_tpu_ladder", None).shapes) if warmup else 0
    print(
        f"hf-tpu serve: warm-up done in {time.perf_counter() - start:.1f} s ({shapes} step shapes, "
        f"{compiles_so_far() - compiles_before} graphs compiled); KV cache {cache.num_blocks} blocks",
        file=out, flush=True,
    )  # fmt: skip

    @app.exception_handler(PromptTooLongError)
    async def _too_long(_request, exc):
        return JSONResponse(RequestError(None, str(exc)).body(), 400)

    @app.exception_handler(RequestError)
    async def _refused(_request, exc):
        return JSONResponse(exc.body(), exc.status)

    served = {forced, *aliases}
    return Guard(app, served=served, canonical=forced, max_pending=max_pending, metrics=metrics, limits=limits)


def run_server(model: str, *, host: str, port: int, max_pending: int, warmup: bool = True, aliases=(), out=None,
               tp: int = 1, limits=None, **serve_flags) -> None:  # fmt: skip
    """Run transformers' server for ``model`` on the TPU until it is stopped (SIGINT/SIGTERM); ``tp > 1``: as rank
    0 of ``hf-tpu serve --tp`` (:mod:`hf_tpu.serving.tensor_parallel`)."""
    import sys

    from transformers.cli import serve as serve_cli
    from transformers.cli.serving import server as server_module

    from hf_tpu.serving._handlers import handler_classes
    from hf_tpu.serving._openai import Limits

    out = out or sys.stdout
    limits = limits or Limits()
    upstream = server_module.build_server
    started: list = []

    @functools.wraps(upstream)
    def build_server(model_manager, chat_handler, *args, **kwargs):
        state = kwargs["generation_state"]
        # chat and completions answered per request (hf_tpu.serving._handlers), the other endpoints upstream's
        ChatHandler, TextHandler = handler_classes()
        chat = ChatHandler(model_manager, state, chat_template_kwargs=chat_handler.chat_template_kwargs)
        kwargs["completion_handler"] = TextHandler(model_manager, state)
        app = upstream(model_manager, chat, *args, **kwargs)
        guarded = _prepare(
            app, model_manager, state, aliases=set(aliases), max_pending=max_pending, warmup=warmup, out=out,
            started=started, tp=tp, limits=limits,
        )  # fmt: skip
        ranks = f", tensor parallel over {tp} ranks" if tp > 1 else ""
        print(f"hf-tpu serve: listening on http://{host}:{port} (OpenAI API under /v1, metrics at /metrics{ranks})",
              file=out, flush=True)  # fmt: skip
        return guarded

    versions = ">=5.24,<5.25"
    patch(server_module, "build_server", build_server, feature=FEATURE, package="transformers", versions=versions)
    try:
        serve_cli.Serve(
            force_model=model, continuous_batching=True, device="tpu", host=host, port=port, **serve_flags
        )
    finally:
        for cb in started:  # uvicorn has stopped: stop the generation thread too, so that the process exits
            cb.stop(block=True, hard_stop=True)  # nothing is left to serve: fail what is pending
        revert(FEATURE)
