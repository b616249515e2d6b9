"""Every patch keeps what upstream can observe of what it replaced: transformers reads signatures
(``inspect.signature(self.prepare_inputs_for_generation)`` decides whether ``generate`` takes ``inputs_embeds``), and
others read names and docstrings. With every integration enabled, each callable :mod:`hf_tpu._patch` records has the
original's kind (a classmethod stays one, a property stays one), signature, name and docstring."""

from __future__ import annotations

import functools
import importlib.util
import inspect

import hf_tpu
from hf_tpu import _patch


def _function(value):
    """The function behind a class attribute: a classmethod's or staticmethod's, a property's getter."""
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError) as e:
        return f"(no signature: {type(e).__name__})"


def _replaced(record: _patch.PatchRecord):
    """What the patch replaced: the recorded original, or what the owner inherited where it had none of its own."""
    if record.original is not _patch._MISSING:
        return record.original
    if isinstance(record.owner, type):
        return inspect.getattr_static(record.owner.__mro__[1], record.name, None)
    return None


def differences(record: _patch.PatchRecord) -> list[str]:
    """What upstream could tell apart between the replacement and the original it replaced (empty: nothing)."""
    original, replacement = _replaced(record), record.replacement
    if not callable(_function(original)):
        return []  # a data attribute (a plan, a flag): no signature to keep
    if type(original) is not type(replacement):
        return [f"a {type(original).__name__} became a {type(replacement).__name__}"]
    before, after = _function(original), _function(replacement)
    found = []
    if _signature(before) != _signature(after):
        found.append(f"signature {_signature(before)} became {_signature(after)}")
    for name in functools.WRAPPER_ASSIGNMENTS:
        if hasattr(before, name) and getattr(before, name) != getattr(after, name, None):
            found.append(f"{name} differs")
    return found


def _device_machinery(record: _patch.PatchRecord) -> bool:
    """The simulated device's stand-ins for torch's C-level machinery (a storage's constructor and resize, the
    Generator class): torch_tpu registers those in C++, where Python sees no change, while a Python backend can only
    replace the builtin or class with Python of its own, whose kind cannot be a builtin's. Left out of the check."""
    import types

    original = _replaced(record)
    native = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)
    return record.feature == "sim" and (isinstance(original, type) or isinstance(original, native))


def test_every_patch_keeps_the_signature_and_attributes_of_what_it_replaced():
    with hf_tpu.enabled():
        if importlib.util.find_spec("diffusers") is not None:
            import diffusers  # noqa: F401  (its integration applies on import)
        if importlib.util.find_spec("peft") is not None:
            import peft  # noqa: F401  (the same)
        records = _patch.applied()
        found = {r.target: differences(r) for r in records if not _device_machinery(r)}
    assert len(records) > 50  # every integration's patches, not a few
    assert {r.feature for r in records} >= {"device_map", "generation", "tensor_parallel", "training", "serving"}
    assert "peft" in {r.feature for r in records} or importlib.util.find_spec("peft") is None
    assert {target: d for target, d in found.items() if d} == {}


def test_the_check_tells_a_wrapper_that_drops_the_signature():
    class Owner:
        @classmethod
        def build(cls, path: str, *, strict: bool = False) -> int:
            """Build it."""
            return 1

        def run(self, x, y=2):
            return x + y

    original = Owner.__dict__["run"]

    def bare(*args, **kwargs):
        return original(*args, **kwargs)

    try:
        kept = _patch.patch(Owner, "run", functools.wraps(original)(lambda *a, **k: original(*a, **k)), feature="t")
        assert differences(kept) == []
        dropped = _patch.patch(Owner, "run", bare, feature="t")
        assert differences(dropped)[0] == "signature (self, x, y=2) became (*args, **kwargs)"
        kind = _patch.patch(Owner, "build", Owner.__dict__["build"].__func__, feature="t")
        assert differences(kind) == ["a classmethod became a function"]
    finally:
        _patch.revert("t")
