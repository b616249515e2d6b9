"""A local Ray cluster of simulated TPU VMs on one host, prompts and the CPU reference: for tests, benchmarks and
examples without a TPU.

:func:`simulated_cluster` starts Ray's own ``ray.cluster_utils.Cluster``: a head node without TPU (the driver's
reads and writes) and ``nodes`` worker nodes, each with ``cpus_per_node`` CPUs and ``{"TPU": chips_per_node}``, the
resource Ray's TPU detection gives a VM with that many chips, so that ``resources={"TPU": 1}`` places actors as on a
pod. Every worker process of the job gets the simulated ``tpu`` device (``HF_TPU_SIMULATE=1`` in the job's
``runtime_env``). Object stores are small (for a 2-core, shared host), Ray's usage reports are off, and so is what
only costs CPU on such a host (:data:`LEAN_HEAD`): the autoscaler's monitor (the cluster is fixed), the log monitor
(worker logs are not sent to the driver), metrics export, and workers started ahead of demand (they would start
without the job's ``runtime_env`` and so could not run its tasks). The cluster is shut down when the block ends,
whatever happened.

Example:
    >>> from hf_tpu.ray.local import simulated_cluster                                              # doctest: +SKIP
    >>> with simulated_cluster(nodes=2):
    ...     ray.data.range(8).map_batches(Fn, resources={"TPU": 1},
    ...                                   compute=ray.data.ActorPoolStrategy(size=2))            # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LEAN_HEAD", "NO_USAGE_REPORTS", "WORKER_ENV", "cpu_greedy_rows", "free_port", "heldout_prompts",
           "simulated_cluster"]

#: Ray's usage statistics (sent off the host) and Ray Data's usage queries (a Prometheus on localhost:9090): off.
NO_USAGE_REPORTS = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DATA_USAGE_DISABLED": "1"}
#: The environment of every worker process of the job: the simulated device, torch_tpu's autoload off, no hub.
WORKER_ENV = {"HF_TPU_SIMULATE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # fmt: skip
#: The head node's settings besides its resources (Ray passes ``_system_config`` on to every node). On a 2-core host
#: these processes and threads cost ~2 s of CPU per cluster start and a few percent of a core while it runs; none of
#: them does anything for a fixed local cluster whose driver does not collect worker logs:
#: the dashboard (its web UI), the autoscaler's monitor, the log monitor, metrics collection and export (the
#: dashboard agents' main work), the timeline, and workers prestarted at start-up and for the first driver (started
#: before the job's ``runtime_env`` is known, or more than the actors need: idle processes importing Ray).
LEAN_HEAD: dict[str, Any] = {
    "include_dashboard": False, "no_monitor": True, "include_log_monitor": False,
    "_system_config": {"enable_metrics_collection": False, "enable_timeline": False,
                       "enable_worker_prestart": False, "prestart_worker_first_driver": False},
}  # fmt: skip
_MIB = 1024**2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server this host starts: Ray's, a replica's).

    Returns:
        The port number.
    """
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def simulated_cluster(nodes: int = 2, *, chips_per_node: int = 1, cpus_per_node: int = 1, head_cpus: int = 1,
                      object_store_mib: int = 100, env: dict[str, str] | None = None) -> Iterator[Any]:  # fmt: skip
    """Start a local Ray cluster of ``nodes`` simulated TPU VMs and connect this process to it.

    Args:
        nodes: worker nodes (simulated TPU VMs).
        chips_per_node: the ``"TPU"`` resource of each node.
        cpus_per_node: CPUs each node advertises (keep the sum near the host's cores).
        head_cpus: CPUs of the head node (Ray Data's read tasks run there).
        object_store_mib: each worker node's object store (the head's is twice that).
        env: more environment variables for the job's worker processes.

    Yields:
        The ``ray.cluster_utils.Cluster``.
    """
    import ray
    from ray.cluster_utils import Cluster

    os.environ.update(NO_USAGE_REPORTS)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "object_store_memory": 2 * object_store_mib * _MIB,
                        "dashboard_agent_listen_port": free_port(), **LEAN_HEAD},
    )  # fmt: skip  (the agent's fixed default port would clash with another local cluster, a parallel test's)
    try:
        for _ in range(nodes):  # started one after the other, then awaited together (not each in turn)
            cluster.add_node(wait=False, num_cpus=cpus_per_node, resources={"TPU": chips_per_node},
                             object_store_memory=object_store_mib * _MIB)  # fmt: skip
        cluster.wait_for_nodes()
        here = str(Path(__file__).resolve().parents[2])  # this hf_tpu, first on the workers' path (a checkout too)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        job_env = {**WORKER_ENV, "PYTHONPATH": path, **(env or {})}
        ray.init(address=cluster.address, runtime_env={"env_vars": job_env}, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def heldout_prompts(count: int, words: tuple[int, int] = (2, 5)) -> list[str]:
    """Prompts cut from the held-out Shakespeare of the model that ships with hf_tpu (text it was not trained on).

    Args:
        count: how many prompts (the lines repeat past the file's end).
        words: the fewest and most words per prompt (the first words of a line; with the default, at most 16 tokens
            of the shipped model's tokenizer).

    Returns:
        ``count`` strings.
    """
    from importlib.resources import files

    lines = [ln.strip() for ln in (files("hf_tpu.assets") / "tiny-lm" / "heldout.txt").read_text().splitlines()]
    lines = [ln for ln in lines if len(ln.split()) >= words[0]]
    span = words[1] - words[0] + 1
    return [" ".join(lines[i % len(lines)].split()[: words[0] + i % span]) for i in range(count)]


def cpu_greedy_rows(model_dir: str, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """The reference :class:`hf_tpu.ray.HfTpuGenerate`'s rows are compared with: each prompt's greedy continuation by
    upstream ``generate`` on the CPU, one prompt at a time (no padding), cut after the first end-of-sequence token as
    the rows are.

    Args:
        model_dir: the model (and tokenizer) directory.
        prompts: the prompts.
        new_tokens: ``max_new_tokens``.

    Returns:
        One list of token ids per prompt.
    """
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
