"""``hf-tpu serve``: an OpenAI-compatible server for a causal LM on the TPU (transformers' server, continuous
batching).

``MODEL`` defaults to the small model that ships with hf_tpu, so one command starts a server. It binds 127.0.0.1
unless ``--host`` says otherwise, listens as soon as the model is loaded, warms up every step shape (printing its
progress; ``/health`` answers 503 until it is done), and serves the model under ``--served-model-name`` (default:
the model directory's name). Endpoints are transformers' (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, streaming with ``"stream": true``) plus ``GET /v1/models/{id}`` and ``/metrics`` (Prometheus).
SIGINT/SIGTERM stop it. A ``--port`` already taken is refused in one line (exit status 2) before anything loads.
``--uds PATH`` serves on a unix domain socket instead (no TCP socket at all).

Example:
    $ hf-tpu serve --simulate
    $ hf-tpu serve ./my-model --port 8080 --kv-cache-gib 4
    $ hf-tpu serve ./my-model --compile-cache ~/.cache/hf_tpu/compile
    $ hf-tpu serve ./my-model --tp 4
    $ hf-tpu serve --uds /tmp/hf-tpu.sock       # a unix domain socket instead of host:port
    $ hf-tpu serve ./my-llama --tool-call-parser llama3_json
    $ curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d '{"prompt": "The king said", "max_tokens": 16}'
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["EXIT_PORT_TAKEN", "EXIT_WORKER_DIED", "register", "run"]

#: Exit status when ``--host``/``--port`` cannot be listened on (a port taken): said before the model loads.
EXIT_PORT_TAKEN = 2
#: Exit status when the continuous-batching worker died: the server stopped so that a supervisor restarts it.
EXIT_WORKER_DIED = 3


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a causal LM over an OpenAI-compatible HTTP API (transformers serve, continuous batching)",
        description="Run transformers' OpenAI-compatible server with continuous batching on the tpu device.",
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="model directory (default: the model shipped with hf_tpu)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on (default: 8000); a port already taken: exit status 2 at once")
    parser.add_argument("--uds", default=None, metavar="PATH",
                        help="listen on this unix domain socket instead of --host/--port (no TCP socket is opened); "
                        "a server already there: exit status 2 at once")  # fmt: skip
    parser.add_argument("--kv-cache-gib", type=_positive_float, default=None,
                        help="cap on the paged KV cache, GiB (default: sized for --slots full-length requests, at "
                        "most half the chip's free HBM; also HF_TPU_KV_CACHE_GIB)")  # fmt: skip
    parser.add_argument("--slots", type=_positive_int, default=None, help="requests per step (default: 32)")
    parser.add_argument("--max-batch-tokens", type=_positive_int, default=None,
                        help="largest step in tokens; longer prompts prefill in chunks (default: 256)")  # fmt: skip
    parser.add_argument("--min-step-tokens", type=_positive_int, default=None,
                        help="smallest step rung in tokens (default: 16; the rungs go up x4 to --max-batch-tokens)")
    parser.add_argument("--read-back-every", type=_positive_int, default=None, metavar="K",
                        help="decode-only steps run between two read-backs of their tokens; a stream gets its tokens "
                        "up to K at a time (default: 8; 1: a read-back each step)")  # fmt: skip
    parser.add_argument("--max-pending", type=_positive_int, default=None,
                        help="requests in flight before new ones get 429 (default: 4 x --slots)")  # fmt: skip
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in /v1/models and in every answer; requests may name it, the model "
                        "directory's name or its path (default: the directory's name)")  # fmt: skip
    parser.add_argument("--max-n", type=_positive_int, default=16,
                        help="most choices (n) one request may ask for; more gets 400 (default: 16)")  # fmt: skip
    parser.add_argument("--max-logprobs", type=int, default=5, choices=range(0, 21), metavar="K",
                        help="most top log-probabilities per token a request may ask for, 0 to 20 (default: 5)")
    parser.add_argument("--disable-any-whitespace", action="store_true",
                        help="structured output's JSON without whitespace between its tokens (vLLM's "
                        "disable_any_whitespace; default: any whitespace, as vLLM)")  # fmt: skip
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="store the step graphs in DIR and load them in the next process "
                        "(default: HF_TPU_COMPILE_CACHE, else none)")  # fmt: skip
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                        help="tensor parallel over N chips: one process per chip through hf-tpu launch; rank 0 "
                        "serves HTTP (default: 1)")  # fmt: skip
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up (compiles on first requests)")
    from hf_tpu.serving._tools import FORMATS

    parser.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS), metavar="NAME",
                        help="parse chat replies' tool calls in this format, one of: " + ", ".join(sorted(FORMATS))
                        + " (default: transformers' response template of the model, else the format its chat "
                        "template writes calls in)")  # fmt: skip
    # transformers serve's flags that apply here, passed through unchanged.
    parser.add_argument("--dtype", default="auto", help="model dtype (transformers serve's --dtype)")
    parser.add_argument("--attn-implementation", default=None, help="(transformers serve's --attn-implementation)")
    parser.add_argument("--log-level", default="warning", help="(transformers serve's --log-level)")
    parser.add_argument("--enable-cors", action="store_true", help="(transformers serve's --enable-cors)")
    parser.add_argument("--default-seed", type=int, default=None, help="(transformers serve's --default-seed)")
    return parser


def refuse_early(args: argparse.Namespace) -> int | None:
    """Refuse a ``--host``/``--port`` that cannot be listened on (a port taken), in one line, before torch, the
    simulator or the model load (uvicorn would only log it once the model is warm); None when it is free."""
    import os

    from hf_tpu import _env
    from hf_tpu.serving.server import port_taken, uds_unusable

    follower = _env.SERVE_TP.is_set() and os.environ.get("RANK") not in (None, "0")
    if follower:
        taken = None
    elif not 0 <= args.port <= 65535:
        taken = f"--port {args.port} is not a port: pass one from 1 to 65535 (0: any free port)"
    elif args.uds is not None:
        taken = uds_unusable(args.uds)
    else:
        taken = port_taken(args.host, args.port)
    if taken is None:
        return None
    print(f"hf-tpu serve: {taken}", file=sys.stderr)
    return EXIT_PORT_TAKEN


def run(args: argparse.Namespace) -> int:
    import os

    import hf_tpu
    from hf_tpu import _env, runtime, serving
    from hf_tpu.cli._model_path import resolve_model_dir
    from hf_tpu.errors import UserError

    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401  (transformers serve imports it)
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UserError(f"hf-tpu serve needs {exc.name}: pip install 'hf-tpu[serve]'") from None
    from hf_tpu.serving import tensor_parallel

    rank = os.environ.get("RANK") if _env.SERVE_TP.is_set() else None
    if args.tp > 1 and rank is None:  # the parent: start one rank per chip, each runs this command
        simulate = bool(args.simulate or _env.SIMULATE.get())
        counts = tensor_parallel.valid_tp_sizes(simulate=simulate)
        if counts and args.tp not in counts:  # refused here, in the command's own words, before any rank starts
            nearest = min(counts, key=lambda n: (abs(n - args.tp), n))
            raise UserError(
                f"--tp {args.tp}: torch_tpu lays out {', '.join(map(str, counts))} chip(s) per host here, not "
                f"{args.tp}. Pass --tp {nearest} (or another of those counts)."
            )
        return tensor_parallel.launch(_without_tp(args.argv), args.tp, simulate=simulate)
    if args.model is None:
        from hf_tpu.assets import default_model_path

        model = str(default_model_path())
    else:
        model = str(resolve_model_dir(args.model).path)
    runtime.require_tpu("hf-tpu serve")
    settings = {
        "kv_cache_gib": args.kv_cache_gib, "slots": args.slots, "max_batch_tokens": args.max_batch_tokens,
        "q_min": args.min_step_tokens, "compile_cache": args.compile_cache, "max_logprobs": args.max_logprobs,
        "read_back_every": args.read_back_every, "json_whitespace": False if args.disable_any_whitespace else None,
    }  # fmt: skip
    # (configure opens --compile-cache's directory at once: before the model's load, which compiles)
    serving.configure(**{k: v for k, v in settings.items() if v is not None})
    hf_tpu.enable()
    if rank not in (None, "0"):
        tensor_parallel.follow(model, args.tp, warmup=not args.no_warmup, dtype=args.dtype,
                               attn_implementation=args.attn_implementation)  # fmt: skip
        return 0
    from hf_tpu.serving._openai import Limits
    from hf_tpu.serving.server import WorkerDiedError, run_server

    max_pending = args.max_pending or 4 * serving.SETTINGS.slots
    aliases = {os.path.basename(model.rstrip("/"))}
    try:
        run_server(
            model, host=args.host, port=args.port, max_pending=max_pending, warmup=not args.no_warmup,
            aliases=aliases, served_name=args.served_model_name,
            dtype=args.dtype, attn_implementation=args.attn_implementation, log_level=args.log_level,
            enable_cors=args.enable_cors, default_seed=args.default_seed, tp=args.tp, uds=args.uds,
            limits=Limits(max_n=args.max_n, max_logprobs=args.max_logprobs), tool_call_parser=args.tool_call_parser,
        )  # fmt: skip
    except WorkerDiedError as err:
        print(f"hf-tpu serve: {err}; exiting with status {EXIT_WORKER_DIED} so that a supervisor restarts it",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.stdout.flush()
        # at once: the interpreter's teardown (the model, dynamo's caches, the uvicorn loop left unclosed) took 3 to
        # 12 s on a loaded host, and a supervisor waits on it to restart the server
        os._exit(EXIT_WORKER_DIED)
    return 0


def _without_tp(argv: list[str]) -> list[str]:
    """``hf-tpu serve``'s arguments as given, without the command name and ``--tp``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--tp":
            skip = True
        elif not arg.startswith("--tp=") and arg != "serve":
            out.append(arg)
    return out
