"""``hf-tpu warmup``: compile a causal LM's generation graphs ahead of time into a persistent compile cache.

Run it once per model (on each host, or once with a shared ``--cache-dir``) before serving: later processes that
load the same model with the same cache directory (``hf_tpu.warmup(model, ..., cache_dir=PATH)`` or
``HF_TPU_COMPILE_CACHE=PATH``) load the graphs instead of compiling them. A progress bar covers the graphs;
``--json`` prints the report.

Example:
    $ hf-tpu warmup ./my-model --cache-dir ~/.cache/hf_tpu/compile --max-prompt-len 2048 --batch-sizes 1 4
    $ hf-tpu warmup --simulate --cache-dir /tmp/hf-tpu-cache           # the model shipped with hf_tpu
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "warmup",
        help="compile a model's generation graphs into a persistent compile cache",
        description="Load a causal LM onto the tpu device and compile (or load from the cache) every prefill and "
        "decode graph for the prompt lengths, batch sizes and new-token count given.",
    )
    parser.add_argument(
        "model_dir", nargs="?", default=None, help="model directory (default: the model shipped with hf_tpu)"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="compile-cache directory (default: $HF_TPU_COMPILE_CACHE; required when that is unset)",
    )
    parser.add_argument("--max-prompt-len", type=int, default=512, help="longest prompt to warm up (default: 512)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="batch sizes (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest generation (default: 128)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="load dtype")
    parser.add_argument("--json", action="store_true", help="print the warm-up report as JSON")
    return parser


def run(args: argparse.Namespace) -> int:
    if getattr(args, "simulate", False):  # set by hf-tpu's main; also honoured when run() is called directly
        import hf_tpu.sim

        hf_tpu.sim.enable()
    from hf_tpu import _env
    from hf_tpu.compile_cache import ENV
    from hf_tpu.runtime import require_tpu

    require_tpu("hf-tpu warmup")
    cache_dir = args.cache_dir or _env.COMPILE_CACHE.get()
    if cache_dir is None:
        print(f"hf-tpu warmup: give --cache-dir PATH (or set {ENV}) to keep what is compiled", file=sys.stderr)
        return 2
    if args.max_prompt_len < 1 or args.max_new_tokens < 1 or min(args.batch_sizes) < 1:
        print("hf-tpu warmup: --max-prompt-len, --max-new-tokens and --batch-sizes must be positive", file=sys.stderr)
        return 2
    from hf_tpu.cli.generate import model_dir_of

    source = model_dir_of(args.model_dir, tokenizer=False)  # warm-up runs no tokenizer
    path, local = source.path, {"local_files_only": True} if source.local_files_only else {}

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import hf_tpu
    from hf_tpu.transformers.buckets import BucketOverflowError

    hf_tpu.enable("generation")
    hf_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **local).eval().to("tpu")
    try:
        report = hf_tpu.warmup(
            model, max_prompt_len=args.max_prompt_len, batch_sizes=args.batch_sizes,
            max_new_tokens=args.max_new_tokens, cache_dir=cache_dir,
        )  # fmt: skip
    except BucketOverflowError as err:
        print(f"hf-tpu warmup: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "model": str(path), "cache_dir": report.cache_dir, "graphs": [list(g) for g in report.graphs],
            "new_compiles": report.new_compiles, "from_cache": report.from_cache, "seconds": report.seconds,
            "cache_problems": report.cache_problems, "tpu_cache_requests": report.tpu_cache_requests,
            "tpu_cache_misses": report.tpu_cache_misses,
        }))  # fmt: skip
    else:
        print(report)
        print(f"compile cache: {report.cache_dir}")
        for problem in report.cache_problems:
            print(f"  reported and bypassed: {problem}")
    return 0
