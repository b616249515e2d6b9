"""scripts/chip_bench.py: its report of the committed chip records is what docs/chip_v5e.json and hf_tpu's experts
table hold, and its chip parts run end to end on a CPU (interpret mode, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chip_bench.py"


def test_report_of_the_committed_records_is_what_the_docs_and_the_table_hold(tmp_path):
    rows, table = tmp_path / "rows.json", tmp_path / "table.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "report", "docs/chip_v5e_records.jsonl", "--rows", str(rows),
                           "--table", str(table)], cwd=ROOT, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    committed = json.loads((ROOT / "docs" / "chip_v5e.json").read_text())
    assert json.loads(rows.read_text())["rows"] == committed["rows"]
    shipped = json.loads((ROOT / "hf_tpu" / "kernels" / "experts_v5e.json").read_text())
    assert json.loads(table.read_text())["rows"] == shipped["rows"]
    for row in committed["rows"]:  # every row says its figures, its target and whether it was met
        assert {"name", "batch", "measured_s", "reference_s", "floor_s", "target", "met"} <= set(row)
        assert row["met"] in (True, False, None) and (row["target"] is not None or row["met"] is None)
    assert "**missed**" in proc.stdout and "| row |" in proc.stdout


@pytest.mark.slow
def test_chip_parts_run_on_a_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", CHIP_BENCH_TOKENS="1", CHIP_BENCH_BATCHES="1", CHIP_BENCH_LEAN="moe",
               CHIP_BENCH_LEAN_FORMS="kernel_decode slots", PYTHONPATH=str(ROOT))  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path), "--out", str(tmp_path), "--parts",
                           "floor", "experts", "lean", "--quick"], env=env, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records if "status" in r] == ["ok", "ok", "ok"]
    assert not [r for r in records if "error" in r]
    forms = {r["form"] for r in records if r.get("part") == "experts" and "measured_s" in r}
    assert {"kernel_decode", "kernel", "megablox", "ragged_dot", "dense", "slots"} <= forms
    # every form computes the same layer (bf16: within a few units of its last place)
    assert all(r["difference"] < 2e-2 for r in records if r.get("part") == "experts" and "difference" in r)
    assert {(r["form"], r["batch"]) for r in records if r.get("part") == "lean" and "synced_s" in r} == {
        ("kernel_decode", 1), ("slots", 1)}
