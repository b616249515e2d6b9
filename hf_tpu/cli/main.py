"""Entry point of ``hf-tpu``: parses the global flags and hands over to one subcommand module.

Each subcommand is a module ``hf_tpu.cli.<name>`` with two functions:

- ``register(subparsers)``: adds its parser with ``subparsers.add_parser(<name>, help=..., ...)``;
- ``run(args) -> int``: does the work and returns the exit status;
- optionally ``refuse_early(args) -> int | None``: a check run before the simulator is enabled (and torch
  imported), returning an exit status to stop with (having said why) or None to go on.

``--simulate``, ``--sim-generation`` and ``--sim-hbm`` are added to every command by this module (accepted before
or after the command name) and the simulator is enabled before ``run`` is called: commands do not define them.

A user mistake is printed as a few lines naming the problem and its fix, with no traceback: any
:class:`hf_tpu.errors.UserError` a command raises (hf_tpu's input errors all derive from it: a missing model
directory, bucket overflow, device-map fit, tensor-parallel plan, training refusals; exit status 2, or 1 for
:class:`hf_tpu.runtime.TPUNotAvailableError`), and a file error naming the path it could not open.
``--debug`` (any command) or ``HF_TPU_DEBUG=1`` re-raises them with the full traceback. Other exceptions are bugs
and keep their traceback.

The hf_tpu integrations a command enables (``hf_tpu.enable``) are reverted when it ends, so that :func:`main` called
in a process leaves it patched as it found it.

``COMMANDS`` lists them with a one-line summary. A command shows up only when its module exists, and only the
module of the command being run is imported, so ``hf-tpu --help`` stays fast (no torch import).

Example:
    >>> from hf_tpu.cli.main import main
    >>> main(["env", "--json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType

from hf_tpu import _env, _patch
from hf_tpu.errors import HfTpuTypeError, UserError

__all__ = ["COMMANDS", "DEBUG_ENV", "available_commands", "build_parser", "main"]

#: Environment variable that makes ``hf-tpu`` show full tracebacks for user errors (same as ``--debug``).
DEBUG_ENV = _env.DEBUG.name

_PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)

# name -> one-line summary shown by `hf-tpu --help`. Add a line here when you add hf_tpu/cli/<name>.py.
COMMANDS: dict[str, str] = {
    "env": "versions, TPU runtime mode, chips and HBM, known incompatibilities and their fixes",
    "generate": "generate text with a causal LM on the tpu device",
    "warmup": "compile a model's generation graphs into a persistent compile cache",
    "diffuse": "run a diffusers pipeline on the tpu device",
    "bench": "measure compiles, host<->device copies and step times",
    "serve": "serve a causal LM over an OpenAI-compatible HTTP API (continuous batching, /metrics)",
    "launch": "start one process per TPU chip (torchrun underneath)",
    "selftest": "check every hf_tpu capability on this host and write a report",
    "plan": "compile a model's generate for a TPU without one (libtpu): HBM fit, compile time, projected step",
}


def available_commands() -> dict[str, str]:
    """The entries of :data:`COMMANDS` whose module is present (found without importing it)."""
    return {name: summary for name, summary in COMMANDS.items() if importlib.util.find_spec(f"{__package__}.{name}")}


def _selected_command(argv: Sequence[str], commands: dict[str, str]) -> str | None:
    """The first argument that names a command (global flags before it take no value except the ones below)."""
    takes_value = {"--sim-generation", "--sim-hbm"}
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in takes_value:
            skip = True
            continue
        if arg.startswith("-"):
            continue
        return arg if arg in commands else None
    return None


def _add_simulate_flags(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    # On a subcommand the flags default to SUPPRESS so that they do not overwrite the top-level values.
    default = {} if top_level else {"default": argparse.SUPPRESS}
    if "--simulate" in parser._option_string_actions:  # the command defines them itself
        return
    group = parser.add_argument_group("simulated device")
    group.add_argument(
        "--simulate",
        action="store_true",
        help="run on the simulated tpu device (CPU memory); same as HF_TPU_SIMULATE=1",
        **({"default": False} if top_level else default),
    )
    group.add_argument(
        "--sim-generation",
        metavar="GEN",
        help="TPU generation the simulator presents: v4, v5e, v5p, v6e (default), v7",
        **({"default": None} if top_level else default),
    )
    group.add_argument(
        "--sim-hbm",
        metavar="GiB",
        type=float,
        help="HBM per simulated chip in GiB (default: the generation's)",
        **({"default": None} if top_level else default),
    )


def _add_debug_flag(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    if "--debug" in parser._option_string_actions:
        return
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"show the full traceback of an error (same as {DEBUG_ENV}=1)",
        default=False if top_level else argparse.SUPPRESS,
    )


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or _env.DEBUG.get()


def _is_user_error(err: BaseException) -> bool:
    """A mistake of the user's (printed without a traceback), not a bug: a :class:`UserError`, or a file error
    naming the path that could not be opened (the path the user gave, e.g. an output file)."""
    path_error = isinstance(err, _PATH_ERRORS) and getattr(err, "filename", None) is not None
    return path_error or isinstance(err, UserError)


def _print_user_error(command: str, err: BaseException) -> None:
    message = str(err).strip() or type(err).__name__
    print(f"hf-tpu {command}: {message}", file=sys.stderr)
    print(f"(for the full traceback: add --debug, or set {DEBUG_ENV}=1)", file=sys.stderr)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser; only the command named in ``argv`` (if any) has its module imported."""
    from hf_tpu import __version__

    parser = argparse.ArgumentParser(
        prog="hf-tpu",
        description="Run the Hugging Face stack on Google TPUs through TorchTPU, or on a simulated tpu device.",
    )
    parser.add_argument("--version", action="version", version=f"hf-tpu {__version__}")
    _add_simulate_flags(parser, top_level=True)
    _add_debug_flag(parser, top_level=True)
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    commands = available_commands()
    selected = _selected_command(argv, commands)
    for name, summary in commands.items():
        if name == selected:
            module = _load(name)
            module.register(subparsers)
            sub = subparsers.choices[name]
            _add_simulate_flags(sub, top_level=False)
            _add_debug_flag(sub, top_level=False)
            sub.set_defaults(_module=module)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


def _load(name: str) -> ModuleType:
    module = importlib.import_module(f"{__package__}.{name}")
    for attr in ("register", "run"):
        if not callable(getattr(module, attr, None)):
            raise HfTpuTypeError(
                f"hf_tpu.cli.{name} must define register(subparsers) and run(args); {attr} is missing"
            )
    return module


def _enable_simulator(args: argparse.Namespace) -> None:
    # torch_tpu must not initialise its device on a host without chips; keep it from autoloading when torch has
    # not been imported yet (the simulator then owns the `tpu` name).
    if "torch" not in sys.modules:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import hf_tpu.sim

    kwargs: dict = {}
    if args.sim_generation:
        kwargs["generation"] = args.sim_generation
    if args.sim_hbm:
        kwargs["hbm"] = int(args.sim_hbm * 1024**3)
    hf_tpu.sim.enable(**kwargs)


@contextlib.contextmanager
def _integrations_restored() -> Iterator[None]:
    """Revert the hf_tpu integrations a command enabled (``generate``, ``warmup`` and ``serve`` enable theirs) when it
    ends, so that :func:`main` called in a process leaves that process as it found it; those enabled before stay."""
    before = {name for name in _patch.INTEGRATIONS if _patch.is_enabled(name)}
    try:
        yield
    finally:
        added = [name for name in _patch.INTEGRATIONS if _patch.is_enabled(name) and name not in before]
        if added:  # (disable() with no names would revert every integration)
            _patch.disable(*reversed(added))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-tpu`` with ``argv`` (default: the process arguments) and return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given, for reports
    if args.command is None:
        parser.print_help()
        return 2
    early = getattr(args._module, "refuse_early", None)  # a check that needs neither torch nor the simulator
    refused = early(args) if early is not None else None
    if refused is not None:
        return int(refused)
    from hf_tpu.runtime import TPUNotAvailableError

    if args.simulate or args.sim_generation or args.sim_hbm:
        try:
            _enable_simulator(args)
        except (RuntimeError, ValueError) as err:  # real chips on this host, or an unknown generation
            print(f"hf-tpu {args.command}: cannot enable the simulated tpu device: {err}", file=sys.stderr)
            return 2
    try:
        with _integrations_restored():
            return int(args._module.run(args) or 0)
    except TPUNotAvailableError as err:
        if _debug(args):
            raise
        _print_user_error(args.command, err)
        return 1
    except BrokenPipeError:  # `hf-tpu env --json | head` (before `Exception`, which it is one of)
        # the reader is gone: what is left to flush at exit goes nowhere instead of raising again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as err:
        if _debug(args) or not _is_user_error(err):
            raise
        _print_user_error(args.command, err)
        return 2
    except KeyboardInterrupt:
        print(f"hf-tpu {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
