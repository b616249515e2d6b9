"""``hf-tpu plan``'s figures today against docs/plan_records.json (scripts/plan_record.py), in the contract tier.

The record's real shape (the Llama-3-8B on v6e-1, docs/planning.md's table) takes minutes to lower and compile on a
2-core host, so it is not run here: ``python scripts/plan_record.py run llama-3-8b-v6e-1`` regenerates it. Its small
run (the same config cut to 2 layers, 256 wide) is run again: libtpu's counts are deterministic (two runs on one host
gave the same bytes, FLOPs, memory and XLA estimates; only the seconds differ), so every figure but the seconds must
equal the record's, and its object must have the real shape's structure.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_record", ROOT / "scripts" / "plan_record.py")
plan_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_record)

SMALL, REAL = "llama-3-8b-2-layers-v6e-1", "llama-3-8b-v6e-1"
#: What differs from run to run: this host's seconds.
TIMINGS = {"lower_seconds", "compile_seconds", "warmup_seconds"}


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _structure(plan: dict) -> dict:
    return {"keys": sorted(plan), "programs": [sorted(p) for p in plan["programs"]], "decode": sorted(plan["decode"]),
            "hbm": sorted(plan["hbm_bytes"]), "info": sorted(plan["info"])}  # fmt: skip


def test_the_small_plan_gives_the_recorded_figures_and_the_real_shapes_structure():
    record = plan_record.load()
    plan, _, status = plan_record.run_plan(SMALL, timeout=SAFETY_TIMEOUT_S)
    fresh = plan_record.record_entry(SMALL, plan, None, status)
    recorded = record["runs"][SMALL]
    assert fresh["command"] == recorded["command"] and status == recorded["exit_status"] == 0
    assert _without_timings(fresh["plan"]) == _without_timings(recorded["plan"]), (
        "hf-tpu plan's figures changed: if that is meant, python scripts/plan_record.py run "
        f"{SMALL} (and {REAL}, minutes), then python scripts/plan_record.py docs"
    )
    assert _structure(fresh["plan"]) == _structure(record["runs"][REAL]["plan"])
    assert plan_record.row(SMALL, fresh)[2:6] == plan_record.row(SMALL, recorded)[2:6]
