"""Saved graphs that do not depend on which models the process built before (transformers' output-capture registry).

transformers 5 keeps ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``: a ``dict`` subclass holding the
``_can_record_outputs`` of every model class built in the process, keyed by class name, in the order the classes were
first built. The forward of every model decorated with ``@capture_outputs`` reads it, so every generation graph does.

torch 2.13's dynamo reads the items of a ``dict`` subclass *by position* (``ConstDictKeySource(registry, i)``, see
``torch/_dynamo/variables/builder.py``) and records the registry among the dicts whose key order it guards. When a
saved graph is loaded (``torch.compiler.load_compiled_function``), rebuilding its guards evaluates every such source
again (``GuardBuilder.__init__``, ``guard_on_key_order``), even the ones whose guards hf_tpu's guard filter drops. A
class's position depends on the models the process built before it: a graph saved by a process that had built other
models first (a test worker after other tests, a server that loaded several models) named a position past the end of
a fresh process's registry, and loading it failed with ``IndexError: list index out of range`` (issue #20).

:func:`stable_positions` moves the classes of the modules being compiled or loaded to the front of the registry, in
module order, for the time of the compile or load, and puts the registry back in its order after: their positions
are then the same in every process (the graph's guards on globals are dropped, so a call never checks them). What
the graph bakes in from the registry is the ``_can_record_outputs`` of the model's own classes, covered by the cache
key (model class and config).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["stable_positions", "without_registry_guards"]


def _registry() -> dict | None:
    module = sys.modules.get("transformers.utils.output_capturing")  # only where transformers built a model
    registry = getattr(module, "_CAN_RECORD_REGISTRY", None)
    return registry if isinstance(registry, dict) else None


def _refill(registry: dict, items: list[tuple[Any, Any]]) -> None:
    # dict's own methods: the registry's __setitem__ takes a model, not its key.
    dict.clear(registry)
    for key, value in items:
        dict.__setitem__(registry, key, value)


@contextlib.contextmanager
def stable_positions(roots: Iterable[Any]) -> Iterator[None]:
    """For the block, the registry entries of the classes of ``roots``' modules (``nn.Module``s; other values are
    ignored) come first, in module order; the registry's order is restored after (entries added meanwhile kept)."""
    registry = _registry()
    if not registry:
        yield
        return
    import torch

    front: list[str] = []
    for root in roots:
        if isinstance(root, torch.nn.Module):
            for module in root.modules():
                name = str(type(module))  # the registry's key (transformers' _CanRecordRegistry.__setitem__)
                if name in registry and name not in front:
                    front.append(name)
    before = list(dict.items(registry))
    if not front or [k for k, _ in before[: len(front)]] == front:
        yield
        return
    moved = [(k, dict.__getitem__(registry, k)) for k in front]
    _refill(registry, moved + [kv for kv in before if kv[0] not in front])
    try:
        yield
    finally:
        current = dict(dict.items(registry))
        order = [k for k, _ in before if k in current] + [k for k in current if k not in dict(before)]
        _refill(registry, [(k, current[k]) for k in order])


def without_registry_guards(entries) -> list[bool]:
    """Every guard of a graph but those on transformers' output-capture registry (``_CAN_RECORD_REGISTRY``), the
    ``guard_filter_fn`` of hf_tpu's compiled generation and encoder graphs. The registry holds every model class the
    process built; each model's forward reads it and dynamo guards it by its length and key order. Kept, they failed
    whenever the process built a model of another class after a graph was compiled (a second model loaded, another
    family's test): every graph then compiled again on its next call, and after a strict warm-up raised dynamo's
    RecompileError. What the graph reads there, the ``_can_record_outputs`` of the model's own classes, is fixed by
    their class, which the graph's guards check."""
    return ["_CAN_RECORD_REGISTRY" not in entry.name for entry in entries]
