"""Run a callback once a module has been imported (now, if it already is), without importing it ourselves.

The simulator registers its ``"tpu"`` torch.compile backend and its dynamo device interface only once
``torch._dynamo`` is loaded: importing dynamo costs seconds, and most processes that use the device never
compile anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["after_import"]

_PENDING: dict[str, list[Callable[[], None]]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of a watched module so that callbacks run after it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PENDING:
            return None
        callbacks = _PENDING.pop(fullname)
        if not _PENDING and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            _PENDING[fullname] = callbacks  # let the normal machinery fail or succeed; try again next time
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_notify(module: Any) -> None:
            exec_module(module)
            for callback in callbacks:
                callback()

        loader.exec_module = exec_then_notify  # type: ignore[method-assign]
        return spec


_FINDER = _Finder()


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` right after ``module`` is imported, or now if it already is."""
    if module in sys.modules:
        callback()
        return
    _PENDING.setdefault(module, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
