"""PyTorch's OpInfo float32 samples give the same results on the simulated tpu as on the CPU.

The comparison is PyTorch's own ``TestCommon.test_compare_cpu`` (samples made on the device, the same samples
moved to the CPU, ``output_process_fn_grad`` applied, atol = rtol = 1e-3, ops PyTorch skips there skipped).
Ops run in worker subprocesses, so that a crash cannot take the test run down: a crashed op is reported as a
failure and the worker resumes after it. Target: at least 99% of the samples that run on CPU, and no crash.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

WORKER = Path(__file__).with_name("_opinfo_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.99


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.pop("HF_TPU_SIMULATE", None)
    return env


def _run_range(start, stop):
    """Run ops [start, stop); on a crash, record the op and carry on after it."""
    results, crashes = [], []
    while start < stop:
        proc = subprocess.run(
            [sys.executable, str(WORKER), str(start), str(stop)],
            check=False,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=SAFETY_TIMEOUT_S,
        )
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        results += lines
        start += len(lines)
        if proc.returncode != 0 and start < stop:
            crashes.append((start, proc.returncode, proc.stderr[-500:]))
            start += 1  # skip the op that took the worker down
    return results, crashes


def test_opinfo_float32_matches_cpu():
    count = int(
        subprocess.run(
            [sys.executable, str(WORKER), "--count"],
            capture_output=True,
            text=True,
            env=_env(),
            check=True,
            timeout=SAFETY_TIMEOUT_S,
        ).stdout.strip()
    )
    chunks = 2
    bounds = [(i * count // chunks, (i + 1) * count // chunks) for i in range(chunks)]
    with ThreadPoolExecutor(chunks) as pool:
        parts = list(pool.map(lambda b: _run_range(*b), bounds))
    results = [r for part, _ in parts for r in part]
    crashes = [c for _, part in parts for c in part]
    total = sum(r["cpu_ok"] for r in results)
    equal = sum(r["equal"] for r in results)
    failing = sorted(
        ((r["cpu_ok"] - r["equal"], r["op"], r["failures"][0][1][:160]) for r in results if r["failures"]),
        reverse=True,
    )
    report = "\n".join(f"  {n:4d} samples  {name}: {msg}" for n, name, msg in failing)
    print(f"OpInfo float32: {equal}/{total} samples equal ({equal / max(total, 1):.2%}) over {len(results)} ops")
    print(report)
    assert not crashes, f"ops crashed the process (op index, returncode, stderr): {crashes}"
    assert len(results) == count, f"only {len(results)} of {count} ops reported"
    assert total > 10000, f"too few samples ran on CPU ({total}): the OpInfo harness is broken"
    assert equal / total >= TARGET, f"{equal}/{total} = {equal / total:.2%} < {TARGET:.0%}; failing ops:\n{report}"
