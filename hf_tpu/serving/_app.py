"""transformers' FastAPI app (``transformers.cli.serving.server.build_server``) around the one model ``hf-tpu serve``
runs, and every other call ``hf-tpu serve`` makes into transformers' serving code.

transformers' ``Serve`` changed between the releases hf_tpu supports. On 5.24 it loads its models in the server's
process, and its handlers reach them through a ``ModelManager`` and a ``GenerationState`` (``_resolve_model``,
``get_manager(...)._cb``). On 5.25 each model runs in a process of its own (``EngineClient``, spawned by the
``ModelManager``, talked to over multiprocessing queues that carry token ids), and the API server only tokenizes and
detokenizes. ``hf-tpu serve`` keeps its model, its continuous batch and its warm-up in the server's process on both:
one process holds the chip; the warm-up's progress, ``/health`` and ``/metrics`` read the batch directly; and the
per-request sampling, choices, stop strings and log-probabilities of :mod:`hf_tpu.serving._handlers` read the batch's
outputs, which 5.25's engine protocol does not carry. So ``hf-tpu serve`` builds transformers' app with transformers'
own factory and endpoints, hf_tpu's handlers (subclasses of transformers' chat, completions and responses handlers)
and :class:`ServedModel` in the place of the model manager, and serves it with uvicorn itself (not through ``Serve``,
whose 5.24 and 5.25 forms share nothing hf_tpu could hook into).

What is read from the installed transformers by behaviour, not by its version: the arguments the app factory takes
(:func:`build_app`: 5.24's takes ``generation_state``, 5.25's does not), and whether transformers' response-template
helpers take the model (5.24) or its config (5.25) (:func:`model_or_config`). Where a signature is not one hf_tpu
knows, :class:`UpstreamServingError` names the function, the signature found and what hf_tpu expected.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Any

from hf_tpu.errors import HfTpuError, HfTpuRuntimeError
from hf_tpu.serving._openai import RequestError

__all__ = [
    "BatchDiedError",
    "NotServed",
    "ServedModel",
    "UpstreamServingError",
    "build_app",
    "model_or_config",
    "response_parser",
    "worker_failure",
]

#: The transformers releases whose serving code this module was written against (5.24.0 and 5.25.0 tested).
WRITTEN_FOR = ">=5.24,<5.26"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
SYSTEMONE = "/v1/systemone"


class UpstreamServingError(HfTpuError, TypeError):
    """The installed transformers' serving code does not take what hf_tpu hands it (the message names the function,
    the signature found and what hf_tpu expected)."""


class BatchDiedError(HfTpuRuntimeError):
    """A request reached the continuous batch after its worker died (answered 503: the server is exiting so that a
    supervisor restarts it)."""


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def worker_failure(cb) -> str | None:
    """Why the continuous-batching manager ``cb``'s generation thread died (its fatal error, or that it ended), or
    None while it runs."""
    error = cb.background_thread_status.fatal_error
    if error is not None:
        return f"{type(error).__name__}: {error}"
    if not cb.is_running():
        return "its generation thread ended"
    return None


class ServedModel:
    """The one model ``hf-tpu serve`` runs, where transformers' app looks for its models.

    As the app's model manager: ``list_models`` (``GET /v1/models``: the served name alone), ``load_model_streaming``
    (``POST /load_model``: ready for a name the model is served under, an error event otherwise), ``shutdown`` (the
    app's end and ``POST /reset``: nothing; ``hf-tpu serve`` stops the batch itself once uvicorn has stopped),
    ``is_dead`` (5.25's ``/health``) and ``process_model_name`` (5.24's ``/load_model``). As 5.24's generation state:
    ``is_cb_alive`` (its ``/health``). hf_tpu's handlers read ``model``, ``processor`` and ``cb`` from it.

    Args:
        name: the name it is served under (``--served-model-name``).
        names: every name a request may give it (the served name, the directory's name, the path).
        model: the loaded model (on the ``tpu`` device).
        processor: its processor or tokenizer.
    """

    def __init__(self, name: str, names: set[str], model: Any, processor: Any) -> None:
        self.name, self.names, self.model, self.processor = name, {name, *names}, model, processor
        self.cb = None  # the continuous-batching manager, set once made
        self.created = int(time.time())

    def card(self) -> dict:
        """The model's object in ``/v1/models`` (and ``GET /v1/models/{id}``)."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "hf_tpu"}

    def list_models(self, *_args, **_kwargs) -> list[dict]:
        return [self.card()]

    def failure(self) -> str | None:
        """Why the batch's worker died, or None while it runs (or before the batch exists)."""
        return None if self.cb is None else worker_failure(self.cb)

    @property
    def is_dead(self) -> bool:
        return self.failure() is not None

    def is_cb_alive(self) -> bool:
        return self.failure() is None

    def check_alive(self, request_id: str) -> None:
        """Raise :class:`BatchDiedError` when the batch's worker died (answered 503), before a request joins it."""
        died = self.failure()
        if died is not None:
            raise BatchDiedError(f"the continuous-batching worker died and cannot take request {request_id}: {died}")

    @staticmethod
    def process_model_name(model: str) -> str:
        return model

    async def load_model_streaming(self, model: str, *_args, **_kwargs):
        """``POST /load_model``: one SSE event, ``ready`` for a name the model is served under, else ``error``."""
        if model in self.names:
            yield f"data: {json.dumps({'status': 'ready', 'model': self.name, 'cached': True})}\n\n"
            return
        message = f"model {model!r} is not served here; this server serves {self.name!r} and loads no other"
        yield f"data: {json.dumps({'status': 'error', 'model': model, 'message': message})}\n\n"

    def shutdown(self, *_args, **_kwargs) -> None:
        return None


class NotServed:
    """transformers' handler of an endpoint ``hf-tpu serve`` does not serve (it serves a causal LM: no speech
    recognition, no decision model): every request -> 404 naming the served model."""

    def __init__(self, path: str, served: str) -> None:
        self.path, self.served = path, served

    async def handle_request(self, *_args, **_kwargs):
        raise RequestError(None, f"{self.path} is not served here: hf-tpu serve serves {self.served!r}, a causal LM",
                           status=404, kind="not_found_error")  # fmt: skip


def build_app(served: ServedModel, chat, text, responses, *, enable_cors: bool = False):
    """transformers' FastAPI app (its routes, middleware and exception handlers) from its own factory, with hf_tpu's
    chat, completions and responses handlers and ``served`` as the model manager (and as 5.24's generation state).

    Raises:
        UpstreamServingError: the factory takes an argument hf_tpu does not have, or not the handlers it expects.
    """
    from transformers.cli.serving import server as server_module

    factory = server_module.build_server
    params = inspect.signature(factory).parameters
    offered = {
        "model_manager": served, "chat_handler": chat, "completion_handler": text, "response_handler": responses,
        "transcription_handler": NotServed(TRANSCRIPTIONS, served.name),
        "systemone_handler": NotServed(SYSTEMONE, served.name), "generation_state": served, "enable_cors": enable_cors,
    }  # fmt: skip
    needed = [name for name, p in params.items() if p.default is inspect.Parameter.empty and name not in offered]
    missing = [name for name in ("model_manager", "chat_handler", "completion_handler", "response_handler")
               if name not in params]  # fmt: skip
    if needed or missing:
        problem = f"it needs {', '.join(needed)}" if needed else f"it takes no {', '.join(missing)}"
        raise UpstreamServingError(
            f"transformers {_transformers_version()}: transformers.cli.serving.server.build_server"
            f"{inspect.signature(factory)}: {problem}. hf_tpu expected the app factory of transformers{WRITTEN_FOR} "
            "(a model manager and the handlers of chat, completions, responses, transcriptions and systemone; 5.24 "
            "also a generation state). Install one of those releases, or report the version to hf_tpu."
        )
    return factory(**{name: value for name, value in offered.items() if name in params})


def model_or_config(function, model):
    """What transformers' response-template helper ``function`` takes as its second argument: the model (5.24:
    ``get_response_template(processor, model)``, ``parse_assistant_message(processor, model, ...)``) or its config
    (5.25: ``(processor, config, ...)``), read from its signature.

    Raises:
        UpstreamServingError: its second parameter is neither ``model`` nor ``config``.
    """
    names = list(inspect.signature(function).parameters)
    second = names[1] if len(names) > 1 else None
    if second == "model":
        return model
    if second == "config":
        return model.config
    raise UpstreamServingError(
        f"transformers {_transformers_version()}: {function.__module__}.{function.__qualname__}"
        f"{inspect.signature(function)}: hf_tpu expected (processor, model, ...) (transformers 5.24) or "
        "(processor, config, ...) (5.25). Install transformers" + WRITTEN_FOR + ", or report the version to hf_tpu."
    )


def response_parser(processor, model, input_ids: list[int], tools=None):
    """A streaming parser of one answer (content, reasoning, tool calls) by the model's response template, fed the
    answer's text as hf_tpu sends it (cut at a stop string), or None where the model has no template (the text is
    sent unparsed). transformers 5.25's own ``build_response_parser`` makes a parser fed token ids, which could not
    take a text cut inside a token; the parser is the same ``ResponseParser``, built as 5.24's helper built it (the
    prompt decoded as its prefix)."""
    from transformers.cli.serving.utils import get_response_template
    from transformers.utils.chat_parsing import ResponseParser

    template = get_response_template(processor, model_or_config(get_response_template, model))
    if template is None:
        return None
    tokenizer = getattr(processor, "tokenizer", processor)
    return ResponseParser(template, prefix=tokenizer.decode(list(input_ids)), tools=tools)


def parse_message(processor, model, tokens: list[int], input_ids: list[int], text: str, tools=None):
    """transformers' ``parse_assistant_message`` of a whole answer: ``(content, reasoning, tool calls)``."""
    from transformers.cli.serving.utils import parse_assistant_message

    return parse_assistant_message(processor, model_or_config(parse_assistant_message, model), tokens,
                                   input_ids=input_ids, cleaned_content=text, tools=tools)  # fmt: skip
