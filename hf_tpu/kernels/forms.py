"""Kernel forms as registered specs (issue #66): one :class:`KernelForm` per choice of kernel, one lookup for it.

Where an op can run in several forms (the one-token attention, a MoE's experts, where the KV rows are written), the
choice used to have three homes chosen three ways: an ``HF_TPU_*`` variable, a table of chip measurements, a model's
own setting. A :class:`KernelForm` names them together: the forms, which of them can run here, the measured table
its choice reads (or why there is none: ``unmeasured``), the override (an :mod:`hf_tpu._env` variable) and the rule
that turns the override and the call's facts into a form (``pick``). :func:`choose_form` is the one lookup the call
sites use.

The built-in forms are declared next to their code (``KERNEL_FORM`` in each module of :data:`BUILTIN`) and
registered the first time the registry is read; a new form is one such module plus its line in :data:`BUILTIN`, or
one :func:`register_kernel_form` call. Registering a name twice is an error.

Example:
    >>> form = KernelForm("my_op", ("small", "large"), "my op's form", unmeasured="a test's form",
    ...                   pick=lambda override, tokens: "small" if tokens < 8 else "large")
    >>> register_kernel_form(form)
    >>> choose_form("my_op", tokens=4), choose_form("my_op", tokens=64)
    ('small', 'large')
    >>> unregister_kernel_form("my_op") is form
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_tpu._env import Var
from hf_tpu.errors import InvalidArgumentError

__all__ = [
    "BUILTIN",
    "KernelForm",
    "choose_form",
    "kernel_form",
    "kernel_forms",
    "register_kernel_form",
    "unregister_kernel_form",
]

#: The modules declaring hf_tpu's own kernel forms (``KERNEL_FORM`` at module level: a form, or a tuple of them),
#: by form name.
BUILTIN = {
    "experts": "hf_tpu.kernels.experts_forms",
    "decode_attention": "hf_tpu.transformers._decode_attention",
    "kv_write": "hf_tpu.transformers._kv_forms",
    "kv_rows_writer": "hf_tpu.transformers._kv_forms",
}


@dataclass(frozen=True)
class KernelForm:
    """One choice of kernel: its forms, when each can run, how the choice is made and what overrides it.

    Args:
        name: the choice's name (``"decode_attention"``).
        forms: every form it can answer.
        doc: what is chosen, in a line.
        override: the :mod:`hf_tpu._env` variable that overrides the choice, None for none.
        table: the measured choice table, a function returning it (read on demand: a file), None when unmeasured.
        unmeasured: why no table exists (required without ``table``): the choice is the override's, or a fixed rule.
        available: the forms that can run in this process (default: every form).
        pick: ``pick(override value, **facts)``, the form for a call (default: the override's value).
        per_model: the per-model override where there is one, in words (a model attribute, a ``from_pretrained``
            argument).

    Raises:
        ValueError: no forms, neither a table nor a reason it has none, or no override and no ``pick``.
    """

    name: str
    forms: tuple[str, ...]
    doc: str
    override: Var | None = None
    table: Callable[[], Any] | None = None
    unmeasured: str | None = None
    available: Callable[[], tuple[str, ...]] | None = None
    pick: Callable[..., str] | None = None
    per_model: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "forms", tuple(self.forms))
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"a kernel form's name is a non-empty string, got {self.name!r}")
        if not self.forms:
            raise InvalidArgumentError(f"kernel form {self.name!r}: name the forms it can answer")
        if (self.table is None) == (not self.unmeasured):
            raise InvalidArgumentError(
                f"kernel form {self.name!r}: give its measured table (table=) or say why it has none (unmeasured=)"
            )
        if self.override is None and self.pick is None:
            raise InvalidArgumentError(f"kernel form {self.name!r}: without an override it needs a pick rule")

    def usable(self) -> tuple[str, ...]:
        """The forms that can run in this process."""
        return self.forms if self.available is None else tuple(self.available())

    def choose(self, **facts: Any) -> str:
        """The form for a call with ``facts`` (the shapes a measured choice reads): the override's value through
        ``pick``."""
        value = None if self.override is None else self.override.get()
        return value if self.pick is None else self.pick(value, **facts)


_FORMS: dict[str, KernelForm] = {}
_LOADED: set[str] = set()


def _load_builtin() -> None:
    for module in dict.fromkeys(BUILTIN.values()):
        if module not in _LOADED:
            _LOADED.add(module)
            declared = importlib.import_module(module).KERNEL_FORM  # (registered here, once)
            for form in declared if isinstance(declared, tuple) else (declared,):
                if form.name not in _FORMS:
                    _FORMS[form.name] = form


def register_kernel_form(form: KernelForm) -> None:
    """Add ``form`` to the registry.

    Raises:
        ValueError: a form of that name is registered already.
    """
    _load_builtin()
    if form.name in _FORMS:
        raise InvalidArgumentError(
            f"kernel form {form.name!r} is registered already: give the new one another name, or "
            "unregister_kernel_form the old one first"
        )
    _FORMS[form.name] = form


def unregister_kernel_form(name: str) -> KernelForm:
    """Remove the form ``name`` (a test's own form, when the test ends); returns it.

    Raises:
        ValueError: no form of that name is registered.
    """
    form = kernel_form(name)
    del _FORMS[name]
    return form


def kernel_form(name: str) -> KernelForm:
    """The registered form ``name``.

    Raises:
        ValueError: no form of that name is registered.
    """
    if name not in _FORMS:
        _load_builtin()
    form = _FORMS.get(name)
    if form is None:
        raise InvalidArgumentError(f"no kernel form {name!r} is registered (registered: {sorted(_FORMS)})")
    return form


def kernel_forms() -> tuple[KernelForm, ...]:
    """Every registered form, the built-in ones first."""
    _load_builtin()
    return tuple(_FORMS.values())


def choose_form(name: str, **facts: Any) -> str:
    """The form of ``name`` for a call with ``facts``: the one lookup the call sites use (:meth:`KernelForm.choose`).

    Raises:
        ValueError: no form of that name is registered; an override whose value the variable does not take.
    """
    return kernel_form(name).choose(**facts)
