"""Diffusers' TensorParallelConfig on the launcher: a Flux pipeline with its transformer sharded over 2 simulated
chips makes the same image as the unsharded one (upstream does the sharding; hf_tpu provides the launcher, the
simulated device and the tpu_dist collectives)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_tpu.diffusers.testing import tiny_flux_pipeline

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_flux_tp_worker.py")


def _launch(args: list[str], timeout: float) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_tpu.launch", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks share the session
        out, _ = proc.communicate()
        pytest.fail(f"the launcher did not finish within {timeout}s:\n{out[-4000:]}")
    return proc.returncode, out


@pytest.mark.distributed
def test_flux_tp2_image_equals_tp1(tmp_path):
    path = tiny_flux_pipeline(tmp_path / "flux")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, log = _launch(["--simulate", "--nproc_per_node=2", str(WORKER), str(out_dir), "2", path], timeout=540)
    assert code == 0, log[-4000:]
    images = []
    for rank in (0, 1):
        info = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert info["world_size"] == 2 and info["device"] == "tpu:0"
        # 2 heads x 16 = 32 rows of to_q, split by rows over the 2 ranks
        assert info["to_q"] == "DTensor" and info["placements"] == ["S(0)"] and info["local_shape"] == [16, 32]
        data = np.load(out_dir / f"rank{rank}.npz")
        np.testing.assert_allclose(data["sharded"], data["reference"], atol=1e-5)
        images.append(data["sharded"])
    np.testing.assert_array_equal(images[0], images[1])
