"""The simulator takes torch_tpu's CPU-host state over cleanly (tested without torch_tpu installed).

On a host without chips, torch-tpu 0.2.0's autoload leaves ``torch.tpu`` (its public module) and a dynamo
backend named ``"tpu"`` behind, with PrivateUse1 still unnamed. The test recreates that state in a fresh
interpreter, then enables the simulator.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys, types
    import torch
    from torch._dynamo.backends import registry

    # what torch_tpu's autoload leaves on a host without chips
    fake_tpu = types.ModuleType("torch.tpu")
    fake_tpu.device_count = lambda: 0
    torch.tpu = fake_tpu
    sys.modules["torch.tpu"] = fake_tpu
    def torch_tpu_backend(gm, example_inputs):
        raise AssertionError("torch_tpu's backend must not run in simulated mode")
    registry.register_backend(compiler_fn=torch_tpu_backend, name="tpu")
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"

    import hf_tpu.sim
    from hf_tpu.sim import _backend, _device

    assert torch.tpu is not fake_tpu and torch.accelerator.device_count() == 1
    assert sys.modules["torch.tpu"] is torch.tpu
    assert _device.TAKEN_OVER["torch.tpu"] is fake_tpu
    assert _backend.TAKEN_OVER["tpu"] is torch_tpu_backend
    x = torch.randn(4)
    f = torch.compile(lambda a: a.cos() * 2, backend="tpu")
    with hf_tpu.sim.stats() as s:
        y = f(x.to("tpu"))
    assert s.compiles == 1 and torch.allclose(y.cpu(), x.cos() * 2)
    hf_tpu.sim.enable()  # idempotent
    assert registry.lookup_backend("tpu") is _backend.tpu_backend
    print("OK")
    """
)


def test_takes_over_torch_tpu_state():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("HF_TPU_SIMULATE", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


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
