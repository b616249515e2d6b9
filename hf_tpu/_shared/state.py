"""Per-model state and strict mode, as generation and the encoders keep them.

Each integration keeps what it knows of a model in the model's own ``__dict__`` under a key of its own
(:func:`attached`), so the state goes when the model goes and two integrations never share one. Strict mode (after
warm-up a new graph is an error) is switched per model by ``configure(strict=...)`` or, for every model, by the
``HF_TPU_STRICT_COMPILE`` environment variable (:func:`strict_from_env`).

Example:
    >>> from hf_tpu._shared.state import attached
    >>> class Model: pass
    >>> model = Model()
    >>> attached(model, "_hf_tpu_example", dict) is attached(model, "_hf_tpu_example", dict)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hf_tpu import _env

__all__ = ["STRICT_EAGER", "STRICT_ENV", "attached", "strict_from_env"]

# Turns a compile after warm-up into an error (same as ``warmup(..., strict=True)``; ``=eager``: ``strict="eager"``).
STRICT_ENV = _env.STRICT_COMPILE.name
# ``strict="eager"``: an eager op compile after warm-up (a torch_tpu cache miss) is an error too, not only a graph's.
STRICT_EAGER = "eager"

_State = TypeVar("_State")


def attached(model, key: str, make: Callable[[], _State]) -> _State:
    """The state ``model`` keeps under ``key`` (``make()`` on first use), in the model's ``__dict__``."""
    found = model.__dict__.get(key)
    if found is None:
        found = make()
        model.__dict__[key] = found
    return found


def strict_from_env() -> bool | str:
    """What ``HF_TPU_STRICT_COMPILE`` asks: :data:`STRICT_EAGER` for ``eager``, True for ``1``/``true``/``yes``/``on``,
    else False."""
    return _env.STRICT_COMPILE.get()
