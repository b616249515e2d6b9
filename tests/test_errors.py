"""One error family: every exception class hf_tpu defines derives from ``hf_tpu.errors.HfTpuError``, keeps its
built-in base, and a user's mistake derives from ``hf_tpu.errors.UserError``, which is what ``hf-tpu`` prints
without a traceback (anything else reaching it is a bug and keeps its traceback).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.errors import CheckpointFileError, HfTpuError, UserError

cli_main = importlib.import_module("hf_tpu.cli.main")  # hf_tpu.cli.main the module (the package exports main())
REPO = Path(__file__).resolve().parents[1]

# Imports every module under hf_tpu (in a process of its own: no module imported here for this changes what the
# other tests see) and lists the exception classes each defines. A module whose import needs a third-party package
# that is not installed (an optional extra) is listed as skipped; any other import error fails the test.
_SCAN = r"""
import importlib, json, pkgutil, sys
import hf_tpu
from hf_tpu.errors import HfTpuError, UserError

found, skipped, broken = [], {}, {}
walk_errors = []
for info in pkgutil.walk_packages(hf_tpu.__path__, "hf_tpu.", onerror=walk_errors.append):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue  # runs a command when imported as a module: defines no class
    try:
        module = importlib.import_module(info.name)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] == "hf_tpu":
            broken[info.name] = repr(exc)
        else:
            skipped[info.name] = repr(exc)
        continue
    for obj in list(vars(module).values()):
        if isinstance(obj, type) and obj.__module__ == info.name and issubclass(obj, BaseException):
            if issubclass(obj, Warning):
                continue
            found.append({
                "name": f"{info.name}.{obj.__qualname__}",
                "hf_tpu": issubclass(obj, HfTpuError),
                "user": issubclass(obj, UserError),
            })
for name in walk_errors:
    if name not in skipped:
        broken[name] = "walk_packages could not import the package"
print(json.dumps({"found": found, "skipped": skipped, "broken": broken}))
"""

_BUILTIN_EXCEPTIONS = {
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _scan() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCAN], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=SAFETY_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _module_path(name: str) -> Path:
    path = REPO.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _plain_exceptions_in_source(path: Path) -> list[str]:
    """Classes whose bases are built-in exceptions only (no hf_tpu error among them), read from the source: the
    check for a module that could not be imported here."""
    offenders = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.bases:
            names = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
            if all(name in _BUILTIN_EXCEPTIONS and not name.endswith("Warning") for name in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}({', '.join(names)})")
    return offenders


def test_every_exception_class_derives_from_hf_tpu_error():
    result = _scan()
    assert not result["broken"], result["broken"]  # an hf_tpu module that cannot import is a bug, not an extra
    found = result["found"]
    names = {entry["name"] for entry in found}
    # The scan sees them at all (a few from different packages, user errors and others).
    assert {
        "hf_tpu.errors.UserError",
        "hf_tpu.errors.CheckpointFileError",
        "hf_tpu.runtime.TPUNotAvailableError",
        "hf_tpu.transformers._settings.NotCompilableError",
    } <= names, sorted(names)
    assert len(found) >= 20, sorted(names)
    outside = sorted(entry["name"] for entry in found if not entry["hf_tpu"])
    assert outside == [], f"derive these from hf_tpu.errors.HfTpuError (or UserError): {outside}"
    unread = [line for name in result["skipped"] for line in _plain_exceptions_in_source(_module_path(name))]
    assert unread == [], f"derive these from hf_tpu.errors.HfTpuError (or UserError): {unread}"
    if result["skipped"]:
        warnings.warn(
            "not imported (an optional package is missing), their classes checked from the source only: "
            + ", ".join(f"{name} ({why})" for name, why in sorted(result["skipped"].items())),
            stacklevel=1,
        )


def _user_errors():
    from hf_tpu import runtime
    from hf_tpu._torch_tpu import LoweringUnavailableError, UnsupportedTopologyError
    from hf_tpu.device_map.preflight import DeviceMapFitError
    from hf_tpu.distributed.launch import LaunchError
    from hf_tpu.distributed.tp_plan import TensorParallelConfigError
    from hf_tpu.errors import (
        InvalidArgumentError,
        InvalidTypeError,
        MissingFileError,
        SetupError,
        UnknownNameError,
        UnsupportedArgumentError,
    )
    from hf_tpu.kernels.registry import KernelModuleError
    from hf_tpu.serving._guard import PromptTooLongError
    from hf_tpu.serving._openai import RequestError
    from hf_tpu.tpu_compile.targets import UnknownTargetError
    from hf_tpu.training.checks import TPUTrainingError
    from hf_tpu.transformers.buckets import BucketOverflowError

    return {
        BucketOverflowError: ValueError,
        CheckpointFileError: OSError,
        DeviceMapFitError: ValueError,
        InvalidArgumentError: ValueError,
        InvalidTypeError: TypeError,
        KernelModuleError: AttributeError,
        LaunchError: RuntimeError,
        LoweringUnavailableError: RuntimeError,
        MissingFileError: FileNotFoundError,
        PromptTooLongError: ValueError,
        RequestError: ValueError,
        SetupError: RuntimeError,
        TensorParallelConfigError: ValueError,
        TPUTrainingError: RuntimeError,
        runtime.TPUNotAvailableError: RuntimeError,
        UnknownNameError: KeyError,
        UnknownTargetError: ValueError,
        UnsupportedArgumentError: NotImplementedError,
        UnsupportedTopologyError: ValueError,
    }


def _other_errors():
    from hf_tpu.compile_cache import StaleGraphError
    from hf_tpu.errors import HfTpuRuntimeError, HfTpuTypeError, HfTpuValueError, InternalError, UnsupportedError
    from hf_tpu.selftest import CheckFailed
    from hf_tpu.sim import SimStrictError
    from hf_tpu.transformers._settings import NotCompilableError, RecompileError
    from hf_tpu.transformers._upstream import UpstreamSignatureError

    return {
        CheckFailed: AssertionError,
        HfTpuRuntimeError: RuntimeError,
        HfTpuTypeError: TypeError,
        HfTpuValueError: ValueError,
        InternalError: AssertionError,
        NotCompilableError: RuntimeError,
        RecompileError: RuntimeError,
        SimStrictError: RuntimeError,
        StaleGraphError: RuntimeError,
        UnsupportedError: NotImplementedError,
        UpstreamSignatureError: TypeError,
    }


def test_user_errors_are_user_errors_and_keep_their_builtin_base():
    for cls, builtin in _user_errors().items():
        assert issubclass(cls, UserError) and issubclass(cls, HfTpuError), cls
        assert issubclass(cls, builtin), (cls, builtin)  # existing `except ValueError:` clauses still catch it
    with pytest.raises(ValueError, match="past the largest bucket"):
        from hf_tpu.transformers.buckets import BucketLadder

        BucketLadder((16, 32)).bucket(100)
    from hf_tpu.errors import UnknownNameError

    # A KeyError's text is its argument quoted, as a key; an UnknownNameError's is the message as written (the CLI
    # prints it), and args[0] is the message for both.
    assert str(UnknownNameError("unknown check 'x'; known: a, b")) == "unknown check 'x'; known: a, b"
    assert UnknownNameError("unknown check").args[0] == "unknown check"


def test_runtime_conditions_are_not_user_errors():
    for cls, builtin in _other_errors().items():
        assert issubclass(cls, HfTpuError) and issubclass(cls, builtin), cls
        assert not issubclass(cls, UserError), cls


def test_errors_module_is_light():
    code = "import sys, hf_tpu.errors\nprint('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def _raising(exc: BaseException):
    class Fake:
        register = staticmethod(lambda subparsers: subparsers.add_parser("env"))

        @staticmethod
        def run(args: argparse.Namespace) -> int:
            raise exc

    return Fake


class _NewUserError(UserError, ValueError):
    """A user error the CLI has never heard of: its class alone makes it one."""


@pytest.mark.parametrize(
    "make",
    [
        lambda: _NewUserError("--flag 3: must be even; pass 2 or 4"),
        lambda: _user_errors_by_name()["BucketOverflowError"]("length 900 does not fit the ladder: pass --buckets"),
        lambda: _user_errors_by_name()["DeviceMapFitError"]("needs 40 GiB, tpu:0 has 32 GiB: pass device_map=auto"),
        lambda: _user_errors_by_name()["PromptTooLongError"]("the prompt is 900 tokens: shorten the prompt"),
        lambda: _user_errors_by_name()["LaunchError"]("--nproc_per_node=3: pass 1, 4 or 8"),
    ],
    ids=["new-subclass", "bucket-overflow", "device-map-fit", "prompt-too-long", "launch"],
)
def test_the_cli_prints_a_user_error_without_a_traceback(make, monkeypatch, capsys):
    err = make()
    monkeypatch.setattr(cli_main, "_load", lambda name: _raising(err))
    assert cli_main.main(["env"]) == 2
    out, stderr = capsys.readouterr()
    lines = stderr.strip().splitlines()
    assert out == "" and len(lines) == 2, stderr
    assert lines[0] == f"hf-tpu env: {err}" and "--debug" in lines[1]
    assert "Traceback" not in stderr


def _user_errors_by_name() -> dict[str, type]:
    return {cls.__name__: cls for cls in _user_errors()}


def test_the_cli_keeps_tpu_not_available_at_exit_status_1(monkeypatch, capsys):
    from hf_tpu.runtime import TPUNotAvailableError

    monkeypatch.setattr(cli_main, "_load", lambda name: _raising(TPUNotAvailableError("no TPU: pass --simulate")))
    assert cli_main.main(["env"]) == 1
    assert capsys.readouterr().err.startswith("hf-tpu env: no TPU: pass --simulate\n")


@pytest.mark.parametrize(
    "make",
    [
        lambda: _other_errors_by_name()["NotCompilableError"]("a branch on a tensor's value"),
        lambda: _other_errors_by_name()["RecompileError"]("a graph warm-up did not compile"),
        lambda: HfTpuError("an hf_tpu error that is not the user's"),
        lambda: ValueError("a bug, not a user mistake"),
    ],
    ids=["not-compilable", "recompile", "hf-tpu-error", "value-error"],
)
def test_the_cli_keeps_the_traceback_of_a_bug(make, monkeypatch):
    err = make()
    monkeypatch.setattr(cli_main, "_load", lambda name: _raising(err))
    with pytest.raises(type(err)) as caught:
        cli_main.main(["env"])
    assert caught.value is err


def _other_errors_by_name() -> dict[str, type]:
    return {cls.__name__: cls for cls in _other_errors()}


def test_the_cli_debug_flag_re_raises_a_user_error(monkeypatch):
    err = _NewUserError("--flag 3: must be even")
    monkeypatch.setattr(cli_main, "_load", lambda name: _raising(err))
    with pytest.raises(_NewUserError):
        cli_main.main(["env", "--debug"])


# Where hf_tpu raises a built-in exception class by name on purpose: a path under hf_tpu/ (a folder covers every
# module in it), the built-ins that pass through there, and why. The module's docstring (a folder's: its
# __init__.py's) names each of those built-ins too, so a reader of the module learns it. Anywhere else, hf_tpu
# raises an HfTpuError subclass (hf_tpu.errors has generic ones keeping each built-in base).
_GETATTR = "a module __getattr__ raises AttributeError: the protocol hasattr and getattr with a default rely on"
_EXIT = "a command line it cannot run ends the process with SystemExit and the message, as argparse does"
BUILTIN_RAISES_ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "__init__.py": (frozenset({"AttributeError"}), _GETATTR),
    "distributed/__init__.py": (frozenset({"AttributeError"}), _GETATTR),
    "ray/__init__.py": (frozenset({"AttributeError"}), _GETATTR),
    "runtime.py": (frozenset({"AttributeError"}), _GETATTR),
    "tpu_compile/__init__.py": (frozenset({"AttributeError"}), _GETATTR),
    "training/__init__.py": (frozenset({"AttributeError"}), _GETATTR),
    "benchmarks/arch_sweep.py": (frozenset({"SystemExit"}), _EXIT),
    "benchmarks/vlm_sweep.py": (
        frozenset({"SystemExit", "LookupError"}),
        _EXIT + "; its verdicts on a model's inputs are LookupErrors caught where they are raised, and the verdict "
        "rows (docs/architectures.md) name the type",
    ),
    "cli/generate.py": (frozenset({"SystemExit"}), _EXIT),
    "distributed/_bootstrap.py": (frozenset({"SystemExit"}), _EXIT),
    "serving/server.py": (
        frozenset({"KeyboardInterrupt"}),
        "a signal handler stops loading and warm-up with KeyboardInterrupt, as Python's SIGINT handler does",
    ),
    "sim/": (
        frozenset({"AttributeError", "ImportError", "NotImplementedError", "RuntimeError", "TypeError", "ValueError"}),
        "the simulator raises what torch_tpu's wheel raises, type for type, so code tested on it behaves the same on a "
        "TPU",
    ),
    "kernels/hub/ragged-dot-tpu/build/torch-tpu/ragged_dot_tpu/": (
        frozenset({"ImportError", "NotImplementedError", "RuntimeError", "ValueError"}),
        "a Hub kernel package of its own, loaded by `kernels`: it must not import hf_tpu",
    ),
    "kernels/hub/decode-attention-tpu/build/torch-tpu/decode_attention_tpu/": (
        frozenset({"ImportError", "NotImplementedError", "RuntimeError", "ValueError"}),
        "a Hub kernel package of its own, loaded by `kernels`: it must not import hf_tpu",
    ),
}


def builtin_raises(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``raise`` of a built-in exception class named as such (``raise ValueError(...)``,
    ``raise KeyboardInterrupt``); a bare ``raise`` and a raise of a caught exception or of any other class are not
    listed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id in _BUILTIN_EXCEPTIONS:
                found.append((node.lineno, target.id))
    return found


def _allowance(relative: str) -> tuple[str, frozenset[str], str] | None:
    """The allow-list entry covering ``relative`` (a path under hf_tpu/): its key, built-ins and reason."""
    for key, (names, reason) in BUILTIN_RAISES_ALLOWED.items():
        if relative == key or (key.endswith("/") and relative.startswith(key)):
            return key, names, reason
    return None


def unexplained_builtin_raises(relative: str, source: str, docstring: str | None) -> list[str]:
    """``relative:line Name`` for each raise of a built-in in a module at ``relative`` (under hf_tpu/) that its
    allow-list entry does not cover; with an entry, also each built-in it allows that ``docstring`` (the module's,
    or its folder's) does not name."""
    allowance = _allowance(relative)
    names = allowance[1] if allowance else frozenset()
    problems = [f"hf_tpu/{relative}:{line} {name}" for line, name in builtin_raises(source) if name not in names]
    if allowance:
        problems += [
            f"hf_tpu/{allowance[0]}: its docstring does not name {name}, which passes through ({allowance[2]})"
            for name in sorted(names)
            if name not in (docstring or "")
        ]
    return problems


def test_hf_tpu_raises_its_own_errors_or_says_which_builtins_pass():
    package = REPO / "hf_tpu"
    problems = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        allowance = _allowance(relative)
        home = path
        if allowance and allowance[0].endswith("/"):
            home = package / allowance[0] / "__init__.py"
        docstring = ast.get_docstring(ast.parse(home.read_text())) if home.is_file() else None
        problems += unexplained_builtin_raises(relative, path.read_text(), docstring)
    assert problems == [], (
        "raise an hf_tpu.errors class (a UserError subclass for the caller's mistakes) or the module's own, keeping "
        "the built-in base; or, where the built-in is right, add the module to BUILTIN_RAISES_ALLOWED with the "
        "reason and name the built-in in its docstring:\n" + "\n".join(problems)
    )
    for key, (names, reason) in BUILTIN_RAISES_ALLOWED.items():
        assert (package / key).exists(), f"BUILTIN_RAISES_ALLOWED names hf_tpu/{key}, which is not there"
        assert names and names <= _BUILTIN_EXCEPTIONS and reason, key


def test_the_raise_rule_catches_what_it_names(monkeypatch):
    source = """
def f(x):
    if x == 1:
        raise ValueError("bad")
    if x == 2:
        raise KeyboardInterrupt
    if x == 3:
        raise UserError("mine")
    try:
        g()
    except OSError as exc:
        raise RuntimeError("again") from exc
    except KeyError:
        raise
    except TypeError as exc:
        raise exc
"""
    assert builtin_raises(source) == [(4, "ValueError"), (6, "KeyboardInterrupt"), (12, "RuntimeError")]
    assert unexplained_builtin_raises("x.py", source, None) == [
        "hf_tpu/x.py:4 ValueError",
        "hf_tpu/x.py:6 KeyboardInterrupt",
        "hf_tpu/x.py:12 RuntimeError",
    ]
    allowed = {"x.py": (frozenset({"ValueError", "RuntimeError"}), "why"), "pkg/": (frozenset({"ValueError"}), "w")}
    monkeypatch.setattr(sys.modules[__name__], "BUILTIN_RAISES_ALLOWED", allowed)
    assert unexplained_builtin_raises("x.py", source, "Raises ValueError and RuntimeError.") == [
        "hf_tpu/x.py:6 KeyboardInterrupt"
    ]
    assert unexplained_builtin_raises("x.py", source, "Raises ValueError.") == [
        "hf_tpu/x.py:6 KeyboardInterrupt",
        "hf_tpu/x.py: its docstring does not name RuntimeError, which passes through (why)",
    ]
    assert unexplained_builtin_raises("pkg/deep/y.py", "raise ValueError('v')", "ValueError") == []
    assert unexplained_builtin_raises("pkgs/y.py", "raise ValueError('v')", "ValueError") == [
        "hf_tpu/pkgs/y.py:1 ValueError"
    ]
