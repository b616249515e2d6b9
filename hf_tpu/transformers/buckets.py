"""Shape buckets: round prompt and cache lengths up to a short ladder so that a TPU compiles a bounded set of graphs.

On a TPU every new input shape is a new XLA program. Generation has two lengths that vary from call to call: the
prompt length (the prefill graph) and the KV-cache length (every decode graph). Rounding both up to the rungs of a
ladder (powers of two from 16 by default) bounds the number of graphs by the number of rungs touched, at the price
of some padding (masked out, so results do not change).

Example:
    >>> from hf_tpu.transformers.buckets import BucketLadder
    >>> ladder = BucketLadder.powers_of_two(16, 512)
    >>> ladder.rungs
    (16, 32, 64, 128, 256, 512)
    >>> ladder.bucket(17)
    32
    >>> ladder.up_to(100)
    (16, 32, 64, 128)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_LEN", "DEFAULT_MIN_LEN", "BucketLadder", "BucketOverflowError", "default_ladder"]

DEFAULT_MIN_LEN = 16
# Upper end of the default ladder when the model config does not say how long a sequence may be.
DEFAULT_MAX_LEN = 4096


class BucketOverflowError(ValueError):
    """A length does not fit the largest rung of the bucket ladder."""


@dataclass(frozen=True)
class BucketLadder:
    """Sorted, distinct lengths; :meth:`bucket` rounds a length up to the first rung that holds it."""

    rungs: tuple[int, ...]

    def __post_init__(self) -> None:
        rungs = tuple(sorted({int(r) for r in self.rungs}))
        if not rungs or rungs[0] < 1:
            raise ValueError(f"a bucket ladder needs at least one positive length, got {self.rungs!r}")
        object.__setattr__(self, "rungs", rungs)

    @classmethod
    def powers_of_two(cls, start: int = DEFAULT_MIN_LEN, stop: int = DEFAULT_MAX_LEN) -> BucketLadder:
        """``start, 2*start, 4*start, ...`` up to ``stop``; ``stop`` itself is the last rung even if not a power.

        Example:
            >>> BucketLadder.powers_of_two(16, 100).rungs
            (16, 32, 64, 100)
        """
        if start < 1 or stop < start:
            raise ValueError(f"powers_of_two needs 1 <= start <= stop, got start={start}, stop={stop}")
        rungs, n = [], start
        while n < stop:
            rungs.append(n)
            n *= 2
        rungs.append(stop)
        return cls(tuple(rungs))

    @classmethod
    def coerce(cls, value: BucketLadder | Iterable[int]) -> BucketLadder:
        """A ladder from a ladder or from any iterable of lengths."""
        return value if isinstance(value, BucketLadder) else cls(tuple(value))

    @property
    def max(self) -> int:
        return self.rungs[-1]

    def bucket(self, length: int, what: str = "length", hint: str = "") -> int:
        """The smallest rung ``>= length``; :class:`BucketOverflowError` naming ``what`` when none is."""
        i = bisect.bisect_left(self.rungs, length)
        if i == len(self.rungs):
            fix = hint or "raise the largest bucket (hf_tpu.transformers.configure(model, buckets=[...]))"
            raise BucketOverflowError(
                f"{what} is {length} tokens, past the largest bucket ({self.max}, ladder {list(self.rungs)}): {fix}."
            )
        return self.rungs[i]

    def up_to(self, length: int) -> tuple[int, ...]:
        """The rungs a length in ``[1, length]`` can land on (the bucket of ``length`` included)."""
        return self.rungs[: self.rungs.index(self.bucket(length)) + 1]

    def at_least(self, length: int) -> tuple[int, ...]:
        """The rungs ``>= length``."""
        return self.rungs[bisect.bisect_left(self.rungs, length) :]


def default_ladder(config=None, start: int = DEFAULT_MIN_LEN) -> BucketLadder:
    """Powers of two from ``start`` up to the model's longest sequence (``max_position_embeddings``/``n_positions``)
    or :data:`DEFAULT_MAX_LEN` when the config has no limit (T5's relative positions, for example)."""
    limit = None
    if config is not None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(text, name, None)
            if isinstance(value, int) and value > 0:
                limit = value
                break
    stop = limit or DEFAULT_MAX_LEN
    return BucketLadder.powers_of_two(min(start, stop), stop)
