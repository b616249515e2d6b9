"""The one-time notes hf_tpu gives (:func:`warn_once`): each reason is said once per process.

Shared by generation (``generate``'s fallbacks) and the encoders (a call that takes upstream's eager forward).
"""

from __future__ import annotations

import warnings

__all__ = ["WARNED", "warn_once"]

# The keys said so far (cleared by whoever needs every note again: the architecture sweep, tests).
WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn ``message`` unless a warning with ``key`` was given already in this process."""
    if key not in WARNED:
        WARNED.add(key)
        warnings.warn(message, stacklevel=4)
