"""The simulator's mirror of ``torch_tpu._internal.execution_mode.enable_cpu_fallback``.

On a chip, an aten op torch_tpu does not implement raises "operator '...' is not implemented for TPU. Please file a
feature request"; with ``torch_tpu._internal.execution_mode.enable_cpu_fallback = True`` (off by default; for testing
and debugging, says torch_tpu) it runs on the host instead. The simulated device does the same with this switch, and
counts each such op in ``hf_tpu.sim.stats().cpu_fallbacks``.

Example:
    >>> import torch, hf_tpu.sim
    >>> from hf_tpu.sim import execution_mode
    >>> x = torch.tensor([3.0, 1.0, 2.0], device="tpu")
    >>> execution_mode.enable_cpu_fallback = True
    >>> with hf_tpu.sim.stats() as s:
    ...     m = x.median()
    >>> execution_mode.enable_cpu_fallback = False
    >>> m.item(), s.cpu_fallbacks
    (2.0, 1)
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hf_tpu.sim._counters import STATE

__all__ = ["cpu_fallback", "enable_cpu_fallback"]

if TYPE_CHECKING:
    enable_cpu_fallback: bool


class _ExecutionModeModule(types.ModuleType):
    @property
    def enable_cpu_fallback(self) -> bool:
        """Whether ops torch_tpu does not implement run on the host (True) or raise (False, the default)."""
        return STATE.cpu_fallback

    @enable_cpu_fallback.setter
    def enable_cpu_fallback(self, value: bool) -> None:
        STATE.cpu_fallback = bool(value)


@contextlib.contextmanager
def cpu_fallback(enabled: bool = True) -> Iterator[None]:
    """Set :data:`enable_cpu_fallback` inside the block, restoring it after.

    Args:
        enabled: run ops torch_tpu lacks on the host (True, the default, each counted in ``Stats.cpu_fallbacks``)
            or make them raise (False).
    """
    saved = STATE.cpu_fallback
    STATE.cpu_fallback = bool(enabled)
    try:
        yield
    finally:
        STATE.cpu_fallback = saved


sys.modules[__name__].__class__ = _ExecutionModeModule
