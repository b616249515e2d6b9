"""enable()/disable() of the device_map integration: every patched attribute comes back as the very same object."""

from __future__ import annotations

import pytest

import hf_tpu
from hf_tpu import _patch


def _current(record):
    owner, name = record.owner, record.name
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def test_disable_restores_the_identical_upstream_objects():
    hf_tpu.enable("device_map")
    records = list(_patch.applied("device_map"))
    hf_tpu.disable("device_map")
    assert len(records) >= 9
    upstream = {(id(r.owner), r.name): _current(r) for r in records}
    assert all(upstream[(id(r.owner), r.name)] is r.original for r in records)

    hf_tpu.enable("device_map")
    try:
        for r in records:
            assert _current(r) is not upstream[(id(r.owner), r.name)], r.target
    finally:
        hf_tpu.disable("device_map")
    for r in records:
        assert _current(r) is upstream[(id(r.owner), r.name)], r.target


def test_enable_is_idempotent_and_context_manager_reverts():
    import accelerate.utils.modeling as acc_modeling
    import transformers.modeling_utils as tf_modeling

    before = (acc_modeling.get_max_memory, tf_modeling._get_device_map, tf_modeling.PreTrainedModel.__dict__["to"])
    with hf_tpu.enabled("device_map"):
        n = len(_patch.applied("device_map"))
        hf_tpu.enable("device_map")
        assert len(_patch.applied("device_map")) == n
        assert acc_modeling.get_max_memory is not before[0]
        assert tf_modeling._get_device_map is not before[1]
    after = (acc_modeling.get_max_memory, tf_modeling._get_device_map, tf_modeling.PreTrainedModel.__dict__["to"])
    assert all(a is b for a, b in zip(before, after, strict=True))
    assert not hf_tpu.is_enabled("device_map")


def test_aliases_in_other_modules_are_patched_and_restored():
    import accelerate
    import accelerate.big_modeling
    import transformers.integrations.accelerate as tf_acc

    upstream = accelerate.big_modeling.dispatch_model
    with hf_tpu.enabled("device_map"):
        assert accelerate.dispatch_model is accelerate.big_modeling.dispatch_model is tf_acc.dispatch_model
        assert accelerate.dispatch_model is not upstream
        assert tf_acc.accelerate_max_memory is accelerate.utils.modeling.get_max_memory
    assert accelerate.dispatch_model is upstream and tf_acc.dispatch_model is upstream


def test_every_patch_names_the_upstream_release_it_was_written_for():
    with hf_tpu.enabled("device_map"):
        for r in _patch.applied("device_map"):
            assert r.package in ("accelerate", "transformers") and r.versions, r.target
            assert _patch.version_matches(r.package, r.versions)[0], r.target


def test_original_gives_the_raw_class_attribute_before_and_after_patching():
    from transformers import PreTrainedModel

    raw = PreTrainedModel.__dict__["from_pretrained"]
    assert _patch.original(PreTrainedModel, "from_pretrained") is raw  # a classmethod, not a bound method
    with hf_tpu.enabled("device_map"):
        assert PreTrainedModel.__dict__["from_pretrained"] is not raw
        assert _patch.original(PreTrainedModel, "from_pretrained") is raw
    assert PreTrainedModel.__dict__["from_pretrained"] is raw


def test_a_module_imported_while_enabled_gets_upstream_back(monkeypatch):
    import sys
    import types

    import accelerate.big_modeling

    upstream = accelerate.big_modeling.dispatch_model
    hf_tpu.enable("device_map")
    try:
        late = types.ModuleType("diffusers._hf_tpu_late_import_probe")
        late.dispatch_model = accelerate.big_modeling.dispatch_model  # what `from accelerate import ...` binds now
        monkeypatch.setitem(sys.modules, late.__name__, late)
        assert late.dispatch_model is not upstream
    finally:
        hf_tpu.disable("device_map")
    assert late.dispatch_model is upstream


def test_two_features_cannot_patch_one_attribute():
    import types

    owner = types.SimpleNamespace(value="upstream")
    _patch.patch(owner, "value", "a", feature="test-feature-a")
    try:
        with pytest.raises(ValueError, match=r"'test-feature-a' and 'test-feature-b' both patch"):
            _patch.patch(owner, "value", "b", feature="test-feature-b")
        assert owner.value == "a"
    finally:
        _patch.revert("test-feature-a")
    assert owner.value == "upstream"


def test_all_integrations_together_revert_to_upstream():
    names = hf_tpu.enable()
    try:
        assert "device_map" in names
        records = list(_patch.applied())
    finally:
        hf_tpu.disable()
    assert _patch.applied() == []
    for r in records:
        if r.original is _patch._MISSING:
            assert r.name not in vars(r.owner), r.target
        else:
            assert _current(r) is r.original, r.target
