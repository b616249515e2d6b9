"""The chip tier's plumbing, in the core tier (no ``chip`` marker, no device): where the tier runs and how its cases
skip elsewhere, their order, and the records written as the cases come."""

from __future__ import annotations

import json
from types import SimpleNamespace

import _chip_tier
import pytest
from _chip_tier import (
    COMMAND,
    ChipRecords,
    Comparison,
    TierMode,
    comparison_property,
    header,
    session_selects_tier,
    skip_and_order,
    tier_mode,
)

from hf_tpu.runtime import PciScan

NO_CHIP = PciScan(0, 0, None)
ONE_CHIP = PciScan(1, 1, "v5e")


def test_where_the_tier_runs(monkeypatch):
    assert tier_mode({"HF_TPU_CHIP_TIER": "simulate"}, scan=NO_CHIP).mode == "simulate"
    ci = tier_mode({}, scan=NO_CHIP)
    assert ci.mode is None and COMMAND in ci.reason and "HF_TPU_CHIP_TIER=simulate" in ci.reason
    assert tier_mode({"HF_TPU_CHIP_TIER": "bogus"}, scan=ONE_CHIP).mode is None
    monkeypatch.setattr(_chip_tier, "_version", lambda name: None)
    monkeypatch.setattr(_chip_tier.importlib.util, "find_spec", lambda name: None)
    assert "torch-tpu is not installed" in tier_mode({}, scan=ONE_CHIP).reason
    monkeypatch.setattr(_chip_tier, "_version", lambda name: "0.2.0")
    real = tier_mode({}, scan=ONE_CHIP)
    assert (real.mode, real.generation, real.chips) == ("real", "v5e", 1)
    alone = tier_mode({}, scan=ONE_CHIP, selected=False)  # a chip, but the tier is not the session's selection
    assert alone.mode is None and "runs alone" in alone.reason and COMMAND in alone.reason


def test_a_session_selects_the_tier_with_dash_m_chip_outside_xdist():
    assert session_selects_tier("chip", {})
    assert session_selects_tier("chip and not slow", {})
    assert not session_selects_tier("not slow and not docs_heavy", {})  # pyproject's addopts: the README's command
    assert not session_selects_tier("not chip", {})
    assert not session_selects_tier("chip", {"PYTEST_XDIST_WORKER": "gw0"})


class _Item:
    def __init__(self, name: str, order: int | None = None, chip: bool = True) -> None:
        self.name, self.marks = name, []
        self.chip = pytest.mark.chip(order=order).mark if order is not None else pytest.mark.chip.mark
        self.is_chip = chip

    def get_closest_marker(self, name):
        if name == "chip" and self.is_chip:
            return self.chip
        return next((m.mark for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark)


def test_chip_cases_skip_with_the_command_and_run_in_their_order():
    items = [_Item("other", chip=False), _Item("gen"), _Item("serve", 0), _Item("other2", chip=False),
             _Item("selftest", 1)]  # fmt: skip
    skip_and_order(items, TierMode(None, "needs a TPU chip"))
    assert [i.name for i in items] == ["other", "serve", "selftest", "other2", "gen"]  # others keep their places
    assert [bool(i.marks) for i in items] == [False, True, True, False, True]
    assert items[1].marks[0].kwargs["reason"] == "needs a TPU chip"
    runs = [_Item("gen"), _Item("serve", 0)]
    skip_and_order(runs, TierMode("simulate"))
    assert [i.name for i in runs] == ["serve", "gen"] and not any(i.marks for i in runs)


def _report(nodeid, when, outcome, duration, props=(), longrepr=None):
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration, skipped=outcome == "skipped",
                           failed=outcome == "failed", passed=outcome == "passed", longrepr=longrepr,
                           user_properties=list(props))  # fmt: skip


def test_records_are_written_as_the_cases_come(tmp_path):
    path = tmp_path / "chip.json"
    records = ChipRecords(path, header(TierMode("simulate"), {"HF_TPU_COMMIT": "abc123"}))
    head = json.loads(path.read_text())
    assert head["commit"] == "abc123" and head["mode"] == "simulate" and head["rows"] == []
    assert {"date", "device", "torch", "torch_tpu", "libtpu", "transformers"} <= set(head)

    close = comparison_property(Comparison("logits", "medium", 4e-3, 1e-3))
    worse = comparison_property(Comparison("hidden", "medium", 4e-3, 3e-3))
    tokens = comparison_property(Comparison("tokens", "highest", 0.0, 0.0))
    records.add(_report("tests/chip/a.py::t", "setup", "passed", 0.5))
    records.add(_report("tests/chip/a.py::t", "call", "passed", 1.25, [close, worse, tokens]))
    row = json.loads(path.read_text())["rows"][0]  # on disk before the case's teardown
    assert row == {"test": "tests/chip/a.py::t", "passed": True, "outcome": "passed", "seconds": 1.75,
                   "precision": "medium", "tolerance": 4e-3, "max_err": 3e-3, "reason": None}  # fmt: skip
    records.add(_report("tests/chip/a.py::t", "teardown", "passed", 0.25))
    records.add(_report("tests/chip/b.py::t", "setup", "skipped", 0.0, longrepr=("f", 1, "Skipped: needs diffusers")))
    differ = comparison_property(Comparison("tokens", "highest", 0.0, 3.0))
    records.add(_report("tests/chip/c.py::t", "call", "failed", 2.0, [differ, close]))
    data = json.loads(path.read_text())
    a, b, c = data["rows"]
    assert a["seconds"] == 2.0 and a["passed"] is True
    assert (b["outcome"], b["passed"], b["reason"]) == ("skipped", None, "needs diffusers")
    assert (c["outcome"], c["passed"], c["tolerance"], c["max_err"]) == ("failed", False, 0.0, 3.0)
    assert data["summary"] == {"passed": 1, "failed": 1, "skipped": 1}
