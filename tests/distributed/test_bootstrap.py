"""A simulated rank's bootstrap: the generation the launcher asked for, and the simulator's ``tpu_dist`` backend,
reached through :func:`hf_tpu.runtime.simulated_distributed` (hf_tpu.distributed never imports the simulator)."""

from __future__ import annotations

import os
import subprocess
import sys

from _timeouts import SAFETY_TIMEOUT_S

SCRIPT = """
import torch
import torch.distributed as dist

from hf_tpu import runtime

print("device:", runtime.detect().generation, torch.tpu.get_device_properties().total_memory)
print("backend:", "TPU_DIST" in dist.Backend._plugins, dist.Backend.default_device_backend_map.get("tpu"))
"""


def _run_rank(tmp_path, **env) -> str:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_TPU_SIM")}
    run_env.update(HF_TPU_SIMULATE="1", **env)
    done = subprocess.run(
        [sys.executable, "-m", "hf_tpu.distributed._bootstrap", "--script", str(script)],
        capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, env=run_env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_simulated_rank_gets_the_generation_asked_for_and_the_tpu_dist_backend(tmp_path):
    out = _run_rank(tmp_path, HF_TPU_SIM_GENERATION="v5e", HF_TPU_SIM_HBM=str(3 * 1024**3))
    assert "device: v5e 3221225472" in out, out
    assert "backend: True tpu_dist" in out, out
