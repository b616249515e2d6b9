"""``hf-tpu launch [--simulate] [torchrun args] script.py [script args]``: one process per TPU chip.

Sets torch_tpu's launch environment (or its simulated counterpart) and runs torchrun in this process; every
torchrun argument, multi-node ones included, is accepted. See :mod:`hf_tpu.distributed.launch`.

Example:
    $ hf-tpu launch --simulate --nproc_per_node=2 examples/tp_generate.py
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers) -> argparse.ArgumentParser:
    from hf_tpu.distributed.launch import add_launch_arguments

    parser = subparsers.add_parser(
        "launch",
        help="start one process per TPU chip (torchrun underneath)",
        description="Start one process per TPU chip with torch_tpu's launch environment (torchrun underneath). "
        "Every torchrun argument is accepted; --simulate gives each rank its own simulated tpu:0.",
    )
    # hf_tpu.cli.main adds --simulate/--sim-generation/--sim-hbm to every subcommand.
    return add_launch_arguments(parser, simulate_flag=False)


def run(args: argparse.Namespace) -> int:
    from hf_tpu.distributed.launch import LaunchError, launch

    try:
        return launch(args)
    except LaunchError as err:
        print(f"hf-tpu launch: {err}", file=sys.stderr)
        return 2
