"""A ``TrainerCallback`` that records, per optimizer step, what the simulated device compiled.

On a real TPU the counters do not exist; the callback then records wall time only.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepCounters"]


def _base():
    from transformers import TrainerCallback

    return TrainerCallback


class StepCounters(_base()):
    """Per optimizer step: ``compiles``, ``shape_signatures`` (new eager signatures), ``host_syncs``, ``seconds``.

    ``steps`` is a list of dicts, one per step; ``after(n)`` sums the steps after the first ``n`` (warm-up).

    Example:
        >>> counters = StepCounters()
        >>> Trainer(..., callbacks=[counters]).train()          # doctest: +SKIP
        >>> counters.after(2)["shape_signatures"]               # doctest: +SKIP
        0
    """

    FIELDS = ("compiles", "shape_signatures", "host_syncs")

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._mark: dict[str, Any] | None = None

    @staticmethod
    def _now() -> dict[str, Any]:
        from hf_tpu import runtime

        snap: dict[str, Any] = {"t": time.perf_counter()}
        if runtime.detect().mode == "simulated":
            from hf_tpu.sim import STATE

            snap.update({k: getattr(STATE, k) for k in StepCounters.FIELDS})
        return snap

    def on_step_begin(self, args, state, control, **kwargs):
        self._mark = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        if self._mark is None:
            return
        now = self._now()
        step = {k: now[k] - self._mark[k] for k in self.FIELDS if k in now}
        step["seconds"] = now["t"] - self._mark["t"]
        self.steps.append(step)
        self._mark = None

    def after(self, warmup: int) -> dict[str, Any]:
        """Totals of the steps after the first ``warmup`` ones."""
        rest = self.steps[warmup:]
        return {k: sum(s.get(k, 0) for s in rest) for k in (*self.FIELDS, "seconds")} | {"steps": len(rest)}
