"""Serving on a TPU: transformers' continuous batching and ``transformers serve`` with static step shapes.

``hf_tpu.enable()`` (feature ``"serving"``) makes ``model.generate_batch(...)``, ``model.init_continuous_batching()``
and ``transformers serve --continuous-batching`` run on a ``tpu`` model with every step padded to a small ladder
(:mod:`~hf_tpu.serving.ladder`), compiled with the ``"tpu"`` backend, warmed up ahead of serving, and a paged KV cache
sized from the model and the chip (:mod:`~hf_tpu.serving.kv_sizing`). ``hf-tpu serve`` runs the server (``--tp N``:
over N chips, :mod:`~hf_tpu.serving.tensor_parallel`). See docs/serving.md.
"""

from __future__ import annotations

from hf_tpu.serving._chunks import ReadBacks, read_backs
from hf_tpu.serving._runner import SETTINGS, ServingSettings, compiled_shapes, configure

__all__ = ["SETTINGS", "ReadBacks", "ServingSettings", "compiled_shapes", "configure", "read_backs"]
