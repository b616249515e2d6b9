"""The registry: upstream ``LogitsProcessor`` class -> its device form, found by exact class.

A device form says how one processor runs inside the compiled decode graph:

* ``static(proc, ctx)``: what shapes the graph depends on (part of the graph's key; usually ``()``);
* ``host(proc, ctx)``: the processor's values as ``(scalars, tensors)``, built on the host once per call and sent
  with the prefill: scalars (temperature, top-p, k, ...) become one float32 vector of the graph's inputs, never
  constants of the trace, so changing them compiles nothing;
* ``apply(scores, scalars, tensors, static, ctx)``: the processing, in the graph, on the float32 scores;
* ``advance(tensors, tokens)`` (optional): updates the processor's device state with the tokens just appended.

Lookup is by exact class: a subclass (say a user's processor deriving from an upstream one) may change
``__call__``, so it keeps the host path.

The built-in forms (:mod:`~hf_tpu.transformers.sampling._processors`, :mod:`~hf_tpu.transformers.sampling._warpers`)
import this module and register themselves; the package (:mod:`hf_tpu.transformers.sampling`) imports them, so they
are registered before anything can look a form up here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_tpu.errors import HfTpuError, HfTpuValueError

__all__ = ["DeviceForm", "Unsupported", "form_for", "forms", "register"]


class Unsupported(HfTpuError):
    """Raised by a form's ``host`` when this instance's settings have no device form (it keeps the host path)."""


@dataclass(frozen=True)
class DeviceForm:
    name: str
    host: Callable[[Any, Any], tuple[list[float], tuple]]
    apply: Callable[..., Any]
    static: Callable[[Any, Any], tuple] = lambda proc, ctx: ()
    advance: Callable[[tuple, Any], None] | None = None
    needs_history: bool = False


_BY_CLASS: dict[str, DeviceForm] = {}  # "module.QualName" of the upstream class -> form
_BY_NAME: dict[str, DeviceForm] = {}


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(class_names: list[str], form: DeviceForm) -> DeviceForm:
    """Register ``form`` for the upstream classes named (``transformers.generation.logits_process`` names)."""
    if form.name in _BY_NAME:
        raise HfTpuValueError(f"a device form named {form.name!r} is registered already")
    _BY_NAME[form.name] = form
    for name in class_names:
        key = f"transformers.generation.logits_process.{name}"
        if key in _BY_CLASS:
            raise HfTpuValueError(f"{name} has a device form already ({_BY_CLASS[key].name!r})")
        _BY_CLASS[key] = form
    return form


def form_for(proc) -> DeviceForm | None:
    """The device form of ``proc`` (None: it keeps the host path)."""
    return _BY_CLASS.get(_class_key(type(proc)))


def forms() -> dict[str, DeviceForm]:
    """Every registered form by name (the graph looks its entries up here while tracing)."""
    return _BY_NAME
