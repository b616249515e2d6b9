"""``hf-tpu serve``'s refusals before it loads anything (no server started)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from _server import ROOT
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.cli.serve import EXIT_PORT_TAKEN


def test_a_taken_port_is_refused_in_one_line_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "hf_tpu.cli", "serve", "--simulate", "--port", str(port)], capture_output=True,
            text=True, timeout=SAFETY_TIMEOUT_S, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
    assert proc.returncode == EXIT_PORT_TAKEN != 0, (proc.stdout, proc.stderr)
    [line] = proc.stderr.strip().splitlines()
    assert f"port {port}" in line and "--port" in line and "taken" in line
    assert proc.stdout == ""  # nothing loaded, nothing warmed up, never "listening"
