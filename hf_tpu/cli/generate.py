"""``hf-tpu generate``: load a causal LM onto the TPU, warm up the shapes it needs, and stream generated text.

``MODEL_DIR`` defaults to the small model that ships with hf_tpu (``hf_tpu.assets``), so the demo needs no
download; ``--model`` is the same as the positional ``MODEL_DIR`` (the spelling the examples use). A progress bar
covers loading and warm-up (the compiles), then the text streams token by token.

The prompt and the KV cache are padded to the rungs of a bucket ladder (powers of two up to the model's
``max_position_embeddings``): ``--buckets 32,128,512`` sets the ladder, ``--max-prompt-len N`` keeps only the last
``N`` tokens of the prompt. A prompt or ``--max-new-tokens`` past the largest rung is refused with the flag to use.

Without a model directory and without the shipped default model, the command ends with ``SystemExit`` and the
message (exit status 1).

Example:
    $ hf-tpu generate --simulate --prompt "The king said"
    $ hf-tpu generate --model ./my-model --prompt "Once upon a time" --max-new-tokens 64 --do-sample --seed 0
    $ hf-tpu generate ./my-model --buckets 64,256,1024 --max-prompt-len 900 --prompt "$(cat story.txt)"
"""

from __future__ import annotations

import argparse
import sys
import time

from hf_tpu.errors import UserError

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
    parser.add_argument(
        "--model", dest="model_opt", metavar="MODEL_DIR", default=None, help="the same as the positional MODEL_DIR"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default: 48)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up (compiles on the first token)")
    parser.add_argument(
        "--buckets",
        type=_ladder,
        metavar="N,N,...",
        default=None,
        help="lengths prompt and cache are padded to, e.g. 32,128,512 (default: powers of two from 16 up to the "
        "model's max_position_embeddings)",
    )
    parser.add_argument(
        "--max-prompt-len",
        type=int,
        metavar="N",
        default=None,
        help="keep only the last N tokens of the prompt (default: all of it)",
    )
    parser.add_argument("--stats", action="store_true", help="print the device counters (simulated device)")
    return parser


def _ladder(text: str) -> tuple[int, ...]:
    try:
        rungs = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of lengths, e.g. 32,128,512")
    if not rungs or rungs[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: bucket lengths must be positive integers, e.g. 32,128,512")
    return rungs


def _overflow(prompt_len: int, new_tokens: int, rungs: tuple[int, ...], limit: int | None) -> str | None:
    """The CLI's message when the prompt or prompt + new tokens do not fit the ladder (None when they fit)."""
    biggest = rungs[-1]
    need = prompt_len + new_tokens - 1  # the cache holds the prompt and every generated token but the last
    if prompt_len <= biggest and need <= biggest:
        return None
    if limit and need > limit:  # no ladder helps: past the model's trained positions the text degenerates
        room = limit - new_tokens + 1
        keep = f"keep the prompt's end with --max-prompt-len {room}, or " if 1 <= room < prompt_len else ""
        warmed = [r for r in rungs if r + new_tokens - 1 <= min(biggest, limit)]
        if keep and warmed and warmed[-1] < room:  # the longest prompt warm-up serves, then what fits without it
            keep = (f"keep the prompt's end with --max-prompt-len {warmed[-1]} (up to --max-prompt-len {room} fits, "
                    "without a warm-up: its first token then compiles), or ")  # fmt: skip
        return (
            f"the prompt ({prompt_len} tokens) plus --max-new-tokens {new_tokens} needs {need} positions, past the "
            f"model's max_position_embeddings ({limit}), which no --buckets ladder can pass: {keep}lower "
            "--max-new-tokens."
        )
    top = 1 << (need - 1).bit_length()
    larger = [r for r in rungs if r < need] + [min(top, limit) if limit else top]
    ladder = f"--buckets {','.join(map(str, larger))}"
    if prompt_len > biggest:
        # The warm-up compiles a prompt's bucket at its full length: advise the longest prompt whose bucket plus the
        # new tokens fits (a rung), and say how much more fits when the first token may compile instead.
        fits = biggest - new_tokens + 1 if biggest > new_tokens else biggest
        warmed = [r for r in rungs if r + new_tokens - 1 <= biggest]
        if warmed and warmed[-1] < fits:
            keep = (f"--max-prompt-len {warmed[-1]} (up to --max-prompt-len {fits} fits, without a warm-up: its "
                    "first token then compiles)")  # fmt: skip
        else:
            keep = f"--max-prompt-len {fits}"
        return (
            f"the prompt is {prompt_len} tokens, past the largest bucket ({biggest}, ladder {list(rungs)}): keep its "
            f"end with {keep}, or give a larger ladder: {ladder}."
        )
    return (
        f"the prompt ({prompt_len} tokens) plus --max-new-tokens {new_tokens} needs a cache of {need} tokens, past "
        f"the largest bucket ({biggest}, ladder {list(rungs)}): lower --max-new-tokens, shorten the prompt "
        f"(--max-prompt-len), or give a larger ladder: {ladder}."
    )


def model_dir_of(arg: str | None, tokenizer: bool = True):
    from hf_tpu.cli._model_path import ModelSource, resolve_model_dir

    if arg:
        return resolve_model_dir(arg, tokenizer)
    try:
        from hf_tpu.assets import default_model_path
    except ImportError:
        raise SystemExit("hf-tpu generate: give a MODEL_DIR (this hf_tpu build ships no default model)") from None
    try:
        return ModelSource(str(default_model_path()))
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
    if getattr(args, "max_prompt_len", None) is not None and args.max_prompt_len < 1:
        print("hf-tpu generate: --max-prompt-len must be at least 1", file=sys.stderr)
        return 2
    model_opt = getattr(args, "model_opt", None)
    if model_opt and args.model_dir and model_opt != args.model_dir:
        print(
            f"hf-tpu generate: two models given ({args.model_dir} and --model {model_opt}): give one", file=sys.stderr
        )
        return 2
    source = model_dir_of(model_opt or args.model_dir)
    path, local = source.path, {"local_files_only": True} if source.local_files_only else {}

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
    from transformers.utils import logging as hf_logging

    import hf_tpu
    from hf_tpu.transformers.buckets import BucketOverflowError, default_ladder
    from hf_tpu.transformers.generation import configure

    hf_tpu.enable("generation")
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    with tqdm(total=3, desc="loading", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path, **local)
        bar.update()
        bar.set_postfix_str("weights")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **local).eval()
        except Exception as err:
            from hf_tpu.device_map.files import checkpoint_error

            better = checkpoint_error(path, err)  # a truncated weights file: name it (safetensors does not)
            if better is not None:
                raise better from err
            if isinstance(err, UserError) or not isinstance(err, (OSError, ValueError)):
                raise
            bar.close()
            print(f"hf-tpu generate: cannot load a causal LM from {path}: {err}", file=sys.stderr)
            return 1
        bar.update()
        bar.set_postfix_str("to tpu")
        model.to("tpu")
        bar.update()

    inputs = tokenizer(args.prompt, return_tensors="pt")
    if args.max_prompt_len is not None and inputs["input_ids"].shape[1] > args.max_prompt_len:
        inputs = {k: v[:, -args.max_prompt_len :] for k, v in inputs.items()}
    prompt_len = int(inputs["input_ids"].shape[1])
    ladder = default_ladder(model.config)
    if args.buckets is not None:
        configure(model, buckets=args.buckets)
        ladder = type(ladder)(args.buckets)
    message = _overflow(prompt_len, args.max_new_tokens, ladder.rungs, _position_limit(model.config))
    if message:
        print(f"hf-tpu generate: {message}", file=sys.stderr)
        return 2
    warm = not args.no_warmup
    if warm and ladder.bucket(prompt_len) + args.max_new_tokens - 1 > ladder.max:
        # hf_tpu.warmup compiles the prompt's bucket at its full length, which with these new tokens passes the
        # largest rung although this prompt fits: compile on first use instead.
        print(
            f"hf-tpu generate: no warm-up: the prompt's bucket ({ladder.bucket(prompt_len)}) plus --max-new-tokens "
            f"passes the largest bucket ({ladder.max}); the first token compiles instead",
            file=sys.stderr,
        )
        warm = False
    sample_kwargs: dict = {"do_sample": bool(args.do_sample)}
    if args.do_sample:
        if args.temperature is not None:
            sample_kwargs["temperature"] = args.temperature
        if args.top_k is not None:
            sample_kwargs["top_k"] = args.top_k
    # warm-up compiles the graphs of the model's own generation config: made this run's settings first, so that a
    # sampled run (or a greedy run of a model whose config samples) finds its graphs warm instead of compiling them
    # mid-generation (on a v5e the first sampled run compiled them: 96 tokens in 28.5 s)
    for key, value in sample_kwargs.items():
        setattr(model.generation_config, key, value)
    try:
        if warm:
            hf_tpu.warmup(model, max_prompt_len=prompt_len, batch_sizes=[1], max_new_tokens=args.max_new_tokens)
    except BucketOverflowError as err:
        print(f"hf-tpu generate: {err} (the flags: --buckets, --max-prompt-len, --max-new-tokens)", file=sys.stderr)
        return 2
    ready = time.perf_counter()
    if args.do_sample and args.seed is not None:
        torch.manual_seed(args.seed)  # after warm-up, whose graphs draw from the device's generator too
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
        print(f"hf-tpu generate: {err} (the flags: --buckets, --max-prompt-len, --max-new-tokens)", file=sys.stderr)
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


def _position_limit(config) -> int | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return value if isinstance(value, int) and value > 0 else None
