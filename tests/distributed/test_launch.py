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
    L.set_simulated_launch_env(nproc_per_node=2, env=env, generation="v5p")
    assert env["TORCH_TPU_TOPOLOGY"] == "pinned"


def test_simulated_env_multi_host_from_worker_hostnames():
    env = {"TPU_WORKER_HOSTNAMES": "host0,host1", "JOB_COMPLETION_INDEX": "1"}
    L.set_simulated_launch_env(nproc_per_node=2, env=env, generation="v5p")
    assert env["NNODES"] == "2" and env["NODE_RANK"] == "1" and env["TORCH_TPU_TOPOLOGY"] == "1,2,1"
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
    monkeypatch.setenv("TORCH_TPU_TOPOLOGY", "")
    monkeypatch.delenv("TORCH_TPU_TOPOLOGY")  # recorded, so the value the fake sets is undone after the test
    assert L.set_real_launch_env(nnodes=2, nproc_per_node=4) == {"TORCH_TPU_TOPOLOGY": "2,2,1"}
    assert calls == [(2, 4)]


def test_real_mode_without_chips_is_a_clear_error(monkeypatch, tmp_path):
    from hf_tpu import runtime

    monkeypatch.delenv("HF_TPU_SIMULATE", raising=False)
    none = runtime.RuntimeInfo("none", 0, 0, 0, None, None, None, "no TPU chips and no torch-tpu")
    monkeypatch.setattr(runtime, "detect", lambda: none)
    (tmp_path / "run.py").write_text("")
    args = L.build_parser().parse_args(["--nproc_per_node=2", str(tmp_path / "run.py")])
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
    # Rank 0 blocks in a collective rank 1 never joins: the launch ends (before the safety timeout) only because the
    # launcher stopped rank 0 once rank 1 failed. The outcome is checked, not how long it took (~7 s idle).
    assert code == 1, log[-3000:]
    assert "rank 1 exploded on purpose" in log
    assert "hf-tpu launch: rank 1 failed with exit code 1" in log, log[-3000:]
    assert (tmp_path / "raised").is_file()  # rank 1 got past the first collective and raised
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


# torch_tpu 0.2.0's topology tables (_internal/utils/hardware.py): devices per host it has a mesh for.
TORCH_TPU_COUNTS = {"v4": {1, 2, 4, 8}, "v5p": {1, 2, 4, 8}, "v5e": {1, 4, 8}, "v6e": {1, 4, 8}, "v7": {2, 4, 8}}


@pytest.mark.parametrize("generation", sorted(TORCH_TPU_COUNTS))
def test_counts_torch_tpu_refuses_are_refused_on_chips_and_simulator_alike(generation):
    for count in range(1, 10):
        ok = count in TORCH_TPU_COUNTS[generation]
        for refuse in (
            lambda n=count: L.set_simulated_launch_env(nproc_per_node=n, env={}, generation=generation),
            lambda n=count: L.check_process_count(generation, n, 8, multihost=False),
            lambda n=count: L.check_process_count(generation, None, n, multihost=False),  # one per device found
            lambda n=count: L.check_process_count(generation, n, n, multihost=True),
        ):
            if ok:
                refuse()
                continue
            with pytest.raises(L.LaunchError) as err:
                refuse()
            counts = ", ".join(map(str, sorted(TORCH_TPU_COUNTS[generation])))
            assert f"{count} process(es) per host" in str(err.value) and f"{generation} with {counts}" in str(
                err.value
            )


def test_multi_host_also_checks_the_hosts_own_device_count():
    # torch_tpu's multi-host launch looks up this host's device count, whatever nproc_per_node says.
    with pytest.raises(L.LaunchError, match="2 process"):
        L.check_process_count("v6e", 4, 2, multihost=True)
    L.check_process_count("v6e", 4, 2, multihost=False)  # single-host: a sub-slice of the host is allowed


def test_simulated_generation_is_the_one_asked_for_or_one_that_has_the_count(monkeypatch, capsys):
    from hf_tpu import runtime

    monkeypatch.delenv("HF_TPU_SIM_GENERATION", raising=False)
    sim = runtime.RuntimeInfo("simulated", 1, 0, 32 * 1024**3, "v6e", None, None, "test")
    monkeypatch.setattr(runtime, "detect", lambda: sim)
    args = argparse.Namespace(sim_generation=None)
    assert L._sim_generation(args, 4) == "v6e" and capsys.readouterr().err == ""
    assert L._sim_generation(args, 2) == "v5p"
    assert "simulating TPU v5p: 2 devices per host is not a v6e layout" in capsys.readouterr().err
    with pytest.raises(L.LaunchError, match=r"3 process\(es\) per host on TPU v6e.*v4: 1, 2, 4, 8"):
        L._sim_generation(args, 3)
    monkeypatch.setenv("HF_TPU_SIM_GENERATION", "v6e")
    with pytest.raises(L.LaunchError, match=r"v6e with 1, 4, 8.*--sim-generation=v5p"):
        L._sim_generation(args, 2)
    monkeypatch.setenv("HF_TPU_SIM_GENERATION", "v5p")
    assert L._sim_generation(args, 2) == "v5p"
    with pytest.raises(L.LaunchError, match="unknown TPU generation 'v9'"):
        L._sim_generation(argparse.Namespace(sim_generation="v9"), 2)


def test_rendezvous_flags_reach_the_launch_environment_before_it_is_set(monkeypatch, tmp_path):
    """--node_rank/--node-rank, --master_addr, --master_port are read before the multi-host check needs them."""
    import os

    import torch.distributed.run as torchrun

    script = tmp_path / "run.py"
    script.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_TPU_", "NODE_RANK", "MASTER_", "NNODES"))}
    env.update(TPU_WORKER_HOSTNAMES="hostA,hostB", HF_TPU_SIM_GENERATION="v5p")
    monkeypatch.setattr(os, "environ", env)
    seen = []
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append((args, dict(os.environ))))
    argv = ["--simulate", "--nnodes=2", "--node-rank=1", "--master-addr=10.1.1.1", "--master-port=1234"]
    assert L.launch(L.build_parser().parse_args([*argv, "--nproc_per_node=2", str(script)])) == 0
    ((args, child_env),) = seen
    assert (args.node_rank, args.master_addr, args.master_port, args.nnodes) == (1, "10.1.1.1", 1234, "2")
    assert (child_env["NODE_RANK"], child_env["MASTER_ADDR"], child_env["MASTER_PORT"]) == ("1", "10.1.1.1", "1234")
    assert child_env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "hostA:8070,hostA:8071,hostB:8070,hostB:8071"
    assert child_env["TORCH_TPU_TOPOLOGY"] == "1,2,1" and child_env["NNODES"] == "2"


def test_single_host_flags_left_out_get_torchrun_defaults(monkeypatch, tmp_path):
    import os

    import torch.distributed.run as torchrun

    script = tmp_path / "run.py"
    script.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_TPU_", "NODE_RANK", "MASTER_", "NNODES"))}
    env.pop("TPU_WORKER_HOSTNAMES", None)
    monkeypatch.setattr(os, "environ", env)
    seen = []
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append(args))
    assert L.launch(L.build_parser().parse_args(["--simulate", "--nproc_per_node=4", str(script)])) == 0
    assert (seen[0].node_rank, seen[0].master_addr, seen[0].master_port) == (0, "127.0.0.1", None)
    assert "NODE_RANK" not in env and env["TORCH_TPU_TOPOLOGY"] == "2,2,1"


def test_refused_count_and_missing_script_start_no_rank(tmp_path):
    script = tmp_path / "never_runs.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    code, out, _ = launch(
        ["--simulate", "--nproc_per_node=2", str(script)], timeout=SAFETY_TIMEOUT_S, env={"HF_TPU_SIM_GENERATION": "v6e"}
    )
    assert code == 2, out
    assert "2 process(es) per host on TPU v6e: torch_tpu runs v6e with 1, 4, 8" in out
    assert "Traceback" not in out and not (tmp_path / "ran").exists()

    missing = tmp_path / "missing.py"
    code, out, _ = launch(["--simulate", "--nproc_per_node=2", str(missing)], timeout=SAFETY_TIMEOUT_S)
    assert code == 2, out
    assert f"the script {missing} does not exist; no rank was started" in out
    assert "Traceback" not in out and "FileNotFoundError" not in out and len(out.strip().splitlines()) <= 3, out
