"""The one family of hf_tpu's exceptions: :class:`HfTpuError` is the base, :class:`UserError` the caller's mistakes.

Every exception class hf_tpu defines derives from :class:`HfTpuError` and keeps the built-in type callers already
catch (``ValueError``, ``RuntimeError``, ``OSError``...), so ``except HfTpuError`` catches everything hf_tpu raises
of its own and no existing ``except`` clause changes. The classes stay in the modules that raise them.

:class:`UserError` is the branch for errors caused by what the user asked for (a path, a flag, a file, an input
too long for the set-up), whose message says what to do. ``hf-tpu`` prints a :class:`UserError` as a few lines
(the command, the message) instead of a traceback; ``--debug`` or ``HF_TPU_DEBUG=1`` shows the traceback. Any
other exception reaching ``hf-tpu`` is a bug and keeps its traceback. Library code raises :class:`UserError` (or a
subclass) where the fix is the caller's: a missing model directory, a truncated checkpoint file.

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

__all__ = ["CheckpointFileError", "HfTpuError", "UserError"]


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
