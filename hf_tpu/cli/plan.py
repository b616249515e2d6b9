"""``hf-tpu plan``: what a TPU would spend on a model's ``generate``, compiled by libtpu on this host, no chip needed.

The model's config is enough (weights are deferred tpu tensors: nothing is read or allocated). The prefill and
decode programs of hf_tpu's warm-up go through torch_tpu's real lowering and libtpu's compiler for the target; the
table says whether the model fits the chip's HBM, what each program took to compile, and the decode step's
projected time (an estimate from the compiler's counts, not a measurement). Progress goes to stderr, the table or
``--json``'s object to stdout. Needs torch-tpu, libtpu and jax (``pip install 'hf-tpu[tpu]'``). See docs/planning.md.

With ``--pipeline``, MODEL is a diffusers pipeline directory and the plan is its denoiser step at one resolution.
With ``--train``, the plan is one training step (forward with the loss, backward, AdamW) per device, and each device's
share under FSDP over the target's devices (that column is arithmetic on the compiler's one-device figures).

Exit status: 0 fits, 3 does not fit, 1 could not plan (a program failed for another reason, a package missing), 2 a
bad command line (``--help`` says more).

Example:
    $ hf-tpu plan ./llama-3-8b-shape --target v6e-1 --max-prompt-len 2048 --max-new-tokens 256
    $ hf-tpu plan ./llama-3-8b-shape/config.json --target v6e-1 --quantization int8 --json
    $ hf-tpu plan ./sd3-medium --pipeline --target v6e-1 --height 1024 --width 1024
    $ hf-tpu plan ./llama-3-8b-shape --train --target v6e-8 --seq-len 2048 --layers 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["register", "run"]


def register(subparsers) -> argparse.ArgumentParser:
    from hf_tpu.tpu_compile.targets import TARGETS

    parser = subparsers.add_parser(
        "plan",
        help="compile a model's generate (or a pipeline's denoiser step) for a TPU without one: HBM fit, compile "
        "time, projected step",
        description="Lower the prefill and decode programs hf_tpu's generate compiles through torch_tpu's real "
        "front end and compile them with libtpu for TARGET, on this host (no TPU needed); report HBM fit, compile "
        "times and the decode step's projected time (the compiler's estimate, not a measurement); with --pipeline, "
        "the same for a diffusers pipeline's denoiser step.",
        epilog="exit status: 0 fits (every program the run needs compiled within the target's HBM); 3 does not fit "
        "(the weights and KV cache, or a program, exceed the target's HBM: the plan names it, the bytes it needed "
        "and what would fit); 1 could not plan (a program failed to lower or compile for another reason, its error "
        "printed; or torch-tpu, or torchao for --quantization int8/int4, is not installed: the message names the "
        "extra); 2 a bad command line or input. --train: 3 when even the FSDP share does not fit.",
    )
    parser.add_argument(
        "model", help="a model directory or its config.json; with --pipeline a diffusers pipeline directory (no weights "
        "are read)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline", action="store_true",
        help="MODEL is a diffusers pipeline (model_index.json): plan its denoiser step at --height x --width",
    )  # fmt: skip
    parser.add_argument(
        "--train", action="store_true",
        help="plan one training step (forward+loss, backward, AdamW) per device, and its FSDP share over the "
        "target's devices (arithmetic on the compiler's one-device figures)",
    )  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=2048, help="--train: tokens per sequence (default: 2048)")
    parser.add_argument(
        "--layers", type=int, default=None,
        help="--train: plan only the first N decoder layers (same width), when the whole step takes too long to compile",
    )  # fmt: skip
    parser.add_argument(
        "--shards", type=int, default=None, help="--train: FSDP degree (default: the target's device count)"
    )
    parser.add_argument(
        "--compute-dtype", default=None, choices=("bfloat16", "float32", "float16"),
        help="--train: compute the forward and backward on the weights cast to this dtype (FSDP2 mixed precision, "
        "e.g. --dtype float32 --compute-dtype bfloat16); default: --dtype",
    )  # fmt: skip
    parser.add_argument("--height", type=int, default=1024, help="--pipeline: image height (default: 1024)")
    parser.add_argument("--width", type=int, default=1024, help="--pipeline: image width (default: 1024)")
    parser.add_argument(
        "--guidance-scale", type=float, default=None,
        help="--pipeline: guidance scale of the call (default: the pipeline's; above 1 doubles the batch with CFG)",
    )  # fmt: skip
    parser.add_argument("--target", default="v6e-1", choices=sorted(TARGETS), help="TPU to compile for (v6e-1)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    parser.add_argument("--max-prompt-len", type=int, default=2048, help="longest prompt (default: 2048)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per call (default: 256)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"), help="weights")
    parser.add_argument("--quantization", default=None, choices=("int8", "int4", "fp8"), help="weight-only quantization")
    parser.add_argument(
        "--buckets", default="largest", choices=("largest", "all"),
        help="compile the largest prompt bucket's programs (default) or every bucket warm-up would",
    )  # fmt: skip
    parser.add_argument(
        "--dump-hlo", metavar="DIR", default=None,
        help="keep libtpu's scheduled HLO of each program in DIR and report how much of the decode step's bytes "
        "accessed is HBM traffic (python -m hf_tpu.tpu_compile.hlo_bytes DIR breaks it down; compiles ~3x slower)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def run(args: argparse.Namespace) -> int:
    from hf_tpu.tpu_compile.plan import EXIT_COULD_NOT_PLAN, EXIT_USAGE, MissingPackageError

    if min(args.batch, args.max_prompt_len, args.max_new_tokens) < 1:
        print("hf-tpu plan: --batch, --max-prompt-len and --max-new-tokens must be positive", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run(args)
    except MissingPackageError as exc:  # could not plan: said in one line, naming the extra to install
        print(f"hf-tpu plan: {exc}", file=sys.stderr)
        return EXIT_COULD_NOT_PLAN


def _run(args: argparse.Namespace) -> int:
    from hf_tpu.tpu_compile.plan import EXIT_USAGE, plan_generate, plan_pipeline, require_packages

    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    if not args.pipeline:  # a config.json that is not JSON: said in one line, before anything is lowered
        from pathlib import Path

        from hf_tpu.cli._model_path import check_config
        from hf_tpu.errors import UserError

        given = Path(args.model).expanduser()
        config = given / "config.json" if given.is_dir() else given
        if config.is_file():
            try:
                check_config(config, transformers_reads=False)  # (what transformers refuses: "could not plan")
            except UserError as exc:
                print(f"hf-tpu plan: {exc}", file=sys.stderr)
                return EXIT_USAGE
    if args.train:
        return _run_train(args, progress)
    require_packages(None if args.pipeline else args.quantization)  # before any progress line
    if args.pipeline:
        if min(args.height, args.width) < 1:
            print("hf-tpu plan: --height and --width must be positive", file=sys.stderr)
            return EXIT_USAGE
        if args.quantization:
            print("hf-tpu plan: --quantization plans generate only, not --pipeline", file=sys.stderr)
            return EXIT_USAGE
        progress(f"lowering {args.model}'s denoiser step through torch_tpu (deferred weights, no chip)")
        plan = plan_pipeline(
            args.model, args.target, height=args.height, width=args.width, batch=args.batch,
            guidance_scale=args.guidance_scale, dtype=args.dtype, progress=progress, dump_hlo=args.dump_hlo,
        )  # fmt: skip
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
        return plan.exit_status
    progress(f"lowering {args.model}'s generate programs through torch_tpu (deferred weights, no chip)")
    plan = plan_generate(
        args.model, args.target, batch=args.batch, max_prompt_len=args.max_prompt_len,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, quantization=args.quantization, buckets=args.buckets,
        progress=progress, dump_hlo=args.dump_hlo,
    )  # fmt: skip
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.table())
    return plan.exit_status


def _run_train(args: argparse.Namespace, progress) -> int:
    from hf_tpu.tpu_compile.plan import EXIT_COULD_NOT_PLAN, EXIT_DOES_NOT_FIT, EXIT_FITS, EXIT_USAGE, require_packages
    from hf_tpu.tpu_compile.train_plan import plan_train

    if args.pipeline or args.quantization:
        print(
            "hf-tpu plan: --train plans a causal LM's training step; drop --pipeline/--quantization", file=sys.stderr
        )
        return EXIT_USAGE
    if min(args.seq_len, args.layers or 1, args.shards or 1) < 1:
        print("hf-tpu plan: --seq-len, --layers and --shards must be positive", file=sys.stderr)
        return EXIT_USAGE
    require_packages()
    progress(f"tracing {args.model}'s training step on the meta device, lowering it through torch_tpu (no chip)")
    plan = plan_train(
        args.model, args.target, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype, layers=args.layers,
        shards=args.shards, compute_dtype=args.compute_dtype, progress=progress,
    )  # fmt: skip
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
    if plan.error is not None:
        return EXIT_COULD_NOT_PLAN
    return EXIT_DOES_NOT_FIT if plan.fits()["fsdp"] is False else EXIT_FITS
