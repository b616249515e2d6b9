"""``hf-tpu warmup``: the second run loads every graph from the cache directory the first one filled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hf_tpu.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", "HF_TPU_COMPILE_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", "warmup", "--simulate", *args], env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip


def test_second_run_compiles_nothing(tmp_path):
    from hf_tpu.testing import tiny_model

    model = tmp_path / "tiny"
    tiny_model("llama", model)
    args = (str(model), "--cache-dir", str(tmp_path / "cache"), "--max-prompt-len", "16", "--max-new-tokens", "4")
    first = _cli(*args, "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    cold = json.loads(first.stdout.strip().splitlines()[-1])
    assert cold["new_compiles"] == len(cold["graphs"]) > 0 and cold["from_cache"] == 0
    assert "hf_tpu warm-up" in first.stderr  # the progress bar
    second = _cli(*args, "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    warm = json.loads(second.stdout.strip().splitlines()[-1])
    assert warm["new_compiles"] == 0 and warm["from_cache"] == len(cold["graphs"]) and not warm["cache_problems"]
    # torch_tpu's own cache (mirrored by the simulator): every graph compile was a miss; loaded graphs are not
    assert cold["tpu_cache_requests"] >= cold["tpu_cache_misses"] >= cold["new_compiles"]
    assert warm["tpu_cache_misses"] <= cold["tpu_cache_misses"] - cold["new_compiles"]


def test_without_a_cache_dir_it_says_how_to_give_one(capsys, monkeypatch):
    monkeypatch.delenv("HF_TPU_COMPILE_CACHE", raising=False)
    assert main(["warmup", "--simulate", "some-model"]) == 2
    assert "give --cache-dir PATH (or set HF_TPU_COMPILE_CACHE)" in capsys.readouterr().err
