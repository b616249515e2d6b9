"""Shape buckets: round prompt and cache lengths up to a short ladder so that a TPU compiles a bounded set of graphs.

On a TPU every new input shape is a new XLA program. Generation has two lengths that vary from call to call: the
prompt length (the prefill graph) and the KV-cache length (every decode graph). Rounding the prompt up to the rungs
of a ladder bounds the number of graphs by the number of rungs touched, at the price of some padding (masked out,
so results do not change). The default ladder (:func:`default_ladder`) is powers of two from 16 to 256, then steps
of 256 up to 2048, then eight rungs per octave: for prompts uniform in [1, 2048] about 10% of prefill tokens are
padding (powers of two alone: 25%) with 12 rungs. The cache is sized from the padded prompt plus the new tokens,
rounded up to a multiple of 128 (:func:`cache_length`), not to the next rung: decode attention on a static cache
costs in proportion to its length.

Shared by generation (:mod:`hf_tpu.transformers`, which re-exports it as :mod:`hf_tpu.transformers.buckets`) and
the bucketed encoder forward (:mod:`hf_tpu.encoders`).

Example:
    >>> from hf_tpu.transformers.buckets import BucketLadder
    >>> ladder = BucketLadder.powers_of_two(16, 512)
    >>> ladder.rungs
    (16, 32, 64, 128, 256, 512)
    >>> ladder.bucket(17)
    32
    >>> ladder.up_to(100)
    (16, 32, 64, 128)
    >>> BucketLadder.tiered(16, 256, 2048).rungs[-4:]
    (1280, 1536, 1792, 2048)
    >>> cache_length(500 + 8 - 1)
    512
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from hf_tpu.errors import InvalidArgumentError, UserError

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

DEFAULT_MIN_LEN = 16
# Upper end of the default ladder when the model config does not say how long a sequence may be.
DEFAULT_MAX_LEN = 4096
# Where the default ladder stops doubling and steps linearly (eight steps per octave from 8x this length on).
DEFAULT_LINEAR_FROM = 256
# Static caches are a multiple of this many slots (128: the lane width of a TPU vector register).
DEFAULT_CACHE_MULTIPLE = 128


class BucketOverflowError(UserError, ValueError):
    """A length does not fit the largest rung of the bucket ladder."""


@dataclass(frozen=True)
class BucketLadder:
    """Sorted, distinct lengths; :meth:`bucket` rounds a length up to the first rung that holds it."""

    rungs: tuple[int, ...]

    def __post_init__(self) -> None:
        rungs = tuple(sorted({int(r) for r in self.rungs}))
        if not rungs or rungs[0] < 1:
            raise InvalidArgumentError(f"a bucket ladder needs at least one positive length, got {self.rungs!r}")
        object.__setattr__(self, "rungs", rungs)

    @classmethod
    def powers_of_two(cls, start: int = DEFAULT_MIN_LEN, stop: int = DEFAULT_MAX_LEN) -> BucketLadder:
        """``start, 2*start, 4*start, ...`` up to ``stop``; ``stop`` itself is the last rung even if not a power.

        Example:
            >>> BucketLadder.powers_of_two(16, 100).rungs
            (16, 32, 64, 100)
        """
        if start < 1 or stop < start:
            raise InvalidArgumentError(f"powers_of_two needs 1 <= start <= stop, got start={start}, stop={stop}")
        rungs, n = [], start
        while n < stop:
            rungs.append(n)
            n *= 2
        rungs.append(stop)
        return cls(tuple(rungs))

    @classmethod
    def tiered(
        cls, start: int = DEFAULT_MIN_LEN, linear_from: int = DEFAULT_LINEAR_FROM, stop: int = DEFAULT_MAX_LEN
    ) -> BucketLadder:
        """Powers of two from ``start`` to ``linear_from``, then steps of ``linear_from`` up to ``8 * linear_from``,
        then eight rungs per octave (the step doubles with each doubling of the length), and ``stop`` last.

        Padding stays near ``step / 2`` tokens per prompt, about 6% of a long prompt, while the rung count grows
        with the logarithm of ``stop`` past ``8 * linear_from``.

        Example:
            >>> BucketLadder.tiered(16, 256, 3000).rungs
            (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3000)
        """
        if start < 1 or linear_from < start or stop < start:
            raise InvalidArgumentError(
                f"tiered needs 1 <= start <= linear_from and start <= stop, got {start}, {linear_from}, {stop}"
            )
        rungs, n = [], start
        while n < min(linear_from, stop):
            rungs.append(n)
            n *= 2
        n, step = linear_from, linear_from
        while n < stop:
            rungs.append(n)
            if n >= 16 * step:
                step *= 2
            n += step
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


def cache_length(need: int, multiple: int = DEFAULT_CACHE_MULTIPLE) -> int:
    """The static-cache length for ``need`` slots: the next power of two up to ``multiple``, then the next multiple
    of ``multiple`` (at least 16).

    Example:
        >>> [cache_length(n) for n in (1, 20, 128, 129, 519)]
        [16, 32, 128, 256, 640]
    """
    need = max(int(need), DEFAULT_MIN_LEN)
    if need <= multiple:
        return 1 << (need - 1).bit_length()
    return -(-need // multiple) * multiple


def default_ladder(config=None, start: int = DEFAULT_MIN_LEN) -> BucketLadder:
    """:meth:`BucketLadder.tiered` from ``start`` up to the model's longest sequence
    (``max_position_embeddings``/``n_positions``) or :data:`DEFAULT_MAX_LEN` when the config has no limit (T5's
    relative positions, for example)."""
    limit = None
    if config is not None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(text, name, None)
            if isinstance(value, int) and value > 0:
                limit = value
                break
    stop = limit or DEFAULT_MAX_LEN
    start = min(start, stop)
    return BucketLadder.tiered(start, max(start, DEFAULT_LINEAR_FROM), stop)
