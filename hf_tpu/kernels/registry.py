"""Register experts implementations in transformers' experts interface, reversibly.

transformers dispatches every MoE experts module decorated with ``@use_experts_implementation`` through
``ALL_EXPERTS_FUNCTIONS`` by ``config._experts_implementation`` (the ``experts_implementation=`` argument of
``from_pretrained``). :func:`register_experts` adds a name there with ``ALL_EXPERTS_FUNCTIONS.register`` (the
upstream extension point) and records an undo with :func:`hf_tpu._patch.on_revert`, so ``hf_tpu.disable()``
or :func:`unregister_experts` puts the mapping back as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hf_tpu import _patch
from hf_tpu.errors import InvalidArgumentError, InvalidTypeError, UserError

__all__ = [
    "FEATURE",
    "KernelModuleError",
    "apply",
    "register_experts",
    "registered_experts",
    "unregister_experts",
    "use_ragged_dot_experts",
]

FEATURE = "kernels"
RAGGED_DOT_NAME = "ragged_dot_tpu"

_MISSING = object()


class KernelModuleError(UserError, AttributeError):
    """A kernel module given to :func:`register_experts` that defines no ``experts_forward``."""


_LOCK = threading.RLock()
# name -> (function we registered, what the mapping held before)
_OURS: dict[str, tuple[Callable, Any]] = {}


def _interface():
    from transformers.integrations.moe import ExpertsInterface

    return ExpertsInterface


def _resolve(kernel: ModuleType | Callable) -> Callable:
    if isinstance(kernel, ModuleType):
        fn = getattr(kernel, "experts_forward", None)
        if fn is None:
            raise KernelModuleError(
                f"register_experts: kernel module {kernel.__name__!r} has no experts_forward; pass a module that "
                "defines experts_forward(self, hidden_states, top_k_index, top_k_weights) or the function itself."
            )
        return fn
    if callable(kernel):
        return kernel
    raise InvalidTypeError(f"register_experts: expected a kernel module or a callable, got {type(kernel).__name__}")


def register_experts(name: str, kernel: ModuleType | Callable, *, replace: bool = False) -> str:
    """Make ``kernel`` (a module with ``experts_forward``, or the function) available as
    ``experts_implementation=name``. Returns ``name``.

    Registering the same function under the same name again does nothing. A name that already maps to something
    else (transformers' ``grouped_mm``, or another kernel) is an error unless ``replace=True``; the previous entry
    comes back on :func:`unregister_experts` / ``hf_tpu.disable()``.

    Args:
        name: the ``experts_implementation`` name to register (not empty, not ``"eager"``).
        kernel: a kernel module defining ``experts_forward(self, hidden_states, top_k_index, top_k_weights)``, or
            that function itself.
        replace: override an implementation already registered under ``name`` (until ``hf_tpu.disable()``);
            False by default.

    Returns:
        ``name``, to pass as ``experts_implementation``.

    Raises:
        ValueError (InvalidArgumentError): an empty name or ``"eager"``, or a name already registered to something else
            without ``replace=True``.
        AttributeError: a kernel module without ``experts_forward``.
        TypeError: ``kernel`` is neither a module nor a callable.

    Example:
        >>> from hf_tpu.kernels import load_ragged_dot_kernel, register_experts
        >>> name = register_experts("ragged_dot_tpu", load_ragged_dot_kernel())          # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=name)  # doctest: +SKIP
    """
    if not name or name == "eager":
        raise InvalidArgumentError(
            "register_experts: the name must be non-empty and not 'eager' (transformers' own loop)"
        )
    fn = _resolve(kernel)
    interface = _interface()
    mapping = interface._global_mapping
    with _LOCK:
        current = mapping.get(name, _MISSING)
        if current is fn:
            return name
        if current is not _MISSING and not replace:
            raise InvalidArgumentError(
                f"register_experts({name!r}): that experts implementation is already registered ({current!r}); "
                "pick another name, or pass replace=True to override it until hf_tpu.disable()."
            )
        previous = _OURS[name][1] if name in _OURS else current
        interface.register(name, fn)
        first = name not in _OURS
        _OURS[name] = (fn, previous)
        if first:
            _patch.on_revert(FEATURE, lambda: unregister_experts(name))
    return name


def unregister_experts(name: str) -> None:
    """Undo :func:`register_experts` for ``name`` (restoring what was there before); unknown names are ignored.

    Args:
        name: a name given to :func:`register_experts`. If another library registered over it since, its entry is
            left in place.
    """
    with _LOCK:
        entry = _OURS.pop(name, None)
        if entry is None:
            return
        fn, previous = entry
        mapping = _interface()._global_mapping
        if mapping.get(name) is not fn:  # someone else registered over us since: leave theirs in place
            return
        if previous is _MISSING:
            del mapping[name]
        else:
            mapping[name] = previous


def registered_experts() -> dict[str, Callable]:
    """The experts implementations hf_tpu registered and that are still in force.

    Returns:
        A new dict: ``experts_implementation`` name -> the experts forward function.
    """
    with _LOCK:
        return {name: fn for name, (fn, _) in _OURS.items()}


def use_ragged_dot_experts(name: str = RAGGED_DOT_NAME, *, implementation: str = "auto") -> str:
    """Load the shipped ragged-dot kernel and register its experts forward; returns the name to pass as
    ``experts_implementation``.

    ``implementation`` picks the grouped matmul (``"auto"``: the Pallas kernel on TPU, the XLA path elsewhere;
    ``"pallas"``, ``"pallas_interpret"``, ``"xla"``, ``"xla_tiled"``).

    Args:
        name: the name to register it under; ``"ragged_dot_tpu"`` by default.
        implementation: the grouped matmul, see above; ``"auto"`` by default.

    Returns:
        ``name``, to pass as ``experts_implementation`` (registering the same kernel again does nothing).

    Raises:
        ValueError: an unknown ``implementation`` (from the kernel), or see :func:`register_experts`.
        FileNotFoundError: the shipped kernel's folder is missing (see :func:`~hf_tpu.kernels.load_local_kernel`).

    Example:
        >>> from hf_tpu.kernels import use_ragged_dot_experts
        >>> impl = use_ragged_dot_experts()                                            # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl)  # doctest: +SKIP
    """
    from hf_tpu.kernels.loader import load_ragged_dot_kernel

    kernel = load_ragged_dot_kernel()
    fn = kernel.experts_forward if implementation == "auto" else kernel.make_experts_forward(implementation)
    current = _OURS.get(name)
    if current is not None and getattr(current[0], "__name__", None) == fn.__name__:
        return name  # same kernel, same implementation: already in force
    return register_experts(name, fn, replace=name in _OURS)


def apply() -> None:
    """hf_tpu integration entry point: ``experts_implementation="ragged_dot_tpu"`` becomes available, and on a host
    with TPU chips ``kernels.get_kernel`` selects ``torch-tpu`` build variants (see
    :func:`hf_tpu.kernels.loader.expose_tpu_backend`)."""
    from hf_tpu.kernels.loader import expose_tpu_backend

    expose_tpu_backend(FEATURE)
    use_ragged_dot_experts()
