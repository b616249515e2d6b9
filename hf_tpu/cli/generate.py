"""``hf-tpu generate``: load a causal LM onto the TPU, warm up the shapes it needs, and stream generated text.

``MODEL_DIR`` defaults to the small model that ships with hf_tpu (``hf_tpu.assets``), so the demo needs no
download. A progress bar covers loading and warm-up (the compiles), then the text streams token by token.

Example:
    $ hf-tpu generate --simulate --prompt "The king said"
    $ hf-tpu generate ./my-model --prompt "Once upon a time" --max-new-tokens 64 --do-sample --seed 0
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["register", "run"]

DEFAULT_PROMPT = "The king said"


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a causal LM on the tpu device",
        description="Load a causal LM onto the tpu device, warm up its shapes, and stream generated text.",
    )
    parser.add_argument(
        "model_dir", nargs="?", default=None, help="model directory (default: the model shipped with hf_tpu)"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default: 48)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up (compiles on the first token)")
    parser.add_argument("--stats", action="store_true", help="print the device counters (simulated device)")
    return parser


def _model_dir(arg: str | None) -> str:
    if arg:
        return arg
    try:
        from hf_tpu.assets import default_model_path
    except ImportError:
        raise SystemExit("hf-tpu generate: give a MODEL_DIR (this hf_tpu build ships no default model)") from None
    try:
        return str(default_model_path())
    except FileNotFoundError as err:
        raise SystemExit(f"hf-tpu generate: {err}") from None


def run(args: argparse.Namespace) -> int:
    if getattr(args, "simulate", False):  # set by hf-tpu's main; also honoured when run() is called directly
        import hf_tpu.sim

        hf_tpu.sim.enable()
    from hf_tpu.runtime import detect, require_tpu

    require_tpu("hf-tpu generate")
    if args.max_new_tokens < 1:
        print("hf-tpu generate: --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    path = _model_dir(args.model_dir)

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
    from transformers.utils import logging as hf_logging

    import hf_tpu
    from hf_tpu.transformers.buckets import BucketOverflowError

    hf_tpu.enable("generation")
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    with tqdm(total=3, desc="loading", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path)
        bar.update()
        bar.set_postfix_str("weights")
        try:
            model = AutoModelForCausalLM.from_pretrained(path).eval()
        except (OSError, ValueError) as err:
            bar.close()
            print(f"hf-tpu generate: cannot load a causal LM from {path}: {err}", file=sys.stderr)
            return 1
        bar.update()
        bar.set_postfix_str("to tpu")
        model.to("tpu")
        bar.update()

    inputs = tokenizer(args.prompt, return_tensors="pt")
    prompt_len = int(inputs["input_ids"].shape[1])
    try:
        if not args.no_warmup:
            hf_tpu.warmup(model, max_prompt_len=prompt_len, batch_sizes=[1], max_new_tokens=args.max_new_tokens)
    except BucketOverflowError as err:
        print(f"hf-tpu generate: {err}", file=sys.stderr)
        return 2
    ready = time.perf_counter()

    sample_kwargs: dict = {}
    if args.do_sample:
        sample_kwargs["do_sample"] = True
        if args.temperature is not None:
            sample_kwargs["temperature"] = args.temperature
        if args.top_k is not None:
            sample_kwargs["top_k"] = args.top_k
        if args.seed is not None:
            torch.manual_seed(args.seed)
    else:
        sample_kwargs["do_sample"] = False
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    stats_ctx = None
    if args.stats and detect().mode == "simulated":
        import hf_tpu.sim

        stats_ctx = hf_tpu.sim.stats()
    try:
        if stats_ctx is not None:
            with stats_ctx as counters:
                out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer, **sample_kwargs)
        else:
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer, **sample_kwargs)
    except BucketOverflowError as err:
        print(f"hf-tpu generate: {err}", file=sys.stderr)
        return 2
    done = time.perf_counter()
    new_tokens = int(out.shape[1]) - prompt_len
    print(
        f"[{new_tokens} tokens in {done - ready:.2f}s after {ready - started:.1f}s of loading and warm-up; "
        f"device: {detect().mode}]",
        file=sys.stderr,
    )
    if stats_ctx is not None:
        print(counters, file=sys.stderr)
    return 0
