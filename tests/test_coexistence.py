"""hf_tpu next to the real backend: torch-tpu 0.2.0 installed on a host without TPU chips.

Runs in the second environment of ``.ci/run`` (``.venv-tpu``). There, ``import torch`` autoloads torch_tpu
(its ``torch.backends`` entry point), which registers ``torch.tpu`` and the ``"tpu"`` compile backend but, with
no chips, no ``tpu`` device. hf_tpu must still import, report the environment, and run the simulated device,
both with torch_tpu autoloaded and with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. Each case is a fresh process,
since autoload happens once, when torch is imported.

In an environment without torch-tpu (the main test venv) the module is skipped, unless
``HF_TPU_EXPECT_TORCH_TPU=1`` (set by ``.ci/run``) says torch-tpu must be there.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu import runtime

REPO = Path(__file__).resolve().parents[1]


def _torch_tpu_version() -> str | None:
    try:
        return importlib.metadata.version("torch-tpu")
    except importlib.metadata.PackageNotFoundError:
        return None


TORCH_TPU = _torch_tpu_version()
if TORCH_TPU is None:
    if os.environ.get("HF_TPU_EXPECT_TORCH_TPU") == "1":
        raise RuntimeError("HF_TPU_EXPECT_TORCH_TPU=1 but torch-tpu is not installed in this environment")
    pytest.skip(
        "torch-tpu is not installed here; .ci/run runs this module in .venv-tpu, which has torch-tpu 0.2.0",
        allow_module_level=True,
    )
if runtime.scan_pci().functions:
    pytest.skip("this host has TPU chips; the coexistence checks are for hosts without chips", allow_module_level=True)

AUTOLOAD = {"autoload": None, "no-autoload": "0"}


def run_python(
    code: str | None, autoload: str | None, *args: str, timeout: float = SAFETY_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Run ``code`` (or, if None, the command ``args``) in a fresh process with torch_tpu's autoload on or off."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    if autoload is not None:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = autoload
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = list(args) if code is None else [sys.executable, "-c", textwrap.dedent(code), *args]
    # A timeout here is the symptom of libtpu being initialised on a host without chips (it waits for the cloud
    # metadata server): hf_tpu must never do that.
    proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("autoload", AUTOLOAD.values(), ids=AUTOLOAD.keys())
def test_import_hf_tpu_loads_no_backend(autoload):
    run_python(
        """
        import sys, hf_tpu, hf_tpu.runtime
        heavy = [m for m in ("torch", "torch_tpu", "jax", "transformers", "diffusers") if m in sys.modules]
        assert not heavy, heavy
        info = hf_tpu.runtime.detect()
        assert info.mode == "none" and info.torch_tpu_version is not None, info
        """,
        autoload,
    )


@pytest.mark.parametrize("autoload", AUTOLOAD.values(), ids=AUTOLOAD.keys())
@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "simulate"])
def test_hf_tpu_env(autoload, simulate):
    args = ["--simulate", "env", "--json"] if simulate else ["env", "--json"]
    script = Path(sys.executable).with_name("hf-tpu")  # the console script, when hf-tpu is pip-installed here
    if script.is_file():
        code, args = None, [str(script), *args]
    else:
        code = "import sys; from hf_tpu.cli.main import main; sys.exit(main(sys.argv[1:]))"
    proc = run_python(code, autoload, *args)
    report = json.loads(proc.stdout)
    assert report["versions"]["torch-tpu"] == TORCH_TPU == "0.2.0"
    assert report["versions"]["libtpu"] == importlib.metadata.version("libtpu")
    # --simulate turns torch_tpu's autoload off for its own process (before torch is imported).
    assert report["torch_tpu_autoload"] is (autoload is None and not simulate)
    rt = report["runtime"]
    if simulate:
        assert rt["mode"] == "simulated" and rt["device_count"] == 1 and rt["hbm_bytes"] > 0
    else:
        assert rt["mode"] == "none" and "no TPU chips" in rt["reason"]
        assert any("--simulate" in p["fix"] for p in report["problems"]), report["problems"]
        assert not any(p["level"] == "error" for p in report["problems"]), report["problems"]


def test_hf_tpu_simulate_env_var_keeps_torch_tpu_out():
    """HF_TPU_SIMULATE=1 at `import hf_tpu` (before torch) turns torch-tpu's autoload off and simulates."""
    proc = run_python(
        """
        import os, sys
        os.environ["HF_TPU_SIMULATE"] = "1"
        import hf_tpu, torch
        assert "torch_tpu" not in sys.modules
        assert hf_tpu.runtime.detect().mode == "simulated"
        assert torch.ones(2, device="tpu").device.type == "tpu"
        """,
        None,
    )
    assert proc.returncode == 0


def test_simulator_refuses_cleanly_after_torch_tpu_autoloaded():
    """`import torch` first with autoload on: torch_tpu's kernels own PrivateUse1 and need chips. The simulator
    must refuse at once, with the fix, leaving torch untouched (never hang on libtpu, never crash)."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        assert "torch_tpu" in sys.modules
        name = torch._C._get_privateuse1_backend_name()
        import hf_tpu.sim
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "torch-tpu was autoloaded" in proc.stderr and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in proc.stderr
    assert "HF_TPU_SIMULATE=1" in proc.stderr


@pytest.mark.parametrize("how", ["no-autoload", "simulate-before-torch"])
def test_simulator_runs_a_tiny_model_like_cpu(how):
    prefix = 'import os; os.environ["HF_TPU_SIMULATE"] = "1"; import hf_tpu' if how == "simulate-before-torch" else ""
    body = textwrap.dedent(
        """
        import sys
        import torch
        autoloaded = "torch_tpu" in sys.modules
        if not autoloaded and "hf_tpu.sim" not in sys.modules:  # what the simulator meets: nothing of torch_tpu
            from torch._dynamo.backends import registry
            assert getattr(torch, "tpu", None) is None and "tpu" not in registry.list_backends(exclude_tags=())
            assert torch._C._get_privateuse1_backend_name() == "privateuseone"
        import hf_tpu.sim
        hf_tpu.sim.enable()
        from transformers import LlamaConfig, LlamaForCausalLM

        x = torch.arange(12.0).reshape(3, 4)
        y = x.to("tpu")
        assert y.device.type == "tpu", y.device
        assert torch.equal((y * 2).cpu(), x * 2)

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 128, (2, 7))
        with torch.no_grad():
            expected = model(ids).logits
            got = model.to("tpu")(ids.to("tpu")).logits
        assert got.device.type == "tpu"
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
        print("autoloaded" if autoloaded else "not-autoloaded")
        """,
    )
    proc = run_python(prefix + "\n" + body, "0" if how == "no-autoload" else None)
    # Both ways keep torch_tpu's kernels out of the process (in the second, autoload is on in the environment).
    assert proc.stdout.strip().splitlines()[-1] == "not-autoloaded"
