"""The one place where hf_tpu changes third-party code.

Every change to an attribute of another library (accelerate, transformers, diffusers, torch) goes through
:func:`patch`, which records ``(owner, attribute, original)`` so that :func:`revert` puts back exactly what was
there. A patch names the feature it belongs to and the upstream version range it was written for; outside that
range it still applies, but says so once in a warning, so that a user on a newer release knows where to look.

Integrations (device_map, generation, tensor parallel, diffusers, kernels, ...) are listed in
:data:`INTEGRATIONS` by import path and loaded only when :func:`enable` runs, which keeps ``import hf_tpu``
cheap. Each integration module exposes ``apply()`` that calls :func:`patch` (or an upstream registration API
paired with an undo through :func:`on_revert`).

Example:
    >>> import hf_tpu
    >>> with hf_tpu.enabled():
    ...     pass  # accelerate and transformers know about TPU here
    >>> # and upstream is exactly as it was again here
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.metadata
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hf_tpu.errors import HfTpuError, HfTpuValueError, InvalidArgumentError

logger = logging.getLogger("hf_tpu.patch")

__all__ = [
    "INTEGRATIONS",
    "PatchRecord",
    "applied",
    "UpstreamChangedError",
    "assign",
    "assigned",
    "check_parameters",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "on_revert",
    "original",
    "patch",
    "revert",
    "version_matches",
]

# Integration name -> "module:function". Loaded lazily, applied in this order by enable().
INTEGRATIONS: dict[str, str] = {
    "device_map": "hf_tpu.device_map._integration:apply",
    "tensor_parallel": "hf_tpu.distributed.tp_plan:apply",
    "kernels": "hf_tpu.kernels:apply",
    "generation": "hf_tpu.transformers._integration:apply",
    "encoders": "hf_tpu.encoders._integration:apply",
    "serving": "hf_tpu.serving._integration:apply",
    "diffusers": "hf_tpu.diffusers.placement:apply",
    "training": "hf_tpu.training._integration:apply",
    "quantization": "hf_tpu.quantization._integration:apply",
    "peft": "hf_tpu.training._peft:apply",
}

#: Integrations whose patches wait for their package's import: :func:`enable` applies one at once where the package is
#: imported already, else the moment it is (:class:`_AfterImport`), so that a program that never imports diffusers does
#: not pay for importing it (~0.5 s of CPU in every process that enables everything, measured on a 2-core host).
DEFERRED: dict[str, str] = {"diffusers": "diffusers", "peft": "peft"}

_MISSING = object()
_LOCK = threading.RLock()


@dataclass
class PatchRecord:
    owner: Any
    name: str
    original: Any
    replacement: Any
    feature: str
    package: str | None
    versions: str | None

    @property
    def target(self) -> str:
        owner_name = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        module = getattr(self.owner, "__module__", None)
        if module and not owner_name.startswith(module) and not isinstance(self.owner, type(logging)):
            owner_name = f"{module}.{owner_name}"
        return f"{owner_name}.{self.name}"


@dataclass
class _State:
    patches: dict[tuple[int, str], PatchRecord] = field(default_factory=dict)
    undo: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)
    warned_versions: set[tuple[str, str]] = field(default_factory=set)
    assigned: list[tuple[str, str, str]] = field(default_factory=list)  # (feature, target, reason) of assign()


_STATE = _State()


def version_matches(package: str, spec: str) -> tuple[bool, str | None]:
    """Whether the installed ``package`` satisfies the PEP 440 ``spec``; returns ``(ok, installed_version)``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False, None
    # Compare the release only, so that 5.24.0.dev0 and 2.13.0+cpu match "<6" and "<=2.15".
    return Version(Version(installed).base_version) in SpecifierSet(spec), installed


def _check_version(feature: str, package: str | None, versions: str | None) -> None:
    if package is None or versions is None:
        return
    key = (package, versions)
    if key in _STATE.warned_versions:
        return
    ok, installed = version_matches(package, versions)
    if not ok:
        _STATE.warned_versions.add(key)
        warnings.warn(
            f"hf_tpu's '{feature}' integration was written for {package}{versions}, but {package} "
            f"{installed or '(not installed)'} is installed. It is applied anyway; if something breaks, "
            f"pin {package}{versions} or report the version at the hf_tpu issue tracker.",
            stacklevel=3,
        )


def patch(
    owner: Any,
    name: str,
    replacement: Any,
    *,
    feature: str,
    package: str | None = None,
    versions: str | None = None,
) -> PatchRecord:
    """Set ``owner.name = replacement`` and remember the original so that :func:`revert` restores it.

    Idempotent: patching the same attribute again with the same replacement does nothing; with another
    replacement it replaces the replacement but keeps the first original. Another feature patching an attribute
    that one feature already patched is an error (one of the two wrappers would be lost). ``package``/``versions`` name the
    upstream release range the patch was written for (a warning is given outside it).
    """
    with _LOCK:
        _check_version(feature, package, versions)
        key = (id(owner), name)
        record = _STATE.patches.get(key)
        if record is not None and record.feature != feature:
            # Two integrations wrapping one attribute would silently drop one of them (each wraps upstream).
            raise HfTpuValueError(
                f"hf_tpu integrations {record.feature!r} and {feature!r} both patch {record.target}; only one may. "
                "Chain them in one integration, or use an upstream extension point."
            )
        if record is not None:
            if record.replacement is not replacement:
                setattr(owner, name, replacement)
                record.replacement = replacement
            return record
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
        record = PatchRecord(owner, name, original, replacement, feature, package, versions)
        setattr(owner, name, replacement)
        _STATE.patches[key] = record
        logger.debug("hf_tpu[%s]: patched %s", feature, record.target)
        return record


class UpstreamChangedError(HfTpuError, TypeError):
    """An upstream function hf_tpu wraps no longer takes the parameters its wrapper was written for: the message
    names the function, the parameters found and the ones expected."""


def check_parameters(owner: Any, name: str, replacement: Any, *, feature: str, package: str | None = None,
                     versions: str | None = None) -> None:  # fmt: skip
    """Raise :class:`UpstreamChangedError` when ``owner.name`` (upstream's, before any patch) takes other parameters
    than the wrapper ``replacement`` spells out (its own, not the ones ``functools.wraps`` copies): a wrapper that
    calls upstream with a fixed parameter list would otherwise fail later, mid-request, or pass a value to the wrong
    parameter. A wrapper taking ``*args``/``**kwargs`` passes anything through and is not checked.

    Args:
        owner: the class or module patched.
        name: the attribute.
        replacement: the wrapper.
        feature: the integration (named in the message).
        package: the upstream package (its installed version is named in the message).
        versions: the release range the wrapper was written for (named in the message).

    Raises:
        UpstreamChangedError: upstream's parameters are not the wrapper's.

    Example:
        >>> from hf_tpu._patch import check_parameters
        >>> class Upstream:
        ...     def step(self, a, b):
        ...         return a + b
        >>> check_parameters(Upstream, "step", lambda self, a, b: 0, feature="example")  # the same: nothing said
        >>> check_parameters(Upstream, "step", lambda self, a: 0, feature="example")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_tpu._patch.UpstreamChangedError: ... written for (self, a), but ...Upstream.step takes (self, a, b): ...
    """
    import inspect

    def params(fn, own: bool) -> list[tuple[str, Any]] | None:
        fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
        try:  # upstream's as its callers see it (through a decorator such as torch.compiler.disable); the wrapper's own
            found = inspect.signature(fn, follow_wrapped=not own).parameters.values()
        except (TypeError, ValueError):
            return None
        return [(p.name, p.kind) for p in found]

    own = params(replacement, own=True)
    upstream = params(original(owner, name), own=False)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if own is None or upstream is None or any(kind in variadic for _, kind in own):
        return
    if own == upstream:
        return
    target = PatchRecord(owner, name, None, replacement, feature, package, versions).target
    installed = version_matches(package, versions or ">=0")[1] if package else None
    release = f" ({package} {installed})" if installed else ""
    written = f" written for {package}{versions}" if package and versions else ""
    raise UpstreamChangedError(
        f"hf_tpu's {feature!r} integration wraps {target} written for ({', '.join(n for n, _ in own)}), but "
        f"{target}{release} takes ({', '.join(n for n, _ in upstream)}): upstream changed it. hf_tpu's wrapper was"
        f"{written or ' written for another release'}; install a release in that range or report the version at "
        "the hf_tpu issue tracker."
    )


def assign(owner: Any, name: str, value: Any, *, feature: str, reason: str) -> None:
    """Set ``owner.name = value`` where :func:`patch`'s record-and-revert does not fit, and say why.

    Two cases only: a value that stays for the process's life (the simulated device's answers, which torch cannot
    unregister), and an undo putting back upstream's own object or setting (where :func:`revert` would restore the
    wrong thing: a torch config module, whose attributes are not in its ``__dict__``, or an alias bound after the
    patch). Nothing is recorded for :func:`revert`; :func:`assigned` lists what was set and why.

    Args:
        owner: the object of another library (a module, class, config module).
        name: the attribute.
        value: what to set.
        feature: what sets it (``"sim"``, ``"device_map"``, ...).
        reason: why it is not a :func:`patch`.

    Example:
        >>> import types
        >>> from hf_tpu._patch import assign
        >>> owner = types.SimpleNamespace(flag=False)
        >>> assign(owner, "flag", True, feature="example", reason="a doctest")
        >>> owner.flag
        True
    """
    with _LOCK:
        setattr(owner, name, value)
        target = PatchRecord(owner, name, None, value, feature, None, None).target
        _STATE.assigned.append((feature, target, reason))
        del _STATE.assigned[:-256]  # (a bounded log: an undo may run once per enable/disable cycle)
        logger.debug("hf_tpu[%s]: set %s (%s)", feature, target, reason)


def assigned() -> list[tuple[str, str, str]]:
    """What :func:`assign` set, oldest first (the last 256): ``(feature, target, reason)`` each."""
    with _LOCK:
        return list(_STATE.assigned)


def original(owner: Any, name: str) -> Any:
    """The upstream value of ``owner.name``: what was there before hf_tpu patched it (the current value if unpatched).

    For a class attribute this is the raw ``__dict__`` entry (a ``classmethod`` object, not a bound method).

    A replacement uses this to call the function it wraps without holding its own reference to it.
    """
    with _LOCK:
        record = _STATE.patches.get((id(owner), name))
        if record is not None and record.original is not _MISSING:
            return record.original
        if record is None and isinstance(owner, type) and name in owner.__dict__:
            return owner.__dict__[name]  # the raw attribute (a classmethod stays a classmethod), as patch() records it
        if record is not None:  # patched where the class only inherited it: the inherited value
            return getattr(owner.__mro__[1], name) if isinstance(owner, type) else getattr(owner, name)
        return getattr(owner, name)


def on_revert(feature: str, undo: Callable[[], None]) -> None:
    """Register ``undo`` to run when ``feature`` is reverted (for upstream registries such as
    ``ALL_EXPERTS_FUNCTIONS.register`` that are not plain attributes)."""
    with _LOCK:
        _STATE.undo.append((feature, undo))


def revert(feature: str | None = None) -> None:
    """Undo the patches of ``feature`` (all of them when None), newest first."""
    with _LOCK:
        for key, record in reversed(list(_STATE.patches.items())):
            if feature is not None and record.feature != feature:
                continue
            if record.original is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(record.owner, record.name)
            else:
                setattr(record.owner, record.name, record.original)
            del _STATE.patches[key]
            logger.debug("hf_tpu[%s]: restored %s", record.feature, record.target)
        keep = []
        for feat, undo in reversed(_STATE.undo):
            if feature is None or feat == feature:
                undo()
            else:
                keep.append((feat, undo))
        _STATE.undo = list(reversed(keep))
        if feature is None:
            _STATE.enabled.clear()
        elif feature in _STATE.enabled:
            _STATE.enabled.remove(feature)


def applied(feature: str | None = None) -> list[PatchRecord]:
    """The patches in force, oldest first."""
    with _LOCK:
        return [r for r in _STATE.patches.values() if feature is None or r.feature == feature]


def is_enabled(name: str | None = None) -> bool:
    """Whether hf_tpu's integrations are in force.

    Args:
        name: one integration of :data:`INTEGRATIONS` (``"generation"``, ...); None (the default) asks whether any
            integration is enabled.

    Returns:
        True when ``name`` is enabled (or, with no name, when at least one integration is).
    """
    with _LOCK:
        return bool(_STATE.enabled) if name is None else name in _STATE.enabled


def _load(name: str) -> Callable[[], None]:
    try:
        target = INTEGRATIONS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown hf_tpu integration {name!r}; known: {', '.join(INTEGRATIONS)}") from None
    module_name, _, func = target.partition(":")
    return getattr(importlib.import_module(module_name), func or "apply")


class _AfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while an enabled integration waits for ``package``: when the package is imported, it
    lets the other finders find it, and once the package's module has run, applies the integration (under the
    patches' lock) and leaves ``sys.meta_path``. An integration that fails to apply is reverted and its error
    propagates, as :func:`enable`'s would: the import fails with it. :func:`revert` takes the finder away (registered
    with :func:`on_revert`)."""

    def __init__(self, feature: str, package: str, apply: Callable[[], None]) -> None:
        self.feature, self.package, self.apply = feature, package, apply

    def install(self) -> None:
        sys.meta_path.insert(0, self)
        on_revert(self.feature, self.remove)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.package:
            return None
        # The other finders find it; this one stays until the package's module runs: a look-up without an import
        # (``importlib.util.find_spec``, as availability checks such as transformers' do) must not disarm it.
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, hook = spec.loader, self  # (a loader made for this look-up: the wrapper below is its own)
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            del loader.exec_module  # (the loader's own method again: this runs once)
            hook.remove()
            run(module)
            hook.applied()

        loader.exec_module = exec_module
        return spec

    def applied(self) -> None:
        with _LOCK:
            if self.feature not in _STATE.enabled:
                return  # disabled since
            try:
                self.apply()
            except BaseException:
                revert(self.feature)
                raise
            logger.info("hf_tpu: applied the %s integration (%s imported)", self.feature, self.package)


def enable(*names: str) -> list[str]:
    """Apply the named integrations (all of them when none are named). Idempotent.

    An integration of :data:`DEFERRED` (``"diffusers"``) whose package is not imported yet is enabled at once and
    applied when the package is imported (``import diffusers`` after ``enable()`` finds its pipelines patched).

    Args:
        *names: integrations of :data:`INTEGRATIONS` (``"generation"``, ``"device_map"``, ``"serving"``, ...);
            none: all of them.

    Returns:
        The names of the integrations in force afterwards.

    Raises:
        ValueError: a name that is not an integration (the message lists them).
        Exception: whatever an integration's patch raises (an upstream version outside the range it was written
            for, ...); that integration is reverted before the error propagates (nothing stays half-applied).
    """
    with _LOCK:
        for name in names or tuple(INTEGRATIONS):
            if name in _STATE.enabled:
                continue
            apply = _load(name)
            package = DEFERRED.get(name)
            if package is not None and package not in sys.modules:
                _AfterImport(name, package, apply).install()  # applied when the package is imported
            else:
                try:
                    apply()
                except BaseException:
                    revert(name)
                    raise
            _STATE.enabled.append(name)
            logger.info("hf_tpu: enabled the %s integration", name)
        return list(_STATE.enabled)


def disable(*names: str) -> None:
    """Revert the named integrations (all when none are named) to exactly the upstream state.

    Args:
        *names: integrations of :data:`INTEGRATIONS` to revert; none: all of them. A name that is not enabled is
            left as it is.
    """
    with _LOCK:
        if not names:
            revert()
            return
        for name in names:
            revert(name)


@contextlib.contextmanager
def enabled(*names: str) -> Iterator[list[str]]:
    """Context manager: integrations applied inside, reverted on exit (only those this call enabled).

    Args:
        *names: integrations of :data:`INTEGRATIONS` to apply; none: all of them.

    Yields:
        The names of the integrations in force inside the block (as :func:`enable` returns them).

    Raises:
        ValueError: a name that is not an integration (raised by :func:`enable` on entry).
    """
    with _LOCK:
        before = list(_STATE.enabled)
    now = enable(*names)
    try:
        yield now
    finally:
        for name in reversed(now):
            if name not in before:
                revert(name)
