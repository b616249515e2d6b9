"""The ``serving`` self-test check passes on the simulated device, and is skipped naming the extras without them."""

import importlib.util

import pytest

from hf_tpu import selftest


def test_serving_check_passes_and_compiles_nothing_after_warm_up():
    (result,) = selftest.run_checks(only=["serving"])
    assert result.status == "passed", result.error
    assert result.figures["second_compiles"] == 0 and result.figures["warmup_and_first_compiles"] > 0
    assert 0 < result.figures["step_shapes"] <= 3


def test_serving_check_is_skipped_without_the_serve_extras(monkeypatch):
    selftest.discover()
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "fastapi" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    with pytest.raises(selftest.SkipCheck, match=r"serve extras are not installed \(fastapi\).*hf-tpu\[serve\]"):
        selftest.checks()["serving"].fn(selftest.CheckContext())
