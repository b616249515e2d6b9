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
    committed = json.loads((ROOT / "docs" / "chip_v5e.json").read_text())
    # the JAX client's records, and torch_tpu's for the images and training rows (scripts/chip_torch_tpu.py)
    assert committed["records"] == ["docs/chip_v5e_records.jsonl"]
    assert committed["torch_tpu_records"] == ["docs/chip_v5e_torch_tpu.jsonl"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "report", *committed["records"], "--torch-tpu-records",
                           *committed["torch_tpu_records"], "--rows", str(rows), "--table", str(table)], cwd=ROOT,
                          capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
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


def test_donated_aliases_each_kv_cache_to_its_updated_result_and_computes_the_same(monkeypatch):
    """``donated`` marks the k-th rank-4 argument of a type as the k-th rank-4 result of that type (the order in which
    hf_tpu's decode program returns its updated caches), XLA then takes those buffers (they are gone after a call),
    and two steps with the updated caches fed back equal the program as lowered. On JAX's CPU client."""
    import jax
    import jax.extend.backend
    import jax.numpy as jnp
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chip_bench

    def step(position, k0, weight, v0, k1, v1):  # two layers' K and V caches (batch, heads, slots, dim) and a weight
        row = jnp.tanh(k0[:, :, position - 1] @ weight)[:, :, None]
        caches = [jax.lax.dynamic_update_slice(c, row + i, (0, 0, position, 0))
                  for i, c in enumerate((k0, v0, k1, v1))]  # fmt: skip
        return (*caches, caches[-1].sum(axis=(1, 2)))

    shapes = [(), (2, 2, 8, 4), (4, 4), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)]
    specs = [jax.ShapeDtypeStruct(s, jnp.float32 if s else jnp.int32) for s in shapes]
    text = jax.jit(step).lower(*specs).as_text()
    aliased, pairs = chip_bench.donated(text)
    assert pairs == [(1, 0), (3, 1), (4, 2), (5, 3)]
    assert aliased.count("tf.aliasing_output") == 4 and "tf.aliasing_output" not in text

    backend, device = jax.extend.backend.get_backend("cpu"), jax.devices("cpu")[0]
    results = []
    for program, links in ((text, []), (aliased, pairs)):
        with jax_mlir.make_ir_context():
            executable = backend.compile_and_load(ir.Module.parse(program), xla_client.DeviceList((device,)),
                                                  xla_client.CompileOptions())  # fmt: skip
        key = jax.random.PRNGKey(0)
        arrays = [jax.device_put(jnp.int32(3), device)] + [
            jax.device_put(jax.random.normal(jax.random.fold_in(key, i), s), device) for i, s in enumerate(shapes[1:])]
        for position in (3, 4):
            arrays[0] = jax.device_put(jnp.int32(position), device)
            given = list(arrays)
            outs = executable.execute(arrays)
            for a, j in links:
                assert given[a].is_deleted()  # donated: XLA wrote the update into this buffer
                arrays[a] = outs[j]
            if not links:
                arrays[1], arrays[3], arrays[4], arrays[5] = outs[:4]
        results.append([jax.device_get(o) for o in outs])
    for got, want in zip(results[1], results[0], strict=True):
        assert (got == want).all()


def test_kv_write_forms_compute_the_lean_steps_tokens_on_a_cpu(tmp_path, monkeypatch):
    """scripts/chip_kv_write.py (tiny shapes, JAX's CPU client): the step that reads its caches without writing them,
    with the new rows written by one donated program or one per cache, feeds the same caches forward as the lean
    step: every form's greedy tokens after five steps are the lean step's, and each form's record is written."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chip_kv_write

    records = chip_kv_write.measure(tmp_path, [3], chip_kv_write.FORMS, quick=True)
    assert [r["form"] for r in records] == chip_kv_write.FORMS and not [r for r in records if "error" in r]
    assert all(r["last_ids"] == records[0]["last_ids"] for r in records)
    written = [json.loads(line) for line in (tmp_path / "kv_write.jsonl").read_text().splitlines()]
    assert [r["form"] for r in written] == chip_kv_write.FORMS


def test_rows_after_pairs_each_cache_with_its_row_and_slot(monkeypatch):
    """``rows_after`` reads a decode program that leaves its caches unwritten (HF_TPU_KV_WRITE=after): per layer a K
    row, a V row (one slot) and their slot among the results, the caches among the arguments in layer order; a
    program that writes its caches itself asks for no writes."""
    import jax
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chip_bench

    def read_only(position, k0, weight, v0, k1, v1):  # two layers' caches (batch, heads, slots, dim), read only
        row = jnp.tanh(k0[:, :, 0] @ weight)[:, :, None] + (v0 + k1 + v1)[:, :, :1]
        slot = (position + 0).reshape(1)
        tokens = (position + 1).reshape(1)  # (a batch of one's next tokens: the type of a slot)
        return tokens, row.sum(axis=(1, 2, 3)), row, row + 1, slot, row + 2, row + 3, slot

    def writes(position, k0, weight, v0, k1, v1):
        row = jnp.tanh(k0[:, :, 0] @ weight)[:, :, None] + (v0 + k1 + v1)[:, :, :1]
        return *(jax.lax.dynamic_update_slice(c, row, (0, 0, position, 0)) for c in (k0, v0, k1, v1)), row.sum()

    specs = [jax.ShapeDtypeStruct((), jnp.int64)] + [
        jax.ShapeDtypeStruct(s, jnp.float32) for s in [(2, 2, 8, 4), (4, 4), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)]]
    with jax.enable_x64(True):
        text = jax.jit(read_only).lower(*specs).as_text()
        assert chip_bench.rows_after(text) == [(1, 2, 4), (3, 3, 4), (4, 5, 7), (5, 6, 7)]
        assert chip_bench.rows_after(jax.jit(writes).lower(*specs).as_text()) == []
