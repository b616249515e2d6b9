"""Multi-host on one machine: two ``hf-tpu launch --simulate --nnodes=2 --node_rank=0|1`` launchers, master on
127.0.0.1, form one 4-rank run (2 data parallel x 2 tensor parallel) whose result equals the same job on one host
and a CPU reference; each rank's launch environment is what torch_tpu's ``set_tpu_launch_env`` gives for that
layout (tests/contract/test_launch.py compares the two rules against the wheel itself); a dead host ends the other.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from _launch_util import finish, kill, launch, processes_mentioning, start
from _timeouts import SAFETY_TIMEOUT_S

WORKER = "tests/distributed/_multihost_worker.py"
HOSTS = "hostA,hostB"  # TPU_WORKER_HOSTNAMES, as a TPU VM sets it; --master_addr wins over its first entry
pytestmark = [pytest.mark.distributed]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_hosts(out, mode: str) -> list:
    port = _free_port()
    env = {"TPU_WORKER_HOSTNAMES": HOSTS, "HF_TPU_SIM_GENERATION": "v5p"}
    # torchrun's two spellings of each flag, one per host.
    flags = [
        ["--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={port}"],
        ["--node-rank=1", "--master-addr=127.0.0.1", f"--master-port={port}"],
    ]
    return [
        start(["--simulate", "--nnodes=2", "--nproc_per_node=2", *f, WORKER, str(out), mode], env=env) for f in flags
    ]


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 6, generator=g)
    batch = torch.randn(8, 8, generator=g)
    y = batch @ weight
    return y, y.sum(0)


def _results(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_two_hosts_form_one_run_equal_to_one_host(tmp_path):
    two = tmp_path / "two_hosts"
    two.mkdir()
    procs = _start_hosts(two, "once")
    try:
        outcomes = [finish(p, timeout=SAFETY_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
    for code, out in outcomes:
        assert code == 0, out[-6000:]
    assert not processes_mentioning(str(two)), "ranks left running after the launchers exited"

    one = tmp_path / "one_host"
    one.mkdir()
    code, log, _ = launch(["--simulate", "--nproc_per_node=4", WORKER, str(one)], timeout=SAFETY_TIMEOUT_S)
    assert code == 0, log[-6000:]

    y, col_sums = _reference()
    for multi, single in zip(_results(two), _results(one), strict=True):
        r = multi["rank"]
        assert multi["device"] == "tpu:0"
        assert multi["y"] == single["y"] and multi["col_sums"] == single["col_sums"]
        torch.testing.assert_close(torch.tensor(multi["y"]), y[(r // 2) * 4 : (r // 2 + 1) * 4])
        torch.testing.assert_close(torch.tensor(multi["col_sums"]), col_sums)
        # torch_tpu's multi-host rules (set_tpu_launch_env): addresses across every host, NODE_RANK / MASTER_ADDR
        # as pinned by the flags, the v5p mesh of 2 devices per host.
        assert multi["env"] == {
            "TORCH_TPU_TOPOLOGY": "1,2,1",
            "TORCH_TPU_SLICEBUILDER_ADDRESSES": "hostA:8070,hostA:8071,hostB:8070,hostB:8071",
            "NNODES": "2",
            "NODE_RANK": str(r // 2),
            "MASTER_ADDR": "127.0.0.1",
        }
        assert single["env"]["TORCH_TPU_TOPOLOGY"] == "2,2,1" and single["env"]["NNODES"] is None


def test_a_dead_host_ends_the_other(tmp_path):
    procs = _start_hosts(tmp_path, "hang")
    try:
        deadline = time.time() + SAFETY_TIMEOUT_S
        while not all((tmp_path / f"ready{r}").exists() for r in range(4)):
            for p in procs:
                assert p.poll() is None, p.communicate()[0][-6000:]
            assert time.time() < deadline, "the 4 ranks did not start"
            time.sleep(0.5)
        kill(procs[1])  # host 1 dies: its launcher and ranks, at once
        code, out = finish(procs[0], timeout=SAFETY_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
    assert code != 0, out[-6000:]
    assert "hf-tpu launch: rank" in out and "failed" in out, out[-6000:]
    assert not processes_mentioning(str(tmp_path)), "ranks left running after the host died"
