"""Start ``python -m hf_tpu.launch`` in a subprocess with a hard timeout, and find leftover processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def launch(args: list[str], *, timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run the launcher with ``args``; returns (exit code, combined output, seconds). Kills the whole process
    group on timeout (and then fails the test), so nothing is left running."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.update(env or {})
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_tpu.launch", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the launcher did not finish within {timeout}s; output:\n{out[-6000:]}") from None
    return proc.returncode, out, time.time() - start


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``marker`` (zombies excluded)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
