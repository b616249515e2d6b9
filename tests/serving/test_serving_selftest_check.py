"""The ``serving`` self-test check is skipped naming the extras without them (that it passes on the simulated device
and compiles nothing after warm-up: tests/test_selftest.py's full self-test run checks its figures)."""

import importlib.util

import pytest

from hf_tpu import selftest


def test_serving_check_is_skipped_without_the_serve_extras(monkeypatch):
    selftest.discover()
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "fastapi" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    with pytest.raises(selftest.SkipCheck, match=r"serve extras are not installed \(fastapi\).*hf-tpu\[serve\]"):
        selftest.checks()["serving"].fn(selftest.CheckContext())
