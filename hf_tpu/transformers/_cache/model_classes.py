"""Bucketed forms of the cache classes some models keep for themselves (upstream's ``StaticCache`` does not replace
them: ``_supports_default_dynamic_cache()`` is False), keyed by that class, as
:mod:`~hf_tpu.transformers._cache.layer_classes` keys layer forms by upstream's layer class.

Such a model creates its own cache when it is given none; the probe (:mod:`hf_tpu.transformers._cache.probe`) runs
it that way on the ``meta`` device and reads the states the cache holds besides its layers. A form here is a
subclass of the model's cache class (the model's ``isinstance`` check passes) whose layers are the bucketed ones and
whose extra states are fixed tensors written in place, read only when the loop says the graph decodes.

* ``MiniMaxCache`` (MiniMax's lightning attention: one ``K^T V`` state of ``(heads, head dim, head dim)`` per
  linear-attention layer, kept outside the layers through ``get/set_linear_cache``).

Imported on first use (it imports the model's modeling module); classes at module level, as the persistent compile
cache refers to them by name.
"""

from __future__ import annotations

from transformers import cache_utils as cu
from transformers.models.minimax.modeling_minimax import MiniMaxCache

__all__ = ["OWN_CACHES", "extra_shapes"]


class BucketedMiniMaxCache(MiniMaxCache):
    """``MiniMaxCache`` with bucketed layers and fixed linear states (``None`` to the model while prefilling)."""

    def __init__(self, layers: list, linear_states: list):
        cu.Cache.__init__(self, layers=layers)
        self.linear_cache = linear_states  # per layer: a state tensor, or [] for an attention layer
        self.decoding = False

    def get_linear_cache(self, layer_idx: int):
        return self.linear_cache[layer_idx] if self.decoding else None

    def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
        self.linear_cache[layer_idx].copy_(linear_cache)

    def reset(self) -> None:
        cu.Cache.reset(self)
        for state in self.linear_cache:
            if not isinstance(state, list):
                state.zero_()
        self.decoding = False


def _minimax_shapes(cache) -> list[dict]:
    return [{} if isinstance(s, list) else {"linear": (tuple(s.shape[1:]), s.dtype)} for s in cache.linear_cache]


def _minimax_build(layers: list, shapes: list[dict], batch: int, dtype, device):
    import torch

    states = []
    for shape in shapes:
        linear = shape.get("linear")
        if linear is None:
            states.append([])
            continue
        state_shape, state_dtype = linear
        states.append(torch.zeros((batch, *state_shape), dtype=state_dtype or dtype, device=device))
    return BucketedMiniMaxCache(layers, states)


# model's cache class -> (its extra states' shapes from a probed cache, the bucketed cache from layers + shapes)
OWN_CACHES: dict[type, tuple] = {MiniMaxCache: (_minimax_shapes, _minimax_build)}


def extra_shapes(cache) -> list[dict] | None:
    """Per layer, the shapes of the extra states a probed own ``cache`` holds (None: not a known own cache)."""
    form = OWN_CACHES.get(type(cache))
    return None if form is None else form[0](cache)
