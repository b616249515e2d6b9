"""``python -m hf_tpu.benchmarks [--quick] [--figures PATH] NAME [OPTIONS]``: run one benchmark in this process.

``hf-tpu bench`` runs each benchmark this way, in a process of its own, so that one benchmark's compiled graphs,
seen eager shapes and enabled integrations never count in the next one's figures. ``--figures PATH`` writes
``{"options", "figures", "runtime"}`` as JSON (what ``hf-tpu bench --json`` collects).

Example:
    python -m hf_tpu.benchmarks --quick sim_forward
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["benchmark_parser", "main"]


def benchmark_parser(name: str, *, quick: bool = False, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of benchmark ``name``'s own options, with its ``QUICK`` defaults when ``quick``."""
    from hf_tpu.benchmarks._registry import BENCHMARKS, load

    module = load(name)
    parser = argparse.ArgumentParser(prog=prog or f"hf-tpu bench {name}", description=BENCHMARKS[name].summary)
    module.add_arguments(parser)
    if quick:
        parser.set_defaults(**module.QUICK)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark, print its table; returns 1 when it reports missed targets."""
    from hf_tpu.benchmarks._registry import BENCHMARKS, load

    argv = list(sys.argv[1:] if argv is None else argv)
    front = argparse.ArgumentParser(prog="python -m hf_tpu.benchmarks", add_help=False)
    front.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    front.add_argument("--figures", metavar="PATH", help="write the figures as JSON to PATH")
    front.add_argument("name", choices=list(BENCHMARKS))
    known, rest = front.parse_known_args(argv)
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    args = benchmark_parser(known.name, quick=known.quick).parse_args(rest)
    module = load(known.name)
    if getattr(module, "EXACT_FLOAT32", False):
        # its targets compare float32 outputs with the CPU's exactly (greedy tokens, logits): float32 products, as
        # on a chip; at 'medium' (a TPU's default and the simulator's) one bfloat16 pass flips near-ties. The
        # simulated device, installed later (hf_tpu.sim.enable() in the benchmark) or in the processes the benchmark
        # starts (the architecture sweeps' workers), starts from HF_TPU_SIM_MATMUL_PRECISION, not from torch's
        # setting of this process: without it they ran at 'medium' and reported near-tie flips as misses
        import torch

        os.environ["HF_TPU_SIM_MATMUL_PRECISION"] = "highest"
        torch.set_float32_matmul_precision("highest")
    figures = module.run(args)
    module.print_table(figures)
    if known.figures:
        from hf_tpu import runtime

        record = {"options": vars(args), "figures": figures, "runtime": runtime.detect().to_dict()}
        with open(known.figures, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 1 if figures.get("targets_met") is False else 0


if __name__ == "__main__":
    sys.exit(main())
