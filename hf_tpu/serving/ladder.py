"""The step ladder of continuous batching on a TPU: every step's shapes come from a few rungs.

Upstream's continuous batching (transformers 5.24) runs one forward per step over all scheduled requests, their
new tokens packed into one row (``num_q_tokens``) and their cached keys/values gathered into one block
(``max_kv_read`` tokens read from the paged cache). Both change at every step; on a TPU each new pair is a new
program. hf_tpu rounds both up to a rung of :class:`StepLadder`:

* query tokens per step: powers of ``q_factor`` (default 4) from ``q_min`` (16) up to ``max_batch_tokens``;
* KV tokens read per step: 0 (a step of first prefills reads nothing), then powers of ``kv_factor`` (4) from one
  page up to everything the cache can hold.

The padding is masked out by upstream (fake sequences of length 0), so results do not change; compiles are bounded
by ``len(q_rungs) * len(kv_rungs)`` shapes, all of which warm-up compiles ahead of serving.

Example:
    >>> ladder = StepLadder.build(max_batch_tokens=256, max_kv_tokens=8192, page_size=256)
    >>> ladder.q_rungs, ladder.kv_rungs
    ((16, 64, 256), (0, 256, 1024, 4096, 8192))
    >>> ladder.pad(num_q_tokens=17, max_kv_read=300)
    (64, 1024)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hf_tpu.errors import HfTpuValueError

__all__ = ["StepLadder"]


def _geometric(start: int, stop: int, factor: int) -> tuple[int, ...]:
    rungs, n = [], max(1, start)
    while n < stop:
        rungs.append(n)
        n *= factor
    rungs.append(stop)
    return tuple(rungs)


@dataclass(frozen=True)
class StepLadder:
    """Rungs for the query tokens and the KV tokens of one continuous-batching step."""

    q_rungs: tuple[int, ...]
    kv_rungs: tuple[int, ...]

    @classmethod
    def build(
        cls, max_batch_tokens: int, max_kv_tokens: int, page_size: int, q_min: int = 16, q_factor: int = 4,
        kv_factor: int = 4,
    ) -> StepLadder:  # fmt: skip
        """The default ladder for a cache of ``max_kv_tokens`` tokens and steps of at most ``max_batch_tokens``."""
        q = _geometric(min(q_min, max_batch_tokens), max_batch_tokens, q_factor)
        kv = (0, *_geometric(min(page_size, max_kv_tokens), max_kv_tokens, kv_factor))
        return cls(q, kv)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every ``(query tokens, KV tokens)`` step shape warm-up compiles."""
        return [(q, kv) for q in self.q_rungs for kv in self.kv_rungs]

    def pad(self, num_q_tokens: int, max_kv_read: int) -> tuple[int, int]:
        """The rungs holding a step of ``num_q_tokens`` new tokens reading ``max_kv_read`` cached ones."""
        return _up(self.q_rungs, num_q_tokens, "query tokens"), _up(self.kv_rungs, max_kv_read, "KV tokens read")


def _up(rungs: tuple[int, ...], value: int, what: str) -> int:
    i = bisect.bisect_left(rungs, value)
    if i == len(rungs):
        raise HfTpuValueError(
            f"a continuous-batching step has {value} {what}, past the largest rung ({rungs[-1]}, ladder "
            f"{list(rungs)}); "
            "this is a bug in hf_tpu's ladder (the scheduler never exceeds the cache's limits): please report it."
        )
    return rungs[i]
