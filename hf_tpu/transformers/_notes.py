"""Generation's one-time notes: :mod:`hf_tpu._shared.notes` (one set of keys said, shared with the encoders)."""

from __future__ import annotations

from hf_tpu._shared.notes import WARNED, warn_once

__all__ = ["WARNED", "warn_once"]
