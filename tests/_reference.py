"""References computed without hf_tpu: a bug that hf_tpu shares between a test's two sides cannot cancel out.

``tests/`` is on ``sys.path`` (tests/conftest.py), so tests and the workers they launch import this directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def without_hf_tpu() -> Iterator[None]:
    """Every hf_tpu integration reverted for the block (upstream code exactly), the same ones enabled again after."""
    from hf_tpu import _patch

    names = [name for name in _patch.INTEGRATIONS if _patch.is_enabled(name)]
    _patch.disable()
    try:
        yield
    finally:
        if names:
            _patch.enable(*names)
