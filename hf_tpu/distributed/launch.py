"""``hf-tpu launch``: one process per TPU chip, with torch_tpu's launch environment, torchrun underneath.

torch_tpu runs one process per chip and needs a few environment variables decided once, in the parent, before
the workers start (``TORCH_TPU_SLICEBUILDER_ADDRESSES``, ``TORCH_TPU_TOPOLOGY``, ``TORCH_TPU_XPROF_SESSION_ID``,
and on several hosts ``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``). torchrun does not set them, so
this launcher does (real TPU: torch_tpu's own ``set_tpu_launch_env``; simulated: :func:`set_simulated_launch_env`,
which fills the same variables and gives every rank ``HF_TPU_SIMULATE=1``, i.e. its own simulated ``tpu:0``),
then runs torchrun in this process with every torchrun argument passed through.

Before any rank starts, the launcher refuses what torch_tpu would refuse: a process count that is not a mesh of
this host's TPU generation (torch_tpu's topology tables, read through :mod:`hf_tpu._torch_tpu`: v5e and v6e take
1, 4 or 8 devices per host, v4 and v5p 1, 2, 4 or 8, v7 2, 4 or 8), on chips and on the simulator alike, and a
script that does not exist.

On several hosts, torchrun's rendezvous flags given on the command line (``--node_rank``/``--node-rank``,
``--master_addr``, ``--master_port``) are put into the launch environment first (``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), as an operator would pin them, so torch_tpu's ``set_tpu_launch_env`` keeps them; the values it
derives from ``TPU_WORKER_HOSTNAMES`` / ``JOB_COMPLETION_INDEX`` fill the flags the user did not give.

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
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from hf_tpu import _env
from hf_tpu._launch_env import (  # the simulated launch environment, shared with the simulator (hf_tpu.sim)
    SIM_DEFAULT_GENERATION,
    LaunchError,
    free_port,  # noqa: F401  (hf_tpu.serving.tensor_parallel picks the rendezvous port with it)
    is_multihost,
    set_simulated_launch_env,
    simulated_topology,
)
from hf_tpu.errors import InternalError

__all__ = [
    "BOOTSTRAP_MODULE",
    "LaunchError",
    "add_launch_arguments",
    "build_parser",
    "check_process_count",
    "launch",
    "main",
    "set_real_launch_env",
    "set_simulated_launch_env",
    "simulated_topology",
]

BOOTSTRAP_MODULE = "hf_tpu.distributed._bootstrap"

# torchrun's defaults for the flags the multi-host launch environment may fill (torch 2.11-2.15). The parser
# leaves them None, so that a flag given on the command line (even --node_rank=0) can be told from the default.
_TORCHRUN_DEFAULTS = {"node_rank": 0, "master_addr": "127.0.0.1", "master_port": None}
_DEFAULT_NNODES = ("1", "1:1")

# The simulator's generation when none is asked for; for a process count v6e has no mesh for, the first of the
# others that has one (2 processes: v5p), said on stderr.
_SIM_FALLBACK_ORDER = ("v5p", "v5e", "v4", "v7")


def set_real_launch_env(*, nnodes: int | None = None, nproc_per_node: int | None = None) -> dict[str, str]:
    """Call torch_tpu's own ``set_tpu_launch_env`` (through :mod:`hf_tpu._torch_tpu`); returns what it set.

    torch_tpu raises ValueError for a launch it cannot lay out (hosts, node rank) and RuntimeError for a device
    count it has no mesh for; both become a :class:`LaunchError` (the launcher checks the count first, see
    :func:`check_process_count`, so the second names the counts that work).

    Args:
        nnodes: the number of hosts; None: as torch_tpu decides from the environment.
        nproc_per_node: processes per host; None: one per device.

    Returns:
        The environment variables the call set, with their values.

    Raises:
        LaunchError: torch-tpu cannot be imported, or it refuses the launch (the message says why).
    """
    from hf_tpu import _torch_tpu

    before = dict(os.environ)
    try:
        _torch_tpu.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)
    except ImportError as err:  # pragma: no cover - needs torch-tpu
        raise LaunchError(
            f"a real TPU launch needs torch-tpu's launch environment, but it cannot be imported ({err}); install "
            "it with `pip install 'hf-tpu[tpu]'`, or pass --simulate to run on the simulated device."
        ) from err
    except (ValueError, RuntimeError) as err:
        raise LaunchError(f"torch_tpu could not set the TPU launch environment: {err}") from err
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def check_process_count(generation: str | None, nproc: int | None, host_devices: int, *, multihost: bool) -> None:
    """Refuse, before any rank starts, a launch torch_tpu cannot lay out on ``generation``.

    ``nproc`` is the processes asked per host (None: one per device), ``host_devices`` the TPU devices torch_tpu
    counts on this host. torch_tpu looks up, single-host, ``nproc`` (or the device count) in its topology table
    and, multi-host, the host's device count; on multi-host hf_tpu also refuses an ``nproc`` with no mesh.

    Args:
        generation: the host's TPU generation; None (unknown) checks nothing.
        nproc: processes asked per host; None: one per device.
        host_devices: the TPU devices torch_tpu counts on this host.
        multihost: whether the launch spans several hosts.

    Raises:
        LaunchError: torch_tpu has no mesh for the count (from :func:`simulated_topology`; it names the counts
            that work).
    """
    if generation is None:
        return
    counts = {host_devices if nproc is None else nproc}
    if multihost:
        counts.add(host_devices)
    for count in sorted(counts):
        simulated_topology(count, generation)


def add_launch_arguments(parser: argparse.ArgumentParser, *, simulate_flag: bool = True) -> argparse.ArgumentParser:
    """Add torchrun's arguments (all of them, multi-node included) and, unless the caller adds its own,
    ``--simulate`` to ``parser``.

    Args:
        parser: the parser to extend (``hf-tpu launch``'s, or a command that launches, such as ``hf-tpu serve``).
        simulate_flag: also add ``--simulate`` when the parser has none; True by default.

    Returns:
        ``parser``.
    """
    from torch.distributed.run import get_args_parser

    for action in get_args_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.dest in _TORCHRUN_DEFAULTS:  # None until resolved: tells a given flag from torchrun's default
            action.default = None
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
    """``python -m hf_tpu.launch`` parser: torchrun's arguments plus ``--simulate``.

    Returns:
        A new ``argparse.ArgumentParser``.
    """
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
    from hf_tpu.runtime import scan_pci

    devices = scan_pci().vfio  # torch_tpu's count: every VFIO-exposed TPU function (v7: two per chip)
    if devices:
        args.nproc_per_node = str(devices)
    elif args.nproc_per_node == "tpu":
        raise LaunchError("--nproc_per_node=tpu was asked, but this host has no TPU chips; pass a number.")


def _pin_rendezvous_flags(args: argparse.Namespace, nnodes: int | None) -> None:
    """On several hosts, put the rendezvous flags given on the command line into the launch environment (they
    win over values already there), so that the launch environment (torch_tpu's or the simulator's) keeps them."""
    if not is_multihost(nnodes, os.environ):
        return
    for dest, name in (("node_rank", "NODE_RANK"), ("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
        value = getattr(args, dest, None)
        if value is not None:
            os.environ[name] = str(value)


def _fill_multihost_flags(args: argparse.Namespace) -> None:
    """Fill the torchrun rendezvous flags not given on the command line from the launch environment, then
    torchrun's defaults."""
    if "NNODES" in os.environ and args.nnodes in _DEFAULT_NNODES:
        args.nnodes = os.environ["NNODES"]
    if "NODE_RANK" in os.environ and args.node_rank is None:
        args.node_rank = int(os.environ["NODE_RANK"])
    if "MASTER_ADDR" in os.environ and args.master_addr is None:
        args.master_addr = os.environ["MASTER_ADDR"]
    if "MASTER_PORT" in os.environ and args.master_port is None:
        args.master_port = int(os.environ["MASTER_PORT"])
    for dest, default in _TORCHRUN_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)


def _check_entrypoint(args: argparse.Namespace) -> None:
    """A script that is not there fails here, once, instead of in every rank."""
    if args.module:
        return
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None:
            raise LaunchError(f"--no-python was given, but {script!r} is not an executable on PATH or a file.")
        return
    path = Path(script)
    if not path.is_file():
        where = f" (relative to {Path.cwd()})" if not path.is_absolute() else ""
        what = "is a directory, not a script" if path.is_dir() else "does not exist"
        raise LaunchError(
            f"the script {script}{where} {what}; no rank was started. Check the path, or pass -m for a module."
        )


def _sim_generation(args: argparse.Namespace, nproc: int | None) -> str:
    """The generation the ranks simulate: the one asked for (--sim-generation, HF_TPU_SIM_GENERATION, the
    launcher's own simulator), refused if torch_tpu has no mesh for ``nproc`` on it; otherwise v6e, or for a count
    v6e has none for, the first generation that has one (said on stderr)."""
    from hf_tpu import _torch_tpu, runtime

    asked = getattr(args, "sim_generation", None) or _env.SIM_GENERATION.get()
    if not asked:
        info = runtime.detect()
        if info.mode == "simulated" and info.generation != SIM_DEFAULT_GENERATION:
            asked = info.generation
    known = _torch_tpu.generations()
    count = nproc or 1
    if asked:
        if asked not in known:
            raise LaunchError(f"unknown TPU generation {asked!r} to simulate; known: {', '.join(known)}.")
        try:
            simulated_topology(count, asked)
        except LaunchError as err:
            others = [g for g in (SIM_DEFAULT_GENERATION, *_SIM_FALLBACK_ORDER) if count in known[g].topologies]
            hint = f" Or simulate a generation that has {count}: --sim-generation={others[0]}." if others else ""
            raise LaunchError(f"{err}{hint}") from None
        return asked
    for generation in (SIM_DEFAULT_GENERATION, *_SIM_FALLBACK_ORDER):
        if generation in known and count in known[generation].topologies:
            if generation != SIM_DEFAULT_GENERATION:
                print(
                    f"hf-tpu launch: simulating {known[generation].name}: {count} devices per host is not a "
                    f"{SIM_DEFAULT_GENERATION} layout (torch_tpu runs {SIM_DEFAULT_GENERATION} with "
                    f"{', '.join(map(str, _torch_tpu.valid_counts(SIM_DEFAULT_GENERATION)))}); pass "
                    "--sim-generation to choose another.",
                    file=sys.stderr,
                )
            return generation
    simulated_topology(count, SIM_DEFAULT_GENERATION)  # raises, naming the counts of every generation
    raise InternalError("unreachable")


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
    if _env.SIMULATE.get():
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

    Args:
        args: the namespace :func:`build_parser` parsed (torchrun's fields plus ``simulate``).

    Returns:
        0 when every rank succeeded, the failed rank's exit code (1 for one killed by a signal), or ``128 + signal``
        when the launcher itself was stopped.

    Raises:
        LaunchError: no script given, ``--simulate`` on a host with TPU chips, no TPU for a real launch, or a
            process count or multi-host setup torch_tpu cannot lay out.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_min_max_nnodes, run

    if not args.training_script:
        raise LaunchError(
            "no script to launch: pass it after the launcher flags, e.g. hf-tpu launch --nproc_per_node=2 run.py"
        )
    _check_entrypoint(args)
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
    from hf_tpu import runtime

    if simulate:
        generation = _sim_generation(args, nproc)
        _pin_rendezvous_flags(args, nnodes)
        set_simulated_launch_env(nnodes=nnodes, nproc_per_node=nproc, generation=generation)
        os.environ[_env.SIM_GENERATION.name] = generation
        info = runtime.detect()
        preset = runtime.GENERATIONS[str(info.generation)] if info.mode == "simulated" else None
        if preset and info.hbm_bytes != int(preset["hbm_per_chip"]) // int(preset["devices_per_chip"]):
            os.environ.setdefault(_env.SIM_HBM.name, str(info.hbm_bytes))  # this process was given an HBM size
    else:
        info = runtime.detect()
        if info.mode != "real":
            raise LaunchError(
                f"hf-tpu launch starts one process per TPU chip, but this host has none ({info.reason}); "
                f"{runtime.INSTALL_HINT}."
            )
        check_process_count(info.generation, nproc, info.chips_on_host, multihost=is_multihost(nnodes, os.environ))
        _pin_rendezvous_flags(args, nnodes)
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
    """``python -m hf_tpu.launch [--simulate] [torchrun args] script.py [script args]``; the exit status.

    Args:
        argv: the command line after the program name; None (the default) reads ``sys.argv[1:]``.

    Returns:
        torchrun's exit status (a failed rank's exit code, after naming the rank and its error), or 2 when the
        launch itself is refused (the reason is printed to stderr). A malformed command line exits through
        argparse (status 2).
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return launch(args)
    except LaunchError as err:
        print(f"hf-tpu launch: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
