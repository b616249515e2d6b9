"""torch_tpu's own launch recipe runs on four simulated chips, with no ``import hf_tpu`` anywhere.

The recipe (a ``launch.py`` that calls ``torch.tpu.distributed.set_tpu_launch_env()`` and then torchrun's ``main``,
run as ``python launch.py --nproc_per_node=4 generate.py``) relies on torch-tpu loading at ``import torch`` through
torch's device-backend autoload. With ``HF_TPU_SIMULATE=1``, hf_tpu's own ``torch.backends`` entry point
(pyproject.toml, ``hf_tpu/_autoload.py``) enables the simulated device in the launcher and in every rank. The entry
point is read from pyproject.toml into a dist-info on the children's path, as an install of hf_tpu writes it.
"""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from _launch_util import kill
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu.sim

ROOT = Path(__file__).resolve().parents[2]

LAUNCH = """\
import torch
from torch.distributed.run import main

torch.tpu.distributed.set_tpu_launch_env()
main()
"""
GENERATE = """\
import json
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], distributed_config=DistributedConfig(tp_size=4))
ids = torch.tensor([[1, 5, 9, 23, 77, 3]], device="tpu")
out = model.generate(ids, max_new_tokens=6, do_sample=False)
sharded = type(model.model.layers[0].self_attn.q_proj.weight).__name__
print("RESULT " + json.dumps({"rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(),
                              "device": str(out.device), "weight": sharded, "tokens": out.cpu().tolist()}), flush=True)
"""
PROMPT = [[1, 5, 9, 23, 77, 3]]


def _entry_point_dist_info(site: Path) -> None:
    """A dist-info with hf_tpu's torch.backends entry point, as ``pip install`` writes it from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    points = project["entry-points"]["torch.backends"]
    info = site / "hf_tpu_entry_points-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hf-tpu-entry-points\nVersion: 0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in points.items())
    (info / "entry_points.txt").write_text(f"[torch.backends]\n{lines}")


def _model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.distributed
def test_the_torch_tpu_launch_recipe_runs_tp4_generate_on_four_simulated_chips(tmp_path):
    assert "hf_tpu" not in LAUNCH + GENERATE
    (tmp_path / "launch.py").write_text(LAUNCH)
    (tmp_path / "generate.py").write_text(GENERATE)
    _entry_point_dist_info(tmp_path / "site")
    _model(tmp_path / "model")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_TPU_", "TORCH_DEVICE_BACKEND"))}
    env.update(HF_TPU_SIMULATE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path / "site")])
    proc = subprocess.Popen(
        [sys.executable, "launch.py", "--nproc_per_node=4", "generate.py", str(tmp_path / "model")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=SAFETY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = kill(proc)
        raise AssertionError(f"the recipe did not finish within {SAFETY_TIMEOUT_S}s:\n{out[-6000:]}") from None
    assert proc.returncode == 0, out[-6000:]
    decoder = json.JSONDecoder()  # ranks share stdout: a progress bar may follow on the same line
    results = sorted((decoder.raw_decode(part)[0] for part in out.split("RESULT ")[1:]), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3], out[-6000:]

    from transformers import AutoModelForCausalLM

    hf_tpu.sim.enable()
    one_chip = AutoModelForCausalLM.from_pretrained(tmp_path / "model").to("tpu")
    ref = one_chip.generate(torch.tensor(PROMPT, device="tpu"), max_new_tokens=6, do_sample=False).cpu().tolist()
    for r in results:
        assert r["world"] == 4 and r["device"] == "tpu:0" and r["weight"] == "DTensor", r
        assert r["tokens"] == ref, (r, ref)
