"""Without a TPU and without the simulator, asking for one fails loudly instead of loading on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    import hf_tpu
    from hf_tpu import runtime
    assert runtime.detect().mode == "none", runtime.detect()
    hf_tpu.enable("device_map")
    from transformers import AutoModelForCausalLM
    for device_map in ("tpu", "tpu:0", {"": "tpu"}):
        try:
            AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map=device_map)
        except runtime.TPUNotAvailableError as exc:
            assert "HF_TPU_SIMULATE=1" in str(exc), exc
            print("raised", device_map)
        else:
            print("loaded", device_map)
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="auto", max_memory={"tpu": "1GiB"})
    except runtime.TPUNotAvailableError:
        print("raised max_memory")
    """
)


def test_device_map_tpu_without_tpu_raises(untied_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(untied_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=SAFETY_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:4] == [
        "raised tpu",
        "raised tpu:0",
        "raised {'': 'tpu'}",
        "raised max_memory",
    ], result.stdout
