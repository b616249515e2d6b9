"""Data-parallel training over ``hf-tpu launch --simulate`` (2 ranks, one simulated chip each), with hf_tpu's helpers,
with torch's DistributedDataParallel and with the Trainer, equals one chip trained on the doubled batch, computed here
in the test process, and the same training on the CPU without hf_tpu. The launch has a timeout and leaves no
process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _dp_data import GLOBAL_BATCH, global_batches, train, trainer_losses
from _launch_util import launch, processes_mentioning
from _reference import without_hf_tpu

from hf_tpu.training import data_parallel as dp
from hf_tpu.training.checks import TPUTrainingError

pytestmark = [pytest.mark.distributed]
WORKER = "tests/training/_dp_worker.py"
STEPS = 3


# hf_tpu's helpers and DDP share one launch (each rank trains a fresh model with each, over the one process group
# dp.init makes); the Trainer gets a launch of its own, since it must initialise the process group itself.
LAUNCHES = {"hf_tpu": "hf_tpu,ddp", "ddp": "hf_tpu,ddp", "trainer": "trainer"}


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """``launched(mode)``: the ranks' results of ``mode``, from the launch of :data:`LAUNCHES` (once per module)."""
    done: dict[str, list[dict]] = {}

    def _ranks(mode: str) -> list[dict]:
        modes = LAUNCHES[mode]
        if modes not in done:
            out = tmp_path_factory.mktemp("dp")
            code, log, _ = launch(
                ["--simulate", "--nproc_per_node=2", WORKER, str(out), str(model_dir), str(STEPS), modes],
                timeout=SAFETY_TIMEOUT_S,
            )
            assert code == 0, log[-6000:]
            assert not processes_mentioning(str(out)), "ranks left running after the launcher exited"
            done[modes] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        results = done[modes]
        for r in results:
            assert "error" not in r, r["error"]
            assert r["world_size"] == 2
        return [r["modes"][mode] for r in results]

    return _ranks


@pytest.mark.parametrize("mode", ["hf_tpu", "ddp", "trainer"])
def test_two_chips_equal_one_chip_with_the_doubled_batch(launched, load, tmp_path, mode):
    """``hf_tpu``: hf_tpu.training.data_parallel; ``ddp``: torch's DistributedDataParallel over ``tpu_dist``;
    ``trainer``: ``transformers.Trainer`` with ``hf_tpu.enable()``, which makes the launched ranks one accelerate
    data-parallel run (DistributedDataParallel, the batches sharded by the Trainer)."""
    ranks = launched(mode)
    for r in ranks:
        assert r["local_rows"] == GLOBAL_BATCH // 2 and r["device"] == "tpu:0"

    if mode == "trainer":
        assert ranks[0]["backend"] == "cpu:gloo,tpu:tpu_dist"
        one_chip = trainer_losses(load("tpu"), STEPS, 1, str(tmp_path / "one_chip"))
        with without_hf_tpu():  # the same run on the CPU, upstream code only
            cpu = trainer_losses(load("cpu"), STEPS, 1, str(tmp_path / "cpu"), use_cpu=True)
    else:
        one_chip = train(load("tpu"), global_batches(STEPS))
        with without_hf_tpu():
            cpu = train(load("cpu"), global_batches(STEPS))
    assert len(one_chip) == STEPS
    torch.testing.assert_close(ranks[0]["losses"], one_chip, rtol=1e-5, atol=1e-5)
    # and against the CPU without hf_tpu: a bug hf_tpu shared between the launch and the one-chip run cannot cancel
    torch.testing.assert_close(ranks[0]["losses"], cpu, rtol=1e-5, atol=1e-5)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], abs=1e-9)  # replicas stay identical
    # Half the batch on one chip is a different run: the comparison above can fail.
    half = train(load("tpu"), [dp.shard_batch(b, 0, 2) for b in global_batches(STEPS)])
    assert abs(half[-1] - one_chip[-1]) > 1e-4


def test_errors_without_a_launcher(monkeypatch, load):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(TPUTrainingError, match="hf-tpu launch --nproc_per_node"):
        dp.init()
    with pytest.raises(ValueError, match="does not split evenly"):
        dp.shard_batch({"input_ids": torch.zeros(3, 4)}, 0, 2)
    with pytest.raises(TPUTrainingError, match="before wrap"):
        dp.wrap(load("tpu"))
