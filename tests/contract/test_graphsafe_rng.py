"""The simulator's graph-safe RNG registration (hf_tpu/sim/_rng.py) against torch-tpu 0.2.0's own.

The wheel's ``torch_tpu._internal.compile._initialize_graphsafe_rng`` runs here, in this process (torch_tpu is
autoloaded; the module imports on a host without chips), from a known starting state; the simulator's
registration runs from the same state in a subprocess started with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (the simulator
cannot run next to the wheel: tests/contract/test_simulator_vs_wheel.py). Both must leave torch in the same state.
What the registration is for (a compiled step recomputing checkpointed dropout): tests/sim/test_graphsafe_rng.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from _timeouts import SAFETY_TIMEOUT_S

# Puts torch in a known state unlike the registration's (neither device type registered, both flags flipped), and
# reads back what the registration changes.
STATE = textwrap.dedent(
    """
    import torch
    from torch._functorch import config
    from torch._functorch._aot_autograd import utils as aot_utils
    from torch._prims import rng_prims

    def start():
        aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES.difference_update({"privateuseone", "tpu"})
        config.graphsafe_rng_functionalization = False
        config.functionalize_rng_ops = True

    def state():
        return {
            "device_types": sorted(aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES),
            "graphsafe_rng_functionalization": config.graphsafe_rng_functionalization,
            "functionalize_rng_ops": config.functionalize_rng_ops,
            "dispatch_keys": sorted(str(k) for k in rng_prims._registered_graphsafe_dispatch_keys),
        }
    """
)

SIM = STATE + textwrap.dedent(
    """
    import json
    start()
    import hf_tpu
    import hf_tpu.sim

    gen = torch.tpu._get_generator(torch.device("tpu", 0))
    out = {
        "enabled": state(),
        "generator": {
            "is_default": gen is torch.tpu.default_generators[0],
            "device": str(gen.device),
            "clone_device": str(gen.clone_state().device),
            "graphsafe_get_state": type(gen.graphsafe_get_state()).__name__,
        },
    }
    hf_tpu.disable()
    out["disabled"] = state()
    print("SIM-JSON" + json.dumps(out))
    """
)


def _wheel_state() -> dict:
    from torch_tpu._internal import compile as tpu_compile

    namespace: dict = {}
    exec(STATE, namespace)  # noqa: S102 - the same helpers as the simulator's side
    from torch._functorch import config
    from torch._functorch._aot_autograd import utils as aot_utils

    saved = (set(aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES), config.graphsafe_rng_functionalization,
             config.functionalize_rng_ops)  # fmt: skip
    try:
        namespace["start"]()
        tpu_compile._initialize_graphsafe_rng()
        return namespace["state"]()
    finally:
        aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES.clear()
        aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES.update(saved[0])
        config.graphsafe_rng_functionalization, config.functionalize_rng_ops = saved[1:]


def _sim() -> dict:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("HF_TPU_EXPECT_TORCH_TPU", None)
    env.pop("HF_TPU_SIMULATE", None)
    proc = subprocess.run(
        [sys.executable, "-c", SIM], env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SIM-JSON"))
    return json.loads(line[len("SIM-JSON") :])


def test_the_simulator_registers_graphsafe_rng_as_the_wheel_does():
    # The wheel registered at autoload (torch 2.13 has register_graphsafe_rng_device_type), as it will on a TPU VM.
    from torch._functorch._aot_autograd import utils as aot_utils

    assert os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "1"
    assert {"privateuseone", "tpu"} <= aot_utils._GRAPHSAFE_RNG_DEVICE_TYPES
    wheel = _wheel_state()
    assert wheel == {
        "device_types": ["cuda", "privateuseone", "tpu"],
        "graphsafe_rng_functionalization": True,
        "functionalize_rng_ops": False,
        "dispatch_keys": ["DispatchKey.CUDA", "DispatchKey.PrivateUse1"],
    }
    sim = _sim()
    assert sim["enabled"] == wheel
    # hf_tpu.disable() puts the device types and the flags back; the dispatch registration stays (once per process).
    assert sim["disabled"] == {
        "device_types": ["cuda"],
        "graphsafe_rng_functionalization": False,
        "functionalize_rng_ops": True,
        "dispatch_keys": ["DispatchKey.CUDA", "DispatchKey.PrivateUse1"],
    }
    # What torch then asks of torch.tpu (register_graphsafe_rng_device_type's contract): the wheel's device module
    # has _get_generator (returning default_generators[idx]; its generators are C++ ones, not callable without a
    # chip); the simulator's returns its default generator, which has the graph-safe methods, on tpu:0.
    assert callable(torch.tpu._get_generator)
    assert sim["generator"] == {
        "is_default": True,
        "device": "tpu:0",
        "clone_device": "tpu:0",
        "graphsafe_get_state": "DeviceGenerator",
    }
