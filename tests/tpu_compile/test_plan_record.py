"""docs/planning.md's real-shape table is ``hf-tpu plan``'s output as committed in docs/plan_records.json
(scripts/plan_record.py), and today's plan arithmetic still gives the record's figures. No torch-tpu needed: the
contract tier (tests/contract/test_plan_record.py) runs the record's small plan again."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_record", ROOT / "scripts" / "plan_record.py")
plan_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_record)

RECORD = plan_record.load()


def _page_rows() -> dict[str, list[str]]:
    """The generated table's rows in docs/planning.md, parsed: label and target -> cells."""
    block = plan_record.page_table(plan_record.PAGE.read_text())
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| model shape")]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in rows]
    return {(c[0], c[1]): c for c in cells}


def _figure(cell: str) -> float:
    """A cell's figure in base units: ``16.06 GB`` -> 16.06e9, ``10.2 ms (98 tok/s)`` -> 10.2."""
    number, unit = re.match(r"([0-9.]+) ?(GB|MB|kB|ms|x)?", cell).groups()
    return float(number) * {"GB": 1e9, "MB": 1e6, "kB": 1e3}.get(unit, 1)


def test_the_pages_table_is_written_from_the_record():
    assert set(plan_record.DOC_ROWS) <= set(RECORD["runs"])
    assert plan_record.page_table(plan_record.PAGE.read_text()) == plan_record.table(RECORD), (
        "docs/planning.md's real-shape table differs from docs/plan_records.json: python scripts/plan_record.py docs"
    )


@pytest.mark.parametrize("name", plan_record.DOC_OUTPUTS)
def test_the_pages_plan_outputs_are_the_recorded_commands(name):
    """A plan's whole output on the page is what ``hf-tpu plan`` prints for the recorded figures."""
    block = plan_record.page_table(plan_record.PAGE.read_text(), *plan_record.output_markers(name))
    assert block == plan_record.output(name, RECORD), f"python scripts/plan_record.py docs ({name})"


@pytest.mark.parametrize("name", plan_record.DOC_ROWS)
def test_the_pages_figures_are_the_recorded_commands(name):
    """Each figure of the page's row, parsed back, is the recorded ``--json`` object's (to its printed digits)."""
    entry = RECORD["runs"][name]
    plan, decode = entry["plan"], entry["plan"]["decode"]
    cells = _page_rows()[(plan_record.RUNS[name]["label"], plan["target"])]
    for cell, value in zip(cells[2:5], (plan["hbm_bytes"][k] for k in ("weights", "kv_cache", "total"))):
        assert _figure(cell) == pytest.approx(value, rel=6e-3), (cell, value)
    assert cells[5] == ("yes" if plan["verdict"] == "fits" else plan["verdict"])
    assert _figure(cells[8]) == pytest.approx(decode["projected_ms"], abs=0.05)
    tokens = float(re.search(r"\(([0-9]+) tok/s\)", cells[8])[1])
    assert tokens == pytest.approx(decode["projected_tokens_per_second"], abs=0.5)
    assert _figure(cells[9]) == pytest.approx(decode["projected_ms_from_bytes_accessed"], abs=0.05)
    assert _figure(cells[10]) == pytest.approx(decode["bytes_over_floor"], abs=0.005)
    for cell, kind in ((cells[6], "prefill"), (cells[7], "decode")):
        [program] = [p for p in plan["programs"] if p["name"].split("-")[0] == kind]
        assert cell.startswith(program["name"] + ": ")
        lower, compile_ = map(float, re.findall(r"([0-9.]+) s", cell))
        assert (lower, compile_) == pytest.approx((program["lower_seconds"], program["compile_seconds"]), abs=0.05)


@pytest.mark.parametrize("name", sorted(RECORD["runs"]))
def test_todays_plan_arithmetic_gives_the_recorded_figures(name):
    """The record holds libtpu's counts; what the plan derives from them (the decode projection, tokens/s, the floor,
    the HBM total and verdict) is computed again by today's code and must be what the command printed. A change to
    the projection makes this fail: run the command again (scripts/plan_record.py run NAME) and rewrite the page."""
    plan = RECORD["runs"][name]["plan"]
    rebuilt = plan_record.rebuild(plan)
    assert rebuilt.verdict == plan["verdict"] and rebuilt.exit_status == plan["exit_status"]
    assert rebuilt.decode_summary() == pytest.approx(plan["decode"], rel=1e-12)
    hbm = plan["hbm_bytes"]
    compiled = [p for p in rebuilt.programs if p.compiled]
    assert hbm["temporaries"] == max(p.temp_bytes + p.output_bytes - p.alias_bytes for p in compiled)
    assert hbm["total"] >= hbm["weights"] + hbm["kv_cache"] + hbm["temporaries"]


@pytest.mark.parametrize("name", sorted(RECORD["runs"]))
def test_each_record_says_its_command_date_commit_and_versions(name):
    entry = RECORD["runs"][name]
    assert entry["command"] == " ".join(plan_record.command(name))
    assert entry["config_overrides"] == plan_record.RUNS[name].get("config", {})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]) and re.match(r"[0-9a-f]{40}", entry["commit"])
    assert all(entry["versions"][p] for p in ("torch-tpu", "libtpu", "jax", "transformers")), entry["versions"]
    assert entry["exit_status"] == entry["plan"]["exit_status"]


def test_the_plans_total_line_is_the_sum_of_the_lines_above_it():
    """The table the command prints for each recorded plan: weights + KV cache + temporaries (+ more needed) is the
    total, to the printed digits."""
    for entry in RECORD["runs"].values():
        text = plan_record.rebuild(entry["plan"]).table()
        figures = {}
        for line in text.splitlines():
            found = re.match(r"  (weights|KV cache|temporaries|more needed|total) +([0-9.]+ (?:GB|MB|kB))", line)
            if found:
                figures[found[1]] = _figure(found[2])
        parts = sum(v for k, v in figures.items() if k != "total")
        assert parts == pytest.approx(figures["total"], rel=1e-3, abs=0.011e9), text
