"""``hf-tpu launch``: one process per TPU chip, with torch_tpu's launch environment, torchrun underneath.

torch_tpu runs one process per chip and needs a few environment variables decided once, in the parent, before
the workers start (``TORCH_TPU_SLICEBUILDER_ADDRESSES``, ``TORCH_TPU_TOPOLOGY``, ``TORCH_TPU_XPROF_SESSION_ID``,
and on several hosts ``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``). torchrun does not set them, so
this launcher does (real TPU: torch_tpu's own ``set_tpu_launch_env``; simulated: :func:`set_simulated_launch_env`,
which fills the same variables and gives every rank ``HF_TPU_SIMULATE=1``, i.e. its own simulated ``tpu:0``),
then runs torchrun in this process with every torchrun argument passed through.

On several hosts, the rendezvous values that the launch environment derives from ``TPU_WORKER_HOSTNAMES`` /
``JOB_COMPLETION_INDEX`` fill the torchrun flags the user did not give (``--nnodes``, ``--node_rank``,
``--master_addr``, ``--master_port``); flags given on the command line always win.

Example:
    $ hf-tpu launch --nproc_per_node=4 generate.py --prompt "Hello"
    $ python -m hf_tpu.launch --simulate --nproc_per_node=2 generate.py
    >>> from hf_tpu.distributed.launch import main
    >>> main(["--simulate", "--nproc_per_node=2", "script.py"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "BOOTSTRAP_MODULE",
    "LaunchError",
    "add_launch_arguments",
    "build_parser",
    "launch",
    "main",
    "set_real_launch_env",
    "set_simulated_launch_env",
    "simulated_topology",
]

BOOTSTRAP_MODULE = "hf_tpu.distributed._bootstrap"

# torchrun's defaults for the flags the multi-host launch environment may fill (torch 2.11-2.15).
_TORCHRUN_DEFAULTS = {"node_rank": 0, "master_addr": "127.0.0.1", "master_port": None}
_DEFAULT_NNODES = ("1", "1:1")

# Chip count -> "x,y,z" mesh, as torch_tpu reports it for one v6e host; other counts are laid out as 1,n,1.
_SIM_TOPOLOGY = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


class LaunchError(RuntimeError):
    """The launch cannot start: what was asked, what was found, and what to do."""


def simulated_topology(nproc: int) -> str:
    """The ``TORCH_TPU_TOPOLOGY`` string a host with ``nproc`` chips would report (``"2,2,1"`` for 4)."""
    return _SIM_TOPOLOGY.get(nproc, f"1,{nproc},1")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_hostnames(env: os._Environ | dict) -> list[str]:
    return [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]


def set_simulated_launch_env(
    *, nnodes: int | None = None, nproc_per_node: int | None = None, env: dict | None = None
) -> dict[str, str]:
    """The simulated counterpart of torch_tpu's ``set_tpu_launch_env``: same variables, same rules.

    Never overwrites a variable that is already set (so an operator can pin any of them). Multi-host is detected
    as torch_tpu does: ``nnodes > 1``, two or more ``TPU_WORKER_HOSTNAMES``, or ``JOB_COMPLETION_INDEX`` set.
    Every rank also gets ``HF_TPU_SIMULATE=1`` and ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch_tpu must not
    initialise a device on a host without chips). Returns the variables this call set.

    Example:
        >>> env = {}
        >>> set_simulated_launch_env(nproc_per_node=4, env=env)["TORCH_TPU_TOPOLOGY"]
        '2,2,1'
    """
    env = os.environ if env is None else env
    before = dict(env)

    def once(name: str, value) -> None:
        if name not in env:
            env[name] = str(value() if callable(value) else value)

    once("HF_TPU_SIMULATE", "1")
    once("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    once("TORCH_TPU_XPROF_SESSION_ID", lambda: str(time.time_ns()))
    hosts = _worker_hostnames(env)
    if nnodes is not None and hosts and nnodes != len(hosts):
        raise LaunchError(
            f"--nnodes={nnodes} was asked, but TPU_WORKER_HOSTNAMES lists {len(hosts)} host(s) "
            f"({env['TPU_WORKER_HOSTNAMES']!r}); pass --nnodes={len(hosts)} or fix TPU_WORKER_HOSTNAMES."
        )
    completion_index = env.get("JOB_COMPLETION_INDEX")
    multihost = (nnodes is not None and nnodes > 1) or len(hosts) > 1 or completion_index is not None
    count = nproc_per_node or 1
    if multihost:
        if not hosts:
            raise LaunchError(
                "a multi-host launch was asked (--nnodes > 1 or JOB_COMPLETION_INDEX set), but "
                "TPU_WORKER_HOSTNAMES is unset; set it to the comma-separated worker hostnames, the first being "
                "the rendezvous host (e.g. TPU_WORKER_HOSTNAMES=host0,host1)."
            )
        base_port = int(env.get("TORCH_TPU_BASE_PORT", "8070"))
        per_host = int(env.get("TORCH_TPU_DEVICES_PER_HOST", count))
        once(
            "TORCH_TPU_SLICEBUILDER_ADDRESSES",
            ",".join(f"{h}:{base_port + i}" for h in hosts for i in range(per_host)),
        )
        once("NNODES", nnodes if nnodes is not None else len(hosts))
        if "NODE_RANK" not in env:
            if completion_index is None:
                raise LaunchError(
                    "a multi-host launch needs this host's rank: pass --node_rank, or set NODE_RANK or "
                    "JOB_COMPLETION_INDEX (Kubernetes Indexed Jobs set it)."
                )
            env["NODE_RANK"] = str(int(completion_index))
        once("MASTER_ADDR", hosts[0])
        once("MASTER_PORT", "29500")
        once("TORCH_TPU_TOPOLOGY", simulated_topology(count))
    else:
        once("TORCH_TPU_SLICEBUILDER_ADDRESSES", lambda: ",".join(f"localhost:{_free_port()}" for _ in range(count)))
        once("TORCH_TPU_TOPOLOGY", simulated_topology(count))
    return {k: v for k, v in env.items() if before.get(k) != v}


def set_real_launch_env(*, nnodes: int | None = None, nproc_per_node: int | None = None) -> dict[str, str]:
    """Call torch_tpu's own ``set_tpu_launch_env`` (imported only here); returns the variables it set."""
    before = dict(os.environ)
    try:
        from torch_tpu._internal.distributed.distributed import set_tpu_launch_env
    except ImportError as err:  # pragma: no cover - needs torch-tpu
        raise LaunchError(
            f"a real TPU launch needs torch-tpu's launch environment, but it cannot be imported ({err}); install "
            "it with `pip install 'hf-tpu[tpu]'`, or pass --simulate to run on the simulated device."
        ) from err
    try:
        set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)
    except ValueError as err:
        raise LaunchError(f"torch_tpu could not set the TPU launch environment: {err}") from err
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def add_launch_arguments(parser: argparse.ArgumentParser, *, simulate_flag: bool = True) -> argparse.ArgumentParser:
    """Add torchrun's arguments (all of them, multi-node included) and, unless the caller adds its own,
    ``--simulate`` to ``parser``."""
    from torch.distributed.run import get_args_parser

    for action in get_args_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        parser._add_action(action)
    if simulate_flag and not any("--simulate" in a.option_strings for a in parser._actions):
        parser.add_argument(
            "--simulate",
            action="store_true",
            default=False,
            help="run every rank on its own simulated tpu:0 (CPU memory); same as HF_TPU_SIMULATE=1",
        )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """``python -m hf_tpu.launch`` parser: torchrun's arguments plus ``--simulate``."""
    parser = argparse.ArgumentParser(
        prog="hf-tpu launch",
        description="Start one process per TPU chip with torch_tpu's launch environment (torchrun underneath). "
        "Every torchrun argument is accepted.",
    )
    return add_launch_arguments(parser)


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _resolve_nproc(args: argparse.Namespace, simulate: bool) -> None:
    """``--nproc_per_node=tpu`` (or ``auto`` on a TPU host) means one process per local TPU device."""
    if args.nproc_per_node not in ("tpu", "auto"):
        return
    if simulate:
        if args.nproc_per_node == "tpu":
            raise LaunchError(
                "--nproc_per_node=tpu counts the chips of this host, but the launch is simulated and there are "
                "none; pass a number, e.g. --nproc_per_node=4."
            )
        return
    from hf_tpu.runtime import GENERATIONS, scan_pci_chips

    chips, generation = scan_pci_chips()
    if chips:
        per_chip = int(GENERATIONS[generation]["devices_per_chip"]) if generation else 1
        args.nproc_per_node = str(chips * per_chip)
    elif args.nproc_per_node == "tpu":
        raise LaunchError("--nproc_per_node=tpu was asked, but this host has no TPU chips; pass a number.")


def _fill_multihost_flags(args: argparse.Namespace) -> None:
    """Fill the torchrun rendezvous flags left at their defaults from the launch environment."""
    if "NNODES" in os.environ and args.nnodes in _DEFAULT_NNODES:
        args.nnodes = os.environ["NNODES"]
    if "NODE_RANK" in os.environ and args.node_rank == _TORCHRUN_DEFAULTS["node_rank"]:
        args.node_rank = int(os.environ["NODE_RANK"])
    if "MASTER_ADDR" in os.environ and args.master_addr == _TORCHRUN_DEFAULTS["master_addr"]:
        args.master_addr = os.environ["MASTER_ADDR"]
    if "MASTER_PORT" in os.environ and args.master_port is None:
        args.master_port = int(os.environ["MASTER_PORT"])


def _wrap_entrypoint(args: argparse.Namespace) -> None:
    """Run the user's script through the bootstrap (imports hf_tpu, so each rank gets its simulated device)."""
    if args.no_python or getattr(args, "run_path", False):
        return
    kind = "--module" if args.module else "--script"
    args.training_script_args = [kind, args.training_script, *args.training_script_args]
    args.training_script = BOOTSTRAP_MODULE
    args.module = True
    # The workers must import the same hf_tpu as this process.
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def _is_simulated(args: argparse.Namespace) -> bool:
    if getattr(args, "simulate", False):
        return True
    if os.environ.get("HF_TPU_SIMULATE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    from hf_tpu import runtime

    return runtime.detect().mode == "simulated"


_SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(failures: dict) -> tuple[int, object]:
    """The failure that started it: earliest first; at the same second, a rank's own error before the errors
    other ranks got because it went away (a closed gloo connection, a signal from the launcher)."""

    def key(item):
        rank, failure = item
        text = failure.message if isinstance(failure.message, str) else str(failure.message)
        secondary = failure.exitcode < 0 or any(s in text for s in _SECONDARY_ERRORS)
        return (failure.timestamp, secondary, rank)

    return min(failures.items(), key=key)


def launch(args: argparse.Namespace) -> int:
    """Set the launch environment for ``args`` (a parsed torchrun namespace) and run torchrun; the exit status.

    A rank that fails makes torchrun stop the others; this returns that rank's exit code (non-zero) after
    printing which rank failed and its error.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_min_max_nnodes, run

    if not args.training_script:
        raise LaunchError(
            "no script to launch: pass it after the launcher flags, e.g. hf-tpu launch --nproc_per_node=2 run.py"
        )
    simulate = _is_simulated(args)
    if simulate:
        from hf_tpu.runtime import scan_pci_chips

        chips, generation = scan_pci_chips()
        if chips:
            raise LaunchError(
                f"a simulated launch was asked, but this host has {chips} real TPU chip(s) ({generation}); drop "
                "--simulate / HF_TPU_SIMULATE to run on them."
            )
    _resolve_nproc(args, simulate)
    nnodes = None
    if args.nnodes not in _DEFAULT_NNODES:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
        nnodes = max_nodes if min_nodes == max_nodes else None
    nproc = _int_or_none(args.nproc_per_node)
    if simulate:
        set_simulated_launch_env(nnodes=nnodes, nproc_per_node=nproc)
        from hf_tpu import runtime

        info = runtime.detect()
        if info.mode == "simulated":  # this process chose a generation / HBM (hf-tpu --sim-generation ...)
            os.environ.setdefault("HF_TPU_SIM_GENERATION", str(info.generation))
            os.environ.setdefault("HF_TPU_SIM_HBM", str(info.hbm_bytes))
    else:
        from hf_tpu import runtime

        info = runtime.detect()
        if info.mode != "real":
            raise LaunchError(
                f"hf-tpu launch starts one process per TPU chip, but this host has none ({info.reason}); "
                f"{runtime.INSTALL_HINT}."
            )
        set_real_launch_env(nnodes=nnodes, nproc_per_node=nproc)
    _fill_multihost_flags(args)
    _wrap_entrypoint(args)
    try:
        run(args)
    except SignalException as err:  # Ctrl-C or SIGTERM to the launcher: torchrun has stopped the ranks
        print(f"hf-tpu launch: stopped by {err.sigval.name}; the ranks were stopped too.", file=sys.stderr)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = _root_cause(err.failures)
        detail = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        if isinstance(failure.message, dict):
            trace = failure.message.get("extraInfo", {}).get("py_callstack")
            detail = trace or detail
        print(
            f"hf-tpu launch: rank {rank} failed with exit code {failure.exitcode}"
            + (f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
            + f"; the other ranks were stopped.\n{detail}",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hf_tpu.launch [--simulate] [torchrun args] script.py [script args]``; the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return launch(args)
    except LaunchError as err:
        print(f"hf-tpu launch: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
