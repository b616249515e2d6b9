"""Shape buckets of generation: :mod:`hf_tpu._shared.buckets`, the ladder generation and the encoders share.

This public name stays: ``hf_tpu.transformers.buckets.BucketLadder`` is what ``configure(model, buckets=...)``
takes.

Example:
    >>> from hf_tpu.transformers.buckets import BucketLadder
    >>> BucketLadder.powers_of_two(16, 64).rungs
    (16, 32, 64)
"""

from __future__ import annotations

from hf_tpu._shared.buckets import (
    DEFAULT_CACHE_MULTIPLE,
    DEFAULT_LINEAR_FROM,
    DEFAULT_MAX_LEN,
    DEFAULT_MIN_LEN,
    BucketLadder,
    BucketOverflowError,
    cache_length,
    default_ladder,
)

__all__ = [
    "DEFAULT_CACHE_MULTIPLE",
    "DEFAULT_LINEAR_FROM",
    "DEFAULT_MAX_LEN",
    "DEFAULT_MIN_LEN",
    "BucketLadder",
    "BucketOverflowError",
    "cache_length",
    "default_ladder",
]
