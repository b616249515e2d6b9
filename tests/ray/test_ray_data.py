"""HfTpuGenerate under Ray Data on a local 2-node cluster of simulated TPU VMs (hf_tpu.ray.local).

One job of prompts through ``map_batches(HfTpuGenerate, resources={"TPU": 1}, compute=ActorPoolStrategy(size=2))``:
one actor per node, every row equal to the CPU's greedy ``generate``, the second actor to start compiles nothing
(shared compile-cache directory); then the same job with one actor killed mid-run: Ray retries its batches (on the
other actor or on the killed one, which Ray restarts), no row is lost or doubled. Slow: a Ray cluster and two
model-loading actors on a 2-core host.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.assets import default_model_path
from hf_tpu.ray.local import cpu_greedy_rows, heldout_prompts, simulated_cluster

MODEL = str(default_model_path())  # the model that ships with hf_tpu, with its tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (--dist loadgroup)
ray = pytest.importorskip("ray")

PROMPTS = 48
BATCH = 4
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2) as c:
        context = ray.data.DataContext.get_current()
        saved, context.wait_for_min_actors_s = context.wait_for_min_actors_s, SAFETY_TIMEOUT_S
        try:  # the job starts once both actors are up, so that both start (and report) before it ends
            yield c
        finally:
            context.wait_for_min_actors_s = saved


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def expected():
    return cpu_greedy_rows(MODEL, heldout_prompts(PROMPTS), NEW_TOKENS)


def _job(cache_dir: Path, reports: Path):
    from hf_tpu.ray import HfTpuGenerate

    prompts = heldout_prompts(PROMPTS)
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    ds = ray.data.from_items(rows, override_num_blocks=PROMPTS // BATCH)
    kwargs = {"model": MODEL, "batch_size": BATCH, "max_new_tokens": NEW_TOKENS, "max_prompt_len": 16,
              "cache_dir": str(cache_dir), "start_reports": str(reports)}  # fmt: skip
    return ds.map_batches(HfTpuGenerate, fn_constructor_kwargs=kwargs, batch_size=BATCH, num_cpus=0,
                          resources={"TPU": 1}, compute=ray.data.ActorPoolStrategy(size=2))  # fmt: skip


def _reports(folder: Path) -> list[dict]:
    found = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    return sorted(found, key=lambda r: r["lock_wait_s"])


def _check_rows(rows: list[dict], expected: list[list[int]]) -> None:
    assert sorted(r["id"] for r in rows) == list(range(PROMPTS))  # every row once: none lost, none doubled
    by_id = {r["id"]: r for r in rows}
    assert [by_id[i]["error"] for i in range(PROMPTS)] == [None] * PROMPTS
    assert [list(by_id[i]["generated_token_ids"]) for i in range(PROMPTS)] == expected


def test_two_nodes_equal_cpu_greedy_and_the_second_actor_compiles_nothing(cluster, cache_dir, expected, tmp_path):
    rows = _job(cache_dir, tmp_path).take_all()
    _check_rows(rows, expected)
    first, second = _reports(tmp_path)  # in warm-up order: the second waited on the cache lock
    assert first["node_id"] != second["node_id"]  # one actor per simulated VM (its one "TPU")
    assert first["new_compiles"] == first["sim_compiles"] == first["graphs"] > 0
    assert second["new_compiles"] == second["sim_compiles"] == 0 and second["from_cache"] == first["graphs"]
    # Ray's TPU accelerator manager binds an actor holding 1 of a node's "TPU" to chip 0 (ray/_private/accelerators)
    assert first["tpu_visible_chips"] == second["tpu_visible_chips"] == "0"


def test_killing_an_actor_mid_run_loses_no_row(cluster, cache_dir, expected, tmp_path):
    rows, killed = [], []
    for row in _job(cache_dir, tmp_path).iter_rows():
        rows.append(row)
        if not killed:  # rows are coming back and more are queued: kill the actor that made the first one
            victim = _reports(tmp_path)[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
    assert killed and len(rows) > 1
    _check_rows(rows, expected)
    # at most one actor compiled the graphs, the first through the compile cache's lock (none where an earlier job of
    # this module stored them: the sweep's two-node test); every other, the killed one's restart too when it came up
    # before the job ended, loaded them
    reports = _reports(tmp_path)
    assert len(reports) >= 2 and sum(r["sim_compiles"] > 0 for r in reports) <= 1, reports
    assert sum(r["from_cache"] == r["graphs"] > 0 for r in reports) >= len(reports) - 1, reports
