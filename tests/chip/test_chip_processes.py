"""Chip cases that run processes of their own on the chip: the persistent compile cache (a second process compiles
nothing) and ``hf-tpu serve`` on a unix socket (the lent chip machine opens no TCP socket, not even on loopback).

They run first (``chip(order=0)``): torch_tpu gives the chip to the first process that uses it, and this pytest
process opens it only after them (the ``tpu`` fixture). Each child has a timeout (``HF_TPU_CHIP_SUBPROCESS_S``, else
the suite's safety timeout) and is killed with its process group when it passes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _chip_tier import COMMAND, REPO, device_opened, subprocess_seconds

pytestmark = pytest.mark.chip(order=0)

WORKER = Path(__file__).with_name("_chip_worker.py")
SERVED = "tiny-shakespeare"
# The smallest ladder the shipped model allows (tests/serving/_server.py): 3 step shapes to compile.
SMALL_FLAGS = ["--slots", "4", "--max-batch-tokens", "32", "--min-step-tokens", "32"]
# The server's float32 matmuls at 'highest' (greedy tokens against the CPU's): set before hf-tpu serve starts.
SERVE_HIGHEST = (
    "import sys, torch; torch.set_float32_matmul_precision('highest'); "
    "from hf_tpu.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def child_env(mode: str) -> dict[str, str]:
    """A child's environment: torch_tpu autoloaded on a chip, the simulator kept for ``--simulate`` elsewhere."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TPU_SIMULATE", "HF_TPU_COMPILE_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1" if mode == "real" else "0"
    if mode == "simulate":
        env["HF_TPU_SIM_MATMUL_PRECISION"] = "highest"
    return env


def _chip_is_free(mode: str) -> None:
    if mode == "real" and device_opened():
        pytest.fail(f"this pytest process already holds the chip: run the tier whole, in its order (`{COMMAND}`): "
                    "the cases with processes of their own come first")  # fmt: skip


def run_child(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end, or kill its process group at the tier's subprocess timeout."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=subprocess_seconds())
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[1:3]} passed {subprocess_seconds():.0f} s and was killed:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_a_second_process_loads_every_graph_from_the_compile_cache_and_equals_cpu(chip_mode, chip, needs, tmp_path):
    """Two processes warm up the same tiny Llama (batch 2, prompts up to 16 tokens, 6 new) with one cache directory:
    the first compiles every graph, the second loads them all and compiles none; both generate the CPU's tokens."""
    needs("transformers")
    _chip_is_free(chip_mode)
    from _chip_models import saved_decoder

    model = saved_decoder("llama", tmp_path / "llama", vocab_size=96)
    results = []
    for _ in range(2):
        proc = run_child([sys.executable, str(WORKER), chip_mode, str(model), str(tmp_path / "cache")],
                         child_env(chip_mode))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = results
    assert cold["mode"] == warm["mode"] == ("real" if chip_mode == "real" else "simulated")
    chip.tokens([cold["differing_tokens"], warm["differing_tokens"]], [0, 0], what="tokens differing from the CPU's")
    assert cold["new_compiles"] == cold["graphs"] > 0 and cold["from_cache"] == 0, cold
    chip.count(warm["new_compiles"], what="graphs the second process compiled")
    assert warm["from_cache"] == warm["graphs"] == cold["graphs"] and not warm["problems"], warm


def _serve_has_uds() -> bool:
    from hf_tpu.cli import serve

    parser = serve.register(argparse.ArgumentParser().add_subparsers())
    return "--uds" in parser._option_string_actions


def _http_library():
    """The HTTP library the installed openai client is built on: ``httpx2`` (openai 3) or ``httpx`` (openai 1-2)."""
    import importlib
    import importlib.util

    for name in ("httpx2", "httpx"):
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    pytest.skip("needs httpx: pip install openai (it brings its HTTP library)")


def test_serve_answers_the_openai_client_over_a_unix_socket(chip_mode, chip, needs):
    """``hf-tpu serve --uds PATH`` (the shipped model, the small step ladder, float32 matmuls at 'highest'): once
    ``/health`` says ready, the openai client (its HTTP library's client over the socket) lists the served model and
    gets the CPU's greedy text for two completions and a streamed one."""
    needs("transformers", "fastapi", "uvicorn", "openai", "prometheus_client")
    if not _serve_has_uds():
        pytest.skip("hf-tpu serve has no --uds PATH flag yet (hf_tpu/cli/serve.py): the chip machine allows no TCP "
                    "socket, so the server is tested over a unix socket only")  # fmt: skip
    _chip_is_free(chip_mode)
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tpu.assets import default_model_path

    folder = tempfile.mkdtemp(prefix="hf-tpu-chip-")  # (a unix socket's path must stay under ~108 bytes)
    sock = os.path.join(folder, "serve.sock")
    log = Path(folder) / "serve.log"
    cmd = [sys.executable, "-c", SERVE_HIGHEST, "serve", *(["--simulate"] if chip_mode == "simulate" else []),
           "--uds", sock, "--served-model-name", SERVED, *SMALL_FLAGS]  # fmt: skip
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, env=child_env(chip_mode), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    httpx = _http_library()
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=sock), base_url="http://hf-tpu", timeout=subprocess_seconds()
    )
    try:
        deadline = time.monotonic() + subprocess_seconds()
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server was not ready in time:\n{log.read_text()[-4000:]}"
            if os.path.exists(sock):
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url="http://hf-tpu/v1", api_key="unused", http_client=http, max_retries=0)
        assert [m.id for m in client.models.list().data] == [SERVED]
        path = default_model_path()
        tok = AutoTokenizer.from_pretrained(path)
        cpu = AutoModelForCausalLM.from_pretrained(path).eval()
        got, want = [], []
        for prompt in ("The king said", "My lord, the"):
            ids = tok(prompt)["input_ids"]
            out = cpu.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            text = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
            done = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0)
            assert done.model == SERVED and done.usage.completion_tokens <= 8
            got.append(done.choices[0].text)
            want.append(text)
        chunks = client.completions.create(model=SERVED, prompt="The king said", max_tokens=8, temperature=0,
                                           stream=True)  # fmt: skip
        got.append("".join(c.choices[0].text for c in chunks if c.choices))
        want.append(want[0])
        width = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in got + want)

        def padded(text: str) -> list[int]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return ids + [-1] * (width - len(ids))

        chip.tokens([padded(t) for t in got], [padded(t) for t in want], what="served greedy tokens")
        assert got == want
    finally:
        http.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=subprocess_seconds())
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
