"""Start ``python -m hf_tpu.launch`` in a subprocess with a hard timeout, and find leftover processes.

On a timeout (or :func:`kill`) the launcher, its process group and every process it started are killed: torchrun
puts each rank in a session of its own, out of the launcher's process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def launch(args: list[str], *, timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run the launcher with ``args``; returns (exit code, combined output, seconds). Kills the whole process
    group on timeout (and then fails the test), so nothing is left running."""
    began = time.time()
    proc = start(args, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = kill(proc)
        raise AssertionError(f"the launcher did not finish within {timeout}s; output:\n{out[-6000:]}") from None
    return proc.returncode, out, time.time() - began


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


def start(args: list[str], *, env: dict | None = None) -> subprocess.Popen:
    """Start the launcher with ``args`` in its own process group (stop it with :func:`finish` or :func:`kill`)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "hf_tpu.launch", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> str:
    """SIGKILL the launcher, its process group and every process below it, then return its output.

    torchrun starts each rank in a session of its own, so killing the launcher's process group alone would leave
    the ranks running: they are found as the launcher's descendants first.
    """
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=SAFETY_TIMEOUT_S)
    out, _ = proc.communicate()
    return out


def finish(proc: subprocess.Popen, *, timeout: float) -> tuple[int, str]:
    """Wait for a launcher started with :func:`start`; on timeout kill its process group and fail the test."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = kill(proc)
        raise AssertionError(f"the launcher did not finish within {timeout}s; output:\n{out[-6000:]}") from None
    return proc.returncode, out
