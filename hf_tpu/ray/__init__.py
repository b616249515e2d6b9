"""hf_tpu on Ray: batch inference with Ray Data and serving replicas with Ray Serve (``pip install 'hf-tpu[ray]'``).

* :class:`~hf_tpu.ray.batch.HfTpuGenerate`: a callable class for ``Dataset.map_batches``, one model per actor on the
  TPU, warmed up from the persistent compile cache, a batch of prompts per call through hf_tpu's bucketed
  ``generate``; rows come back with ``generated_text``, ``generated_token_ids`` and ``error``.
* :mod:`hf_tpu.ray.serve`: ``hf-tpu serve`` as a Ray Serve deployment, one replica per TPU VM (or per chip), so that
  N replicas answer one OpenAI-compatible endpoint.

Nothing here imports Ray (or torch) until a name is used: ``import hf_tpu.ray`` is as light as ``import hf_tpu``.

An unknown attribute raises the built-in ``AttributeError`` from the module's ``__getattr__`` (the protocol
``hasattr`` and ``getattr`` with a default rely on), not an hf_tpu error.

Example:
    >>> import ray                                                                                  # doctest: +SKIP
    >>> from hf_tpu.ray import HfTpuGenerate                                                        # doctest: +SKIP
    >>> ds = ray.data.from_items([{"prompt": "The king said"}] * 64)                                 # doctest: +SKIP
    >>> out = ds.map_batches(HfTpuGenerate, fn_constructor_kwargs={"model": path, "batch_size": 16},
    ...                      batch_size=16, resources={"TPU": 1},
    ...                      compute=ray.data.ActorPoolStrategy(size=2))                             # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["HfTpuGenerate", "StartReport"]

_LAZY = {"HfTpuGenerate": "hf_tpu.ray.batch", "StartReport": "hf_tpu.ray.batch"}

if TYPE_CHECKING:  # pragma: no cover
    from hf_tpu.ray.batch import HfTpuGenerate, StartReport


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_tpu.ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
