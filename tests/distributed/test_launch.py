"""The launcher: launch environment (simulated and real), torchrun flags passed through, a failing rank."""

from __future__ import annotations

import argparse
import sys
import time
import types

import pytest
from _launch_util import launch, processes_mentioning
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu.distributed import launch as L


def test_simulated_env_single_host():
    env: dict = {}
    set_now = L.set_simulated_launch_env(nproc_per_node=4, env=env)
    assert env["HF_TPU_SIMULATE"] == "1" and env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    assert env["TORCH_TPU_TOPOLOGY"] == "2,2,1"
    addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == 4 and all(a.startswith("localhost:") for a in addresses)
    assert "NODE_RANK" not in env and "MASTER_ADDR" not in env
    assert set(set_now) == set(env)


def test_simulated_env_never_overwrites():
    env = {"TORCH_TPU_TOPOLOGY": "pinned", "HF_TPU_SIMULATE": "1"}
    L.set_simulated_launch_env(nproc_per_node=2, env=env)
    assert env["TORCH_TPU_TOPOLOGY"] == "pinned"


def test_simulated_env_multi_host_from_worker_hostnames():
    env = {"TPU_WORKER_HOSTNAMES": "host0,host1", "JOB_COMPLETION_INDEX": "1"}
    L.set_simulated_launch_env(nproc_per_node=2, env=env)
    assert env["NNODES"] == "2" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == "host0" and env["MASTER_PORT"] == "29500"
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "host0:8070,host0:8071,host1:8070,host1:8071"


def test_simulated_env_errors_say_what_to_do():
    with pytest.raises(L.LaunchError, match="TPU_WORKER_HOSTNAMES lists 2"):
        L.set_simulated_launch_env(nnodes=3, nproc_per_node=1, env={"TPU_WORKER_HOSTNAMES": "a,b"})
    with pytest.raises(L.LaunchError, match="TPU_WORKER_HOSTNAMES is unset"):
        L.set_simulated_launch_env(nnodes=2, nproc_per_node=1, env={})
    with pytest.raises(L.LaunchError, match="--node_rank"):
        L.set_simulated_launch_env(nnodes=2, nproc_per_node=1, env={"TPU_WORKER_HOSTNAMES": "a,b"})


def test_every_torchrun_flag_is_accepted():
    argv = [
        "--simulate",
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=4",
        "--master_addr=10.0.0.1",
        "--master_port=1234",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:29400",
        "--rdzv_id=job",
        "--max_restarts=0",
        "--monitor_interval=0.5",
        "--redirects=3",
        "--log_dir=/tmp/x",
        "-m",
        "pkg.mod",
        "--lr",
        "1",
    ]
    args = L.build_parser().parse_args(argv)
    assert args.simulate and args.nnodes == "2" and args.node_rank == 1 and args.nproc_per_node == "4"
    assert args.master_addr == "10.0.0.1" and args.master_port == 1234 and args.rdzv_backend == "c10d"
    assert args.module and args.training_script == "pkg.mod" and args.training_script_args == ["--lr", "1"]


def test_multi_host_env_fills_only_missing_flags(monkeypatch):
    for k, v in {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "host0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    args = L.build_parser().parse_args(["--master_addr=explicit", "run.py"])
    L._fill_multihost_flags(args)
    assert args.nnodes == "2" and args.node_rank == 1 and args.master_port == 29500
    assert args.master_addr == "explicit"  # a flag on the command line wins


def test_entrypoint_goes_through_the_bootstrap():
    args = L.build_parser().parse_args(["run.py", "--x", "1"])
    L._wrap_entrypoint(args)
    assert args.module and args.training_script == L.BOOTSTRAP_MODULE
    assert args.training_script_args == ["--script", "run.py", "--x", "1"]
    args = L.build_parser().parse_args(["--no-python", "bash", "-c", "true"])
    L._wrap_entrypoint(args)
    assert args.training_script == "bash"


def test_real_mode_calls_torch_tpu_set_tpu_launch_env(monkeypatch):
    calls = []

    def set_tpu_launch_env(*, nnodes=None, nproc_per_node=None):
        calls.append((nnodes, nproc_per_node))
        import os

        os.environ["TORCH_TPU_TOPOLOGY"] = "2,2,1"

    fake = types.ModuleType("torch_tpu._internal.distributed.distributed")
    fake.set_tpu_launch_env = set_tpu_launch_env
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.distributed.distributed", fake)
    monkeypatch.delenv("TORCH_TPU_TOPOLOGY", raising=False)
    assert L.set_real_launch_env(nnodes=2, nproc_per_node=4) == {"TORCH_TPU_TOPOLOGY": "2,2,1"}
    assert calls == [(2, 4)]


def test_real_mode_without_chips_is_a_clear_error(monkeypatch):
    from hf_tpu import runtime

    monkeypatch.delenv("HF_TPU_SIMULATE", raising=False)
    none = runtime.RuntimeInfo("none", 0, 0, 0, None, None, None, "no TPU chips and no torch-tpu")
    monkeypatch.setattr(runtime, "detect", lambda: none)
    args = L.build_parser().parse_args(["--nproc_per_node=2", "run.py"])
    with pytest.raises(L.LaunchError, match="no TPU chips and no torch-tpu.*--simulate|HF_TPU_SIMULATE"):
        L.launch(args)


def test_cli_subcommand_accepts_torchrun_flags():
    from hf_tpu.cli import launch as cli_launch

    parser = argparse.ArgumentParser(prog="hf-tpu")
    parser.add_argument("--simulate", action="store_true")  # hf_tpu.cli.main adds it to every subcommand
    sub = parser.add_subparsers(dest="command")
    cli_launch.register(sub)
    args = parser.parse_args(["launch", "--nproc_per_node=2", "--nnodes=1", "x.py", "--flag"])
    assert args.nproc_per_node == "2" and args.training_script == "x.py" and args.training_script_args == ["--flag"]


@pytest.mark.distributed
def test_failing_rank_stops_the_launch_quickly_with_its_error(tmp_path):
    code, log, _ = launch(
        ["--simulate", "--nproc_per_node=2", "tests/distributed/_fail_worker.py", str(tmp_path)],
        timeout=SAFETY_TIMEOUT_S,
    )
    done = time.time()
    assert code != 0
    assert "rank 1 exploded on purpose" in log
    assert "hf-tpu launch: rank 1 failed with exit code 1" in log, log[-3000:]
    raised = float((tmp_path / "raised").read_text())
    # ~7 s here (torchrun notices, stops rank 0, both interpreters exit); the bound leaves room for a loaded CI host.
    assert done - raised < 30, f"the launcher took {done - raised:.1f}s to stop after rank 1 raised"
    assert not processes_mentioning(str(tmp_path)), "ranks left running after the launcher exited"


@pytest.mark.distributed
def test_stopping_the_launcher_stops_every_rank(tmp_path):
    import os
    import signal
    import subprocess

    from _launch_util import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hf_tpu.launch", "--simulate", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, "tests/distributed/_fail_worker.py", str(tmp_path), "sleep"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + SAFETY_TIMEOUT_S
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() < deadline, "the ranks did not start"
            time.sleep(0.5)
        pids = [int((tmp_path / f"ready{r}").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGTERM)  # the launcher only, as a job scheduler would
        out, _ = proc.communicate(timeout=SAFETY_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out
    for pid in pids:
        assert not _alive(pid), f"rank process {pid} survived the launcher"
    assert not processes_mentioning(str(tmp_path))


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_hf_tpu_launch_parses_through_the_cli_frame():
    from hf_tpu.cli.main import build_parser

    argv = ["launch", "--simulate", "--sim-generation", "v5e", "--nproc_per_node=2", "--nnodes=1", "x.py", "--y"]
    args = build_parser(argv).parse_args(argv)
    assert args.simulate and args.sim_generation == "v5e"
    assert args.nproc_per_node == "2" and args.training_script == "x.py" and args.training_script_args == ["--y"]
