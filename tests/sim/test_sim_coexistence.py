"""The simulator next to the states it can meet in the main venv: a host with chips (refused), HF_TPU_SIMULATE.

With torch-tpu 0.2.0 installed, the simulator either meets nothing of torch_tpu (autoload off) or refuses (autoload
on): both are tested against the real wheel in tests/test_coexistence.py.
"""

import os
import subprocess
import sys
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def test_refuses_on_host_with_real_chips(monkeypatch):
    import pytest

    import hf_tpu.sim
    from hf_tpu import runtime

    monkeypatch.setattr(runtime, "scan_pci_chips", lambda *a, **k: (4, "v6e"))
    with pytest.raises(RuntimeError, match="real TPU chip"):
        hf_tpu.sim.enable()


def test_env_var_enables_at_import_hf_tpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0", HF_TPU_SIMULATE="1")
    code = (
        "import torch, hf_tpu\n"
        "assert hf_tpu.runtime.detect().mode == 'simulated'\n"
        "assert torch.ones(2, device='tpu').device.type == 'tpu'\n"
        "print('OK')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
