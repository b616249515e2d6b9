"""Self-test check of tensor parallelism: ``hf-tpu launch`` over this host's chips, sharded output equal to TP=1.

It is an exclusive check: the ranks it launches need every chip, so it runs before the checks that use the device
in the self-test process (which would otherwise hold the chips); see :mod:`hf_tpu.selftest`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hf_tpu import _env
from hf_tpu.errors import HfTpuRuntimeError
from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check

# No fixed limit around the launch (a slow or busy host must not fail it): the launcher itself stops every rank once
# one fails. HF_TPU_SELFTEST_TIMEOUT_S=<seconds> bounds it when a hang must end the check.
TIMEOUT_ENV = _env.SELFTEST_TIMEOUT_S.name


def _timeout() -> float | None:
    return _env.SELFTEST_TIMEOUT_S.get()  # None: wait; a value that is not a positive number raises


def _ranks(ctx: CheckContext) -> int:
    if ctx.simulated:
        return 2  # the launcher simulates a generation that runs 2 devices per host (v5p)
    from hf_tpu import _torch_tpu

    devices = ctx.info.chips_on_host  # torch_tpu's count: VFIO-exposed TPU devices (v7: already 2 per chip)
    counts = (
        [c for c in _torch_tpu.valid_counts(ctx.info.generation) if 2 <= c <= devices] if ctx.info.generation else []
    )
    if not counts:
        raise SkipCheck(
            f"tensor parallelism needs 2 or more TPU devices in a mesh torch_tpu runs; this host has {devices}"
        )
    return max(counts)


@register_check(
    "tensor_parallel",
    description="hf-tpu launch + DistributedConfig(tp_size=N): logits and greedy tokens equal TP=1",
    quick=False,
    order=90,
    exclusive=True,
)
def _tensor_parallel(ctx: CheckContext) -> dict[str, Any]:
    if ctx.info.mode == "none":
        raise SkipCheck("no tpu device (see the runtime check)")
    from hf_tpu.testing import tiny_model

    ranks = _ranks(ctx)
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_tp_") as tmp:
        model_dir = os.path.join(tmp, "model")
        # 2 KV heads: from 4 ranks on, hf_tpu has to replicate attention.
        sizes = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 64}
        tiny_model("llama", model_dir, num_attention_heads=8, num_key_value_heads=2, **sizes)
        cmd = [sys.executable, "-m", "hf_tpu.launch", f"--nproc_per_node={ranks}"]
        if ctx.simulated:
            cmd.append("--simulate")
        cmd += ["-m", "hf_tpu.distributed._tp_check", tmp, model_dir]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Own process group, so that a timeout (when one is asked for) stops the launcher and every rank it started.
        limit = _timeout()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired as err:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise HfTpuRuntimeError(f"the {ranks}-rank launch did not finish within {TIMEOUT_ENV}={limit:g}s") from err
        results = []
        for rank in range(ranks):
            path = Path(tmp) / f"rank{rank}.json"
            if not path.is_file():
                raise HfTpuRuntimeError(f"rank {rank} wrote no result; launcher output:\n{output[-3000:]}")
            results.append(json.loads(path.read_text()))
    for r in results:
        if "error" in r:
            raise HfTpuRuntimeError(f"rank {r['rank']} failed:\n{r['error']}")
        if not r["tokens_equal"]:
            raise CheckFailed(f"rank {r['rank']}: greedy tokens at TP={ranks} differ from TP=1")
        if r["max_abs_diff"] > 1e-3:
            raise CheckFailed(f"rank {r['rank']}: logits differ from TP=1 by {r['max_abs_diff']:.2e}")
    if proc.returncode != 0:
        raise HfTpuRuntimeError(f"the launcher exited with {proc.returncode}:\n{output[-3000:]}")
    return {
        "ranks": ranks,
        "max_abs_diff": max(r["max_abs_diff"] for r in results),
        "plan_fixes": ",".join(results[0]["fixes"]) or "none",
        "load_s": max(r["load_s"] for r in results),
        "generate_s": max(r["generate_s"] for r in results),
    }
