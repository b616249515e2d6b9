"""The one family of hf_tpu's exceptions: :class:`HfTpuError` is the base, :class:`UserError` the caller's mistakes.

Every exception class hf_tpu defines derives from :class:`HfTpuError` and keeps the built-in type callers already
catch (``ValueError``, ``RuntimeError``, ``OSError``...), so ``except HfTpuError`` catches everything hf_tpu raises
of its own and no existing ``except`` clause changes. The classes stay in the modules that raise them.

:class:`UserError` is the branch for errors caused by what the user asked for (a path, a flag, a file, an input
too long for the set-up), whose message says what to do. ``hf-tpu`` prints a :class:`UserError` as a few lines
(the command, the message) instead of a traceback; ``--debug`` or ``HF_TPU_DEBUG=1`` shows the traceback. Any
other exception reaching ``hf-tpu`` is a bug and keeps its traceback. Library code raises :class:`UserError` (or a
subclass) where the fix is the caller's: a missing model directory, a truncated checkpoint file.

A module raises its own specific class where it has one; otherwise one of the generic classes here, each keeping
the built-in type the site raised before. The caller's mistakes: :class:`InvalidArgumentError` (``ValueError``: an
argument, a setting or an environment variable with a value hf_tpu cannot use), :class:`InvalidTypeError`
(``TypeError``), :class:`UnknownNameError` (``KeyError``: a name not among the known ones),
:class:`MissingFileError` (``FileNotFoundError``), :class:`UnsupportedArgumentError` (``NotImplementedError``) and
:class:`SetupError` (``RuntimeError``: a set-up of the caller's that cannot run as asked). Everything else:
:class:`HfTpuRuntimeError` (``RuntimeError``: a process hf_tpu started died, a server exited),
:class:`HfTpuValueError` and :class:`HfTpuTypeError` (a value or an object hf_tpu made itself, not the caller's: a
bug to report), :class:`UnsupportedError` (``NotImplementedError``: what hf_tpu cannot do yet) and
:class:`InternalError` (``AssertionError``: an invariant of hf_tpu's own broke). A module that lets a built-in
exception pass through on purpose (the simulator raises what torch_tpu raises) says which in its docstring;
``tests/test_errors.py`` keeps the list of those modules.

Importing this module imports nothing heavy.

Example:
    >>> from hf_tpu.errors import HfTpuError, UserError
    >>> from hf_tpu.transformers.buckets import BucketOverflowError
    >>> issubclass(BucketOverflowError, UserError) and issubclass(BucketOverflowError, ValueError)
    True
    >>> raise UserError("/no/such/dir is not a directory: pass a model saved with save_pretrained")
    Traceback (most recent call last):
    ...
    hf_tpu.errors.UserError: /no/such/dir is not a directory: pass a model saved with save_pretrained
"""

from __future__ import annotations

__all__ = [
    "CheckpointFileError",
    "HfTpuError",
    "HfTpuRuntimeError",
    "HfTpuTypeError",
    "HfTpuValueError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "MissingFileError",
    "SetupError",
    "UnknownNameError",
    "UnsupportedArgumentError",
    "UnsupportedError",
    "UserError",
]


class HfTpuError(Exception):
    """The base of every exception hf_tpu raises of its own: catch it to catch them all.

    A subclass also derives from the built-in type it always had (``ValueError``, ``RuntimeError``...).
    :class:`UserError` is the branch for a caller's mistakes, whose message names the fix; the other subclasses
    are runtime conditions (a graph that cannot compile, a strict-mode recompile) or hf_tpu's own signals.
    """


class UserError(HfTpuError):
    """A mistake in the input (a path, a flag, a file): the message names it and the fix."""


class CheckpointFileError(UserError, OSError):
    """A weights file that cannot be read (truncated, corrupt): the message names the file and how to fix it."""


class InvalidArgumentError(UserError, ValueError):
    """An argument, a setting or an environment variable whose value hf_tpu cannot use: the message says what to
    pass instead."""


class InvalidTypeError(UserError, TypeError):
    """An argument of a type hf_tpu cannot use, or a keyword it does not take."""


class UnknownNameError(UserError, KeyError):
    """A name that is not among the known ones (a benchmark, a self-test check): the message lists them.

    Its text is the message as written (a plain ``KeyError`` shows its argument quoted, as a key).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the caller named is not there, or lacks a file it needs."""


class UnsupportedError(HfTpuError, NotImplementedError):
    """Something hf_tpu cannot do (yet), whoever asked for it."""


class UnsupportedArgumentError(UserError, UnsupportedError):
    """An argument the caller passed that hf_tpu does not support on TPU: the message says what to pass instead."""


class SetupError(UserError, RuntimeError):
    """What the caller set up (a pipeline's offloading hooks, a process's environment) cannot run as asked: the
    message says what to change."""


class HfTpuRuntimeError(HfTpuError, RuntimeError):
    """A runtime condition that is not the caller's input: a process hf_tpu started died, a server exited, a
    check found the device misbehaving."""


class HfTpuValueError(HfTpuError, ValueError):
    """A value hf_tpu made or read itself (a graph key, HLO text, a file in its cache) that it cannot use."""


class HfTpuTypeError(HfTpuError, TypeError):
    """An object of the wrong type that hf_tpu made or registered itself, not the caller's argument."""


class InternalError(HfTpuError, AssertionError):
    """An invariant of hf_tpu's own broke: a bug to report."""
