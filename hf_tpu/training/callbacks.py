"""``TrainerCallback``s: per optimizer step, what the simulated device compiled (:class:`StepCounters`); at the first
step, the device memory this rank holds (:class:`MemoryReport`).

On a real TPU the compile counters do not exist; :class:`StepCounters` then records wall time only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["MemoryReport", "StepCounters"]

logger = logging.getLogger("hf_tpu.training")


def _base():
    from transformers import TrainerCallback

    return TrainerCallback


class StepCounters(_base()):
    """Per optimizer step: ``compiles``, ``shape_signatures`` (new eager signatures), ``host_syncs``, ``eager_ops``
    (device ops dispatched one by one, outside compiled graphs: each a dispatch on a chip), ``seconds``.

    ``steps`` is a list of dicts, one per step; ``after(n)`` sums the steps after the first ``n`` (warm-up). The
    counts are read from the simulated device; on a real TPU only ``seconds`` is measured.

    Example:
        >>> counters = StepCounters()
        >>> Trainer(..., callbacks=[counters]).train()          # doctest: +SKIP
        >>> counters.after(2)["shape_signatures"]               # doctest: +SKIP
        0
    """

    FIELDS = ("compiles", "shape_signatures", "host_syncs", "eager_ops")

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._mark: dict[str, Any] | None = None

    @staticmethod
    def _now() -> dict[str, Any]:
        from hf_tpu import runtime

        snap: dict[str, Any] = {"t": time.perf_counter()}
        if runtime.detect().mode == "simulated":
            from hf_tpu.sim import STATE

            snap.update({k: getattr(STATE, k) for k in StepCounters.FIELDS if k != "eager_ops"})
            snap["eager_ops"] = STATE.ops - STATE.graph_ops
        return snap

    def on_step_begin(self, args, state, control, **kwargs):
        """Trainer hook: mark the counters at the start of a step.

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: its ``TrainerState``.
            control: its ``TrainerControl`` (left as it is).
            **kwargs: what else the Trainer passes (model, optimizer, ...); unused.
        """
        self._mark = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        """Trainer hook: append the step's counts to :attr:`steps`.

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: its ``TrainerState``.
            control: its ``TrainerControl`` (left as it is).
            **kwargs: what else the Trainer passes (model, optimizer, ...); unused.
        """
        if self._mark is None:
            return
        now = self._now()
        step = {k: now[k] - self._mark[k] for k in self.FIELDS if k in now}
        step["seconds"] = now["t"] - self._mark["t"]
        self.steps.append(step)
        self._mark = None

    def after(self, warmup: int) -> dict[str, Any]:
        """Totals of the steps after the first ``warmup`` ones.

        Args:
            warmup: how many first steps to leave out (the ones that compile).

        Returns:
            ``{"compiles", "shape_signatures", "host_syncs", "eager_ops", "seconds"}`` summed over the remaining
            steps (the counters present), and ``"steps"``: how many steps that is.
        """
        rest = self.steps[warmup:]
        return {k: sum(s.get(k, 0) for s in rest) for k in (*self.FIELDS, "seconds")} | {"steps": len(rest)}


class MemoryReport(_base()):
    """Right after the optimizer step of step ``at_step`` (the first by default): this rank's device bytes for the
    parameters, gradients and optimizer state (local shards under FSDP2), the live device bytes and the peak since the
    process started (``torch.accelerator.memory_allocated`` / ``max_memory_allocated``; activations are about
    ``peak`` minus the rest). Kept in ``.values`` and logged once (logger ``hf_tpu.training``). Nothing is measured
    when the Trainer runs on the CPU.

    Args:
        at_step: the 1-based optimizer step after which to measure; 1 by default.

    Example:
        >>> memory = MemoryReport()
        >>> Trainer(..., callbacks=[memory]).train()            # doctest: +SKIP
        >>> memory.values["optimizer"] <= memory.values["live"]  # doctest: +SKIP
        True
    """

    def __init__(self, at_step: int = 1) -> None:
        self.at_step = at_step
        self.values: dict[str, int] = {}

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Trainer hook: measure once, right after the optimizer step of step :attr:`at_step`.

        Args:
            args: the Trainer's ``TrainingArguments`` (its device: nothing is measured on the CPU).
            state: its ``TrainerState``.
            control: its ``TrainerControl`` (left as it is).
            model: the model being trained (its parameters and gradients are counted).
            optimizer: the optimizer (its state is counted).
            **kwargs: what else the Trainer passes; unused.
        """
        # global_step counts the step after this hook
        if self.values or state.global_step + 1 != self.at_step or getattr(args.device, "type", None) == "cpu":
            return
        import torch

        from hf_tpu.training.fsdp import local_state_bytes

        self.values = {
            **local_state_bytes(model, optimizer),
            "live": int(torch.accelerator.memory_allocated()),
            "peak": int(torch.accelerator.max_memory_allocated()),
        }
        logger.info(
            "device memory of this rank after step %d: %s", self.at_step, ", ".join(f"{k} {v:,} B" for k, v in self.values.items())
        )
