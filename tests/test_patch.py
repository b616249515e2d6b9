"""The patch registry: every change to third-party code is recorded, idempotent and exactly reversible."""

import types
import warnings

import pytest

from hf_tpu import _patch


@pytest.fixture
def target():
    owner = types.SimpleNamespace(value="original")
    yield owner
    _patch.revert("test-feature")
    _patch.revert("other-feature")


def test_patch_and_revert_restores_identity(target):
    original = target.value
    _patch.patch(target, "value", "new", feature="test-feature")
    assert target.value == "new"
    assert [r.name for r in _patch.applied("test-feature")] == ["value"]
    _patch.revert("test-feature")
    assert target.value is original
    assert _patch.applied("test-feature") == []


def test_patch_is_idempotent_and_keeps_first_original(target):
    _patch.patch(target, "value", "a", feature="test-feature")
    _patch.patch(target, "value", "a", feature="test-feature")
    _patch.patch(target, "value", "b", feature="test-feature")
    assert target.value == "b"
    assert len(_patch.applied("test-feature")) == 1
    _patch.revert()
    assert target.value == "original"


def test_missing_attribute_is_deleted_on_revert(target):
    _patch.patch(target, "added", 1, feature="test-feature")
    assert target.added == 1
    _patch.revert("test-feature")
    assert not hasattr(target, "added")


def test_class_attribute_inherited_is_not_copied_down():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    _patch.patch(Child, "f", lambda self: "patched", feature="test-feature")
    assert Child().f() == "patched"
    _patch.revert("test-feature")
    assert "f" not in Child.__dict__ and Child().f() == "base"


def test_revert_one_feature_leaves_the_other(target):
    _patch.patch(target, "value", "x", feature="test-feature")
    _patch.patch(target, "other", "y", feature="other-feature")
    _patch.revert("test-feature")
    assert target.value == "original" and target.other == "y"


def test_on_revert_runs_undo_once(target):
    calls = []
    _patch.on_revert("test-feature", lambda: calls.append(1))
    _patch.revert("other-feature")
    assert calls == []
    _patch.revert("test-feature")
    _patch.revert("test-feature")
    assert calls == [1]


def test_version_mismatch_warns_once(target):
    with pytest.warns(UserWarning, match=r"written for torch>=999"):
        _patch.patch(target, "value", "v", feature="test-feature", package="torch", versions=">=999")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _patch.patch(target, "value2", "v", feature="test-feature", package="torch", versions=">=999")


@pytest.mark.parametrize(
    ("installed", "spec", "ok"),
    [
        ("5.0.0.dev0", ">=5.0,<6", True),  # a dev build of 5.0.0 is 5.0.0 (PEP 440 alone puts it below 5.0)
        ("5.24.0rc1", ">=5.0,<6", True),
        ("2.13.0+cpu", ">=2.11,<=2.15", True),
        ("2.15.0+cu128", ">=2.11,<=2.15", True),
        ("6.0.0.dev0", ">=5.0,<6", False),  # the suffix does not let the next major in
        ("4.57.1", ">=5.0,<6", False),
    ],
)
def test_version_matches_ignores_local_and_dev_suffixes(monkeypatch, installed, spec, ok):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    assert _patch.version_matches("somepackage", spec) == (ok, installed)


def test_enable_unknown_integration_names_known_ones():
    with pytest.raises(ValueError, match="unknown hf_tpu integration 'nope'"):
        _patch.enable("nope")


def test_enabled_context_reverts_only_what_it_enabled(monkeypatch, target):
    module = types.ModuleType("hf_tpu_fake_integration")

    def apply():
        _patch.patch(target, "value", "patched", feature="fake")

    module.apply = apply
    monkeypatch.setitem(__import__("sys").modules, "hf_tpu_fake_integration", module)
    monkeypatch.setitem(_patch.INTEGRATIONS, "fake", "hf_tpu_fake_integration:apply")
    with _patch.enabled("fake") as names:
        assert "fake" in names and _patch.is_enabled("fake")
        assert target.value == "patched"
    assert target.value == "original" and not _patch.is_enabled("fake")


def test_failing_apply_is_rolled_back(monkeypatch, target):
    module = types.ModuleType("hf_tpu_broken_integration")

    def apply():
        _patch.patch(target, "value", "half", feature="broken")
        raise RuntimeError("boom")

    module.apply = apply
    monkeypatch.setitem(__import__("sys").modules, "hf_tpu_broken_integration", module)
    monkeypatch.setitem(_patch.INTEGRATIONS, "broken", "hf_tpu_broken_integration:apply")
    with pytest.raises(RuntimeError, match="boom"):
        _patch.enable("broken")
    assert target.value == "original" and not _patch.is_enabled("broken")


def test_assign_sets_and_logs_with_its_reason_and_revert_leaves_it(target):
    _patch.assign(target, "value", "for-life", feature="test-feature", reason="stays for the process")
    assert target.value == "for-life"
    feature, where, reason = _patch.assigned()[-1]
    assert (feature, reason) == ("test-feature", "stays for the process") and where.endswith(".value")
    _patch.revert("test-feature")
    assert target.value == "for-life"  # not a patch: nothing for revert to restore
    assert _patch.applied("test-feature") == []


def test_a_torch_config_flag_set_by_the_simulator_is_restored_by_its_uninstall():
    """The simulator's graph-safe RNG flags go through assign (a torch config module keeps them out of its
    ``__dict__``, so patch() would delete them on revert); its uninstall puts the values found back."""
    import hf_tpu.sim
    from hf_tpu.sim import _rng

    hf_tpu.sim.enable()
    if not _rng.installed():
        pytest.skip("this torch has no graph-safe RNG registration for other devices")
    from torch._functorch import config

    assert config.graphsafe_rng_functionalization is True and config.functionalize_rng_ops is False
    before = dict(_rng._SAVED)
    targets = [t for feature, t, _ in _patch.assigned() if feature == "sim"]
    assert any(t.endswith(".graphsafe_rng_functionalization") for t in targets), targets
    _rng.uninstall()
    try:
        assert config.graphsafe_rng_functionalization == before["graphsafe_rng_functionalization"]
        assert config.functionalize_rng_ops == before["functionalize_rng_ops"]
    finally:
        _rng.install()


def test_a_deferred_integration_applies_when_its_package_is_imported(monkeypatch, tmp_path):
    """An integration of DEFERRED (diffusers) whose package is not imported yet is enabled at once and applied the
    moment the package is imported; disabled first, it never applies; one that fails to apply fails the import and is
    reverted; with the package imported already, enable applies it at once. A look-up of the package without an
    import leaves the integration waiting. No finder is left behind."""
    import importlib.util
    import sys

    package = "hf_tpu_deferred_fixture"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("class Pipe:\n    def to(self):\n        return 'upstream'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    failing = []

    def apply():
        module = sys.modules[package]
        if failing:
            raise ValueError("written for another release")
        _patch.patch(module.Pipe, "to", lambda self: "patched", feature="late")

    real_load = _patch._load
    monkeypatch.setattr(_patch, "_load", lambda name: apply if name == "late" else real_load(name))
    monkeypatch.setitem(_patch.DEFERRED, "late", package)

    def waiting():
        return [f for f in sys.meta_path if isinstance(f, _patch._AfterImport)]

    def fresh():
        sys.modules.pop(package, None)
        return __import__(package)

    sys.modules.pop(package, None)
    assert "late" in _patch.enable("late") and package not in sys.modules
    assert _patch.is_enabled("late") and _patch.applied("late") == [] and len(waiting()) == 1
    assert importlib.util.find_spec(package) is not None  # a look-up alone (an availability check) disarms nothing
    assert package not in sys.modules and len(waiting()) == 1
    module = __import__(package)
    assert module.Pipe().to() == "patched" and len(_patch.applied("late")) == 1 and waiting() == []
    _patch.disable("late")
    assert module.Pipe().to() == "upstream" and not _patch.is_enabled("late")

    sys.modules.pop(package, None)
    _patch.enable("late")
    _patch.disable("late")  # before the import: nothing applies, the finder goes
    assert waiting() == [] and fresh().Pipe().to() == "upstream"

    sys.modules.pop(package, None)
    _patch.enable("late")
    failing.append(True)
    with pytest.raises(ValueError, match="another release"):
        __import__(package)
    assert not _patch.is_enabled("late") and package not in sys.modules and waiting() == []
    failing.clear()

    module = fresh()
    _patch.enable("late")  # imported already: applied at once
    assert module.Pipe().to() == "patched" and waiting() == []
    _patch.disable("late")
    sys.modules.pop(package, None)


class _Upstream:
    def step(self, model, batch):
        return batch

    @staticmethod
    def _decorated(fn):
        import functools

        @functools.wraps(fn)
        def run(*args, **kwargs):  # what torch.compiler.disable and the like look like to inspect without following
            return fn(*args, **kwargs)

        return run


_Upstream.update = _Upstream._decorated(lambda self, key, value, layer: key)


def test_check_parameters_passes_a_wrapper_spelled_as_upstream_and_names_a_change():
    _patch.check_parameters(_Upstream, "step", lambda self, model, batch: 0, feature="example")
    _patch.check_parameters(_Upstream, "step", lambda *args, **kwargs: 0, feature="example")  # passes anything on
    # upstream's parameters as its callers see them, through a decorator that takes (*args, **kwargs)
    _patch.check_parameters(_Upstream, "update", lambda self, key, value, layer: 0, feature="example")
    with pytest.raises(_patch.UpstreamChangedError) as caught:
        _patch.check_parameters(_Upstream, "step", lambda self, batch: 0, feature="example", package="pytest",
                                versions=">=8,<9.2")  # fmt: skip
    message = str(caught.value)
    assert "'example' integration wraps" in message and "_Upstream.step written for (self, batch)" in message
    assert "takes (self, model, batch)" in message and "(pytest " in message and "pytest>=8,<9.2" in message
    assert isinstance(caught.value, TypeError)


def test_check_parameters_reads_upstream_under_a_patch_in_force(target):
    """Asked again while hf_tpu's own wrapper is in force, it compares with upstream's original, not the wrapper."""

    class Owner:
        def f(self, a, b):
            return a + b

    _patch.patch(Owner, "f", lambda self, *args: 0, feature="test-feature")
    try:
        _patch.check_parameters(Owner, "f", lambda self, a, b: 0, feature="test-feature")
        with pytest.raises(_patch.UpstreamChangedError, match=r"takes \(self, a, b\)"):
            _patch.check_parameters(Owner, "f", lambda self, a: 0, feature="test-feature")
    finally:
        _patch.revert("test-feature")
