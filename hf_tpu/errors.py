"""Errors caused by what the user asked for (a path, a flag, a file), whose message says what to do.

``hf-tpu`` prints a :class:`UserError` as a few lines (the command, the message) instead of a traceback; ``--debug``
or ``HF_TPU_DEBUG=1`` shows the traceback. Library code raises it (or a subclass) where the fix is the caller's:
a missing model directory, a truncated checkpoint file. Subclasses also derive from the built-in type callers
already catch (``OSError`` for files), so raising them changes no ``except`` clause.

Importing this module imports nothing heavy.

Example:
    >>> from hf_tpu.errors import UserError
    >>> raise UserError("/no/such/dir is not a directory: pass a model saved with save_pretrained")
    Traceback (most recent call last):
    ...
    hf_tpu.errors.UserError: /no/such/dir is not a directory: pass a model saved with save_pretrained
"""

from __future__ import annotations

__all__ = ["CheckpointFileError", "UserError"]


class UserError(Exception):
    """A mistake in the input (a path, a flag, a file): the message names it and the fix."""


class CheckpointFileError(UserError, OSError):
    """A weights file that cannot be read (truncated, corrupt): the message names the file and how to fix it."""
