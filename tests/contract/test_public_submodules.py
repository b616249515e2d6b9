"""The simulator's ``torch.tpu`` submodules export exactly the names torch-tpu 0.2.0's ``public_api`` lists.

The simulator cannot run where torch_tpu was autoloaded, so its names come from a subprocess started with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0 HF_TPU_SIMULATE=1``; this process reads the wheel's ``_PUBLIC_MODULES``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S
from torch_tpu._internal import public_api

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import json, sys, torch, hf_tpu
from hf_tpu.sim import _public_api
out = {}
for name in _public_api.EXPORTS:
    module = sys.modules[name]
    out[name] = sorted(set(module.__all__) | {n for n in dir(type(module)) if not n.startswith("_")} - {"mro"})
print(json.dumps(out))
"""


def test_the_simulators_submodules_export_the_wheels_names():
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", HF_TPU_SIMULATE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    simulated = json.loads(proc.stdout.strip().splitlines()[-1])
    wheel = {name: sorted(spec.exports) for name, spec in public_api._PUBLIC_MODULES.items() if name != "torch.tpu"}
    assert simulated == wheel
