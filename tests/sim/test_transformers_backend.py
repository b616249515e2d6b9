"""transformers' own test-suite hook: ``TRANSFORMERS_TEST_BACKEND=hf_tpu.sim TRANSFORMERS_TEST_DEVICE=tpu``.

``transformers/testing_utils.py`` imports the module named by ``TRANSFORMERS_TEST_BACKEND``, then takes
``TRANSFORMERS_TEST_DEVICE`` as ``torch_device`` after checking ``is_torch_tpu_available()``; every model test moves
its models and inputs there. Importing ``hf_tpu.sim`` must therefore enable the simulated device by itself. The
model tests themselves live in transformers' repository, not in its wheel: ``scripts/run_transformers_tests.py`` runs
them on both devices (see docs/simulator.md); this test checks the hook in a fresh process, as pytest would see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.testing_utils import backend_manual_seed, torch_device
from transformers.utils import is_torch_tpu_available

cfg = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, pad_token_id=0, eos_token_id=2)
backend_manual_seed(torch_device, 0)
cpu = LlamaForCausalLM(cfg).eval()
dev = LlamaForCausalLM(cfg).eval()
dev.load_state_dict(cpu.state_dict())
dev.to(torch_device)
ids = torch.randint(3, 99, (3, 7))
with torch.no_grad():
    out = dev(ids.to(torch_device)).logits
    torch.testing.assert_close(out.cpu(), cpu(ids).logits)
    same = torch.equal(cpu.generate(ids, max_new_tokens=4, do_sample=False),
                       dev.generate(ids.to(torch_device), max_new_tokens=4, do_sample=False).cpu())
print(json.dumps({"torch_device": torch_device, "tpu_available": is_torch_tpu_available(),
                  "out_device": str(out.device), "generate_matches_cpu": same}))
"""


def test_transformers_test_env_runs_models_on_the_simulated_tpu():
    env = {**os.environ, "TRANSFORMERS_TEST_BACKEND": "hf_tpu.sim", "TRANSFORMERS_TEST_DEVICE": "tpu"}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.pop("HF_TPU_SIMULATE", None)  # the backend module alone must enable the device
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "torch_device": "tpu",
        "tpu_available": True,
        "out_device": "tpu:0",
        "generate_matches_cpu": True,
    }
