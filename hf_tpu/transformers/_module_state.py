"""State a model keeps on its own modules between forwards, outside the cache, given one layout for every graph.

RecurrentGemma (transformers 5.24) keeps each recurrent block's conv and recurrent states as plain tensor
attributes of its modules, and resets them with the model's ``_setup_cache(config, batch, device, dtype)`` when a
forward starts without a cache, which never happens on hf_tpu's loop (it always passes one). Dynamo guards on those
attributes like on any graph input: on ``None`` at the first prefill and on a tensor at the next one (a new prefill
graph for the second prompt), and on the strides of whatever the previous graph left there (the prefill leaves a
padded copy, a decode step a slice: a second decode graph, after warm-up's single step). So, for a model with that
method, the loop calls it before every prefill (upstream's own reset at the start of a sequence, on the host: zeros
of one layout) and makes the states contiguous after every graph (a no-op but for a decode step's slice). A model
without the method pays nothing.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__: list[str] = []

_SETUP = "_setup_cache"
_PARAMS = ["config", "batch", "device", "dtype"]


def _resets_state(model) -> bool:
    setup = getattr(model, _SETUP, None)
    if setup is None:
        return False
    try:
        return list(inspect.signature(setup).parameters) == _PARAMS
    except (TypeError, ValueError):  # pragma: no cover - a builtin or an odd callable
        return False


def reset(model, state, batch: int) -> None:
    """Before a prefill: the model's own reset of its module-held states (zeros for ``batch`` sequences)."""
    if state.module_states is None:
        state.module_states = _discover(model, batch) if _resets_state(model) else []
    if state.module_states:
        getattr(model, _SETUP)(model.config, batch, model.device, model.dtype)


def settle(state) -> None:
    """After a graph: each module-held state contiguous, so that the next graph sees the layout the last one did."""
    for module, name in state.module_states or ():
        value = module.__dict__.get(name)
        if value is not None and not value.is_contiguous():
            setattr(module, name, value.contiguous())


def _discover(model, batch: int) -> list[tuple[Any, str]]:
    import torch

    getattr(model, _SETUP)(model.config, batch, model.device, model.dtype)
    return [
        (module, name)
        for module in model.modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
    ]
