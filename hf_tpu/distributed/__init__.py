"""Several TPU chips: the launcher and the tensor-parallel plan checks.

- :mod:`hf_tpu.distributed.launch`: ``hf-tpu launch`` / ``python -m hf_tpu.launch`` (torch_tpu's launch
  environment or its simulated counterpart, then torchrun in-process);
- :mod:`hf_tpu.distributed.tp_plan`: ``DistributedConfig(tp_size=N)`` plans checked against the model config at
  load (integration ``"tensor_parallel"`` of :func:`hf_tpu.enable`).

The simulated device's ``tpu_dist`` backend is the simulator's (:mod:`hf_tpu.sim.process_group`); this package
reaches it through :func:`hf_tpu.runtime.simulated_distributed` and imports nothing of :mod:`hf_tpu.sim`.

Importing this package imports nothing heavy; each submodule is imported on first use.

An unknown attribute raises the built-in ``AttributeError`` from the module's ``__getattr__`` (the protocol
``hasattr`` and ``getattr`` with a default rely on), not an hf_tpu error.

Example:
    >>> from hf_tpu.distributed import fix_plan                      # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TensorParallelConfigError", "fix_plan", "launch", "tp_plan"]

_LAZY = {
    "TensorParallelConfigError": "hf_tpu.distributed.tp_plan:TensorParallelConfigError",
    "fix_plan": "hf_tpu.distributed.tp_plan:fix_plan",
    "launch": "hf_tpu.distributed.launch",
    "tp_plan": "hf_tpu.distributed.tp_plan",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'hf_tpu.distributed' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module
