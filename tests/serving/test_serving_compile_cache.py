"""Continuous batching with hf_tpu's persistent compile cache: a second process loads every step graph and compiles
nothing, and both processes equal CPU greedy ``generate``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers as T
from _cache_worker import NEW, SETTINGS, run
from _timeouts import SAFETY_TIMEOUT_S
from conftest import VOCAB, cpu_greedy, random_prompts

from hf_tpu import compile_cache, serving

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_cache_worker.py")


def _second_process(model_dir: Path, cache_dir: Path, prompts: list[list[int]]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", compile_cache.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(model_dir), str(cache_dir), json.dumps(prompts)], env=env,
        capture_output=True, text=True, check=False, timeout=SAFETY_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_step_graph_and_compiles_nothing(tmp_path):
    from hf_tpu.testing import tiny_config

    torch.manual_seed(3)
    cpu = T.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB)).eval()
    cpu.save_pretrained(tmp_path / "model")
    prompts = random_prompts([5, 40, 12], seed=2)  # 40 > 32 tokens a step: a chunked prefill
    expected = [cpu_greedy(cpu, p, NEW) for p in prompts]
    cache = tmp_path / "cache"
    saved = dataclasses.asdict(serving.SETTINGS)
    try:
        cold = run(str(tmp_path / "model"), str(cache), prompts)  # this process: compiles and stores
    finally:
        serving.configure(**saved)
    assert cold["tokens"] == expected and not cold["problems"]
    shapes = 3  # SETTINGS' ladder: query rung 32 x KV rungs 0, 256 and 512, one graph each
    assert SETTINGS["page_size"] == 256 and cold["compiles"] == shapes and cold["hits"] == 0
    warm = _second_process(tmp_path / "model", cache, prompts)
    assert warm["tokens"] == expected and not warm["problems"]
    assert warm["compiles"] == 0 and warm["hits"] == shapes


def test_hf_tpu_serve_stores_its_step_graphs_and_a_second_server_compiles_none(tmp_path):
    """``hf-tpu serve --compile-cache DIR`` twice on one directory: the first server compiles its step graphs and
    stores them, the second loads them all (its warm-up says 0 graphs compiled) and answers the same greedy text.
    (The server's warm-up hands the continuous batch a progress callback, which the stored graphs must not take as an
    input: a server stored nothing, "cannot pickle '_io.TextIOWrapper'", until hf_tpu/serving/_runner.py left it
    out.)"""
    import re

    from _server import running_server

    cache = tmp_path / "cache"
    body = {"prompt": "The king said", "max_tokens": 8, "temperature": 0}
    answers, warmups = [], []
    for _ in range(2):
        with running_server(tmp_path, "--compile-cache", str(cache)) as server:
            status, answer, _ = server.post("/v1/completions", body)
            assert status == 200, answer
            answers.append(answer["choices"][0]["text"])
            output = server.output()
        assert "cannot pickle" not in output and "CompileCacheWarning" not in output, output[-4000:]
        warmups.append(re.search(r"warm-up done in [\d.]+ s \((\d+) step shapes, (\d+) graphs compiled\)", output))
    assert all(warmups), warmups
    (shapes, first), (shapes_again, second) = (tuple(int(n) for n in w.groups()) for w in warmups)
    assert shapes == shapes_again > 0 and first >= shapes, (shapes, first)
    assert second == 0, second
    assert answers[0] == answers[1]
