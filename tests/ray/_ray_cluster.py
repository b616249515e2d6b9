"""A local Ray cluster of simulated TPU VMs on one host, and the references, for tests/ray.

:func:`simulated_cluster` starts a head node (no TPU: the driver's reads) and ``nodes`` worker nodes, each with one
CPU and the custom resource ``{"TPU": 1}`` (what Ray's TPU detection gives a 1-chip VM), small object stores, and a
job environment that enables hf_tpu's simulated ``tpu`` device in every worker. Bounded for a 2-core host; shut down
on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OBJECT_STORE = 100 * 1024**2
# Every worker process of the test jobs: the simulated device, torch_tpu's autoload off, nothing from a hub.
WORKER_ENV = {"HF_TPU_SIMULATE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # fmt: skip


# Ray's usage statistics (sent off the host) and Ray Data's usage queries (a Prometheus on localhost:9090): off.
NO_USAGE_REPORTS = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DATA_USAGE_DISABLED": "1"}


@contextlib.contextmanager
def simulated_cluster(nodes: int = 2, head_cpus: int = 1) -> Iterator[object]:
    """A connected Ray cluster of ``nodes`` simulated 1-chip TPU VMs (yields the ``Cluster``)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.update(NO_USAGE_REPORTS)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "object_store_memory": 2 * OBJECT_STORE, "include_dashboard": False},
    )  # fmt: skip
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, resources={"TPU": 1}, object_store_memory=OBJECT_STORE)
        env = {**WORKER_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def heldout_prompts(count: int, words: tuple[int, int] = (2, 5)) -> list[str]:
    """``count`` prompts cut from the shipped model's held-out Shakespeare: the first 2-5 words of its lines (at most 16 tokens)."""
    from importlib.resources import files

    lines = [ln.strip() for ln in (files("hf_tpu.assets") / "tiny-lm" / "heldout.txt").read_text().splitlines()]
    lines = [ln for ln in lines if len(ln.split()) >= words[0]]
    span = words[1] - words[0] + 1
    return [" ".join(lines[i % len(lines)].split()[: words[0] + i % span]) for i in range(count)]


def cpu_greedy_rows(model_dir: str, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation on the CPU, one prompt at a time, trimmed after the first end-of-sequence
    token as :class:`hf_tpu.ray.HfTpuGenerate` trims its rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            enc = tok(prompt, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)[0, enc.input_ids.shape[1] :]
            tokens = out.tolist()
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            rows.append(tokens[:cut])
    return rows


def shipped_model() -> str:
    """The model that ships with hf_tpu (a 4-layer Llama trained on Shakespeare, with its tokenizer)."""
    from hf_tpu.assets import default_model_path

    return str(default_model_path())
