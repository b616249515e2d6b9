""":class:`CacheProbeError`, in a module of its own: raised by the cache probe (:mod:`~hf_tpu.transformers._cache.probe`,
which re-exports it) and by the module swaps it runs (:mod:`~hf_tpu.transformers._cache.module_swaps`), which it imports."""

from __future__ import annotations

from hf_tpu.errors import HfTpuError

__all__ = ["CacheProbeError"]


class CacheProbeError(HfTpuError, RuntimeError):
    """The model's cache shapes could not be measured (the message names the model and the reason)."""
