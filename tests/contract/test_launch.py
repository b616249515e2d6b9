"""hf_tpu's launcher against torch-tpu's own ``set_tpu_launch_env`` and topology tables, every generation and count.

The wheel's code runs as on a TPU VM; only the PCI bus is stood in (a sysfs tree with the wheel's own PCI device
ids, see ``fake_tpu_host``). ``set_tpu_launch_env`` memoizes what it generated (``env_utils._resolved_values``)
and, in C++, the variables it read once (``TPU_WORKER_HOSTNAMES``, ``JOB_COMPLETION_INDEX``): single-host layouts
run here with that memo emptied between calls; multi-host layouts run in one child process whose environment names
the hosts from the start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S
from torch_tpu._internal import env_utils
from torch_tpu._internal.distributed import distributed as tt_distributed
from torch_tpu._internal.utils import hardware

from hf_tpu import _torch_tpu
from hf_tpu.distributed import launch as L

REPO = Path(__file__).resolve().parents[2]
COUNTS = range(1, 10)
LAUNCH_VARS = ("TORCH_TPU_", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# What hf_tpu adds for the simulated ranks only (torch_tpu must not autoload there).
SIM_ONLY = {"HF_TPU_SIMULATE", "TORCH_DEVICE_BACKEND_AUTOLOAD"}
GENERATIONS = {_torch_tpu._key(name): pci for pci, name in hardware._PCI_DEVICE_ID_TO_NAME.items()}


@pytest.fixture
def clean_launch_env(monkeypatch):
    """No launch variable set, and set_tpu_launch_env's memo of generated values empty, around each call."""

    def reset():
        for k in list(os.environ):
            if k.startswith(LAUNCH_VARS):
                monkeypatch.delenv(k)
        monkeypatch.setattr(env_utils, "_resolved_values", {})

    assert "TPU_WORKER_HOSTNAMES" not in os.environ and "JOB_COMPLETION_INDEX" not in os.environ
    reset()
    return reset


def _wheel_env(reset, **kwargs) -> dict | str:
    """What torch_tpu's set_tpu_launch_env sets for ``kwargs``, or the RuntimeError it raises."""
    reset()
    try:
        tt_distributed.set_tpu_launch_env(**kwargs)
    except RuntimeError as err:
        return f"RuntimeError: {err}"
    return {k: v for k, v in os.environ.items() if k.startswith(LAUNCH_VARS)}


def test_generations_cover_the_wheel():
    assert set(GENERATIONS) == set(_torch_tpu.generations()) == {"v4", "v5e", "v5p", "v6e", "v7"}


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_single_host_env_and_refusals_equal_the_wheel(generation, fake_tpu_host, clean_launch_env):
    fake_tpu_host(GENERATIONS[generation], 8)
    for count in COUNTS:
        wheel = _wheel_env(clean_launch_env, nproc_per_node=count)
        clean_launch_env()
        try:
            ours = L.set_simulated_launch_env(nproc_per_node=count, env={}, generation=generation)
        except L.LaunchError as err:
            assert isinstance(wheel, str), f"hf_tpu refuses {count} on {generation}, torch_tpu sets {wheel}"
            assert f"No TPU topology found for count: {count}" in wheel
            assert f"{count} process(es) per host on {hardware._PCI_DEVICE_ID_TO_NAME[GENERATIONS[generation]]}" in (
                str(err)
            )
            with pytest.raises(L.LaunchError, match="torch_tpu runs"):
                L.check_process_count(generation, count, 8, multihost=False)
            # hf_tpu's real-mode launch goes through the wheel: its RuntimeError becomes a LaunchError.
            clean_launch_env()
            with pytest.raises(L.LaunchError, match=f"No TPU topology found for count: {count}"):
                L.set_real_launch_env(nproc_per_node=count)
            continue
        assert isinstance(wheel, dict), f"torch_tpu refuses {count} on {generation} ({wheel}); hf_tpu accepts it"
        L.check_process_count(generation, count, 8, multihost=False)
        assert set(ours) - SIM_ONLY == set(wheel), (ours, wheel)
        assert ours["TORCH_TPU_TOPOLOGY"] == wheel["TORCH_TPU_TOPOLOGY"]
        for env in (ours, wheel):
            addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
            assert len(addresses) == count and all(a.startswith("localhost:") for a in addresses)
        clean_launch_env()
        assert L.set_real_launch_env(nproc_per_node=count)["TORCH_TPU_TOPOLOGY"] == wheel["TORCH_TPU_TOPOLOGY"]


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_one_process_per_device_found_is_refused_as_the_wheel_refuses(generation, fake_tpu_host, clean_launch_env):
    """No --nproc_per_node: torch_tpu looks up the host's device count (v7: both devices of each chip)."""
    for count in COUNTS:
        fake_tpu_host(GENERATIONS[generation], count)
        wheel = _wheel_env(clean_launch_env)
        from hf_tpu import runtime

        assert runtime.scan_pci().vfio == hardware.get_tpu_device_count() == count
        try:
            L.check_process_count(generation, None, runtime.scan_pci().vfio, multihost=False)
        except L.LaunchError:
            assert isinstance(wheel, str), wheel
        else:
            assert isinstance(wheel, dict) and wheel["TORCH_TPU_TOPOLOGY"] == L.simulated_topology(count, generation)


_MULTIHOST_SCRIPT = r"""
import json, os, pathlib, sys, types
sys.path[:0] = [{tests!r}, {tests_root!r}]
from conftest import make_pci_tree
from torch_tpu._internal import env_utils
from torch_tpu._internal.utils import hardware
from hf_tpu.distributed import launch as L

out = []
for i, (generation, pci_id, count, pinned) in enumerate(json.loads(sys.argv[1])):
    pci, vfio = make_pci_tree(pathlib.Path(sys.argv[2]) / str(i), pci_id, count)
    paths = {{"/sys/bus/pci/devices": pci, "/dev/vfio": vfio}}
    hardware.pathlib = types.SimpleNamespace(Path=lambda p, *r: pathlib.Path(paths.get(str(p), p), *r))
    for k in [k for k in os.environ if k.startswith({launch_vars!r})]:
        del os.environ[k]
    env_utils._resolved_values.clear()
    os.environ.update(pinned)
    try:
        L.set_real_launch_env(nnodes=2, nproc_per_node=count)  # torch_tpu's set_tpu_launch_env, through hf_tpu
        result = {{k: v for k, v in os.environ.items() if k.startswith({launch_vars!r})}}
    except L.LaunchError as err:
        result = str(err)
    out.append(result)
print("RESULTS=" + json.dumps(out))
"""


def test_multi_host_env_and_refusals_equal_the_wheel(tmp_path):
    pinned = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}  # --node_rank etc. given
    layouts = [(g, pci, n, {}) for g, pci in sorted(GENERATIONS.items()) for n in COUNTS]
    layouts += [(g, pci, n, pinned) for g, pci in sorted(GENERATIONS.items()) for n in (2, 4)]
    script = _MULTIHOST_SCRIPT.format(
        tests=str(Path(__file__).parent), tests_root=str(REPO / "tests"), launch_vars=LAUNCH_VARS
    )
    env = dict(
        os.environ, TPU_WORKER_HOSTNAMES="hostA,hostB", JOB_COMPLETION_INDEX="1", TORCH_DEVICE_BACKEND_AUTOLOAD="1"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(layouts), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=SAFETY_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS="))
    wheel_results = json.loads(line.removeprefix("RESULTS="))
    accepted = 0
    for (generation, _, count, pins), wheel in zip(layouts, wheel_results, strict=True):
        sim_env = {"TPU_WORKER_HOSTNAMES": "hostA,hostB", "JOB_COMPLETION_INDEX": "1", **pins}
        try:
            ours = L.set_simulated_launch_env(nnodes=2, nproc_per_node=count, env=sim_env, generation=generation)
            L.check_process_count(generation, count, count, multihost=True)
        except L.LaunchError:
            assert isinstance(wheel, str) and "No TPU topology found" in wheel, (generation, count, wheel)
            continue
        assert isinstance(wheel, dict), (generation, count, wheel)
        ours = {k: v for k, v in sim_env.items() if k.startswith(LAUNCH_VARS)}
        wheel.pop("TORCH_TPU_XPROF_SESSION_ID")
        ours.pop("TORCH_TPU_XPROF_SESSION_ID")
        assert ours == wheel, (generation, count, pins)
        assert wheel["NODE_RANK"] == pins.get("NODE_RANK", "1")
        accepted += 1
    tables = hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID
    assert accepted == sum(1 for _, pci, n, _ in layouts if n in tables[pci])  # every layout the wheel accepts


def test_no_process_count_describes_every_chip_and_two_ranks_there_are_named(fake_tpu_host, clean_launch_env):
    """issue 36: torch_tpu's launch recipe (``set_tpu_launch_env()``, then torchrun with ``--nproc_per_node=2``) on a
    4-chip host. The wheel, called without ``nproc_per_node``, describes all 4 chips (topology 2,2,1, 4 slice-builder
    addresses), whatever torchrun starts afterwards; the simulator's stand-in says the same, and each of the 2 ranks
    is told the call that fixes it (``set_tpu_launch_env(nproc_per_node=2)``, which the wheel refuses on v6e)."""
    from hf_tpu._launch_env import set_simulated_launch_env, slice_mismatch

    fake_tpu_host(GENERATIONS["v6e"], 4)
    wheel = _wheel_env(clean_launch_env)
    assert wheel["TORCH_TPU_TOPOLOGY"] == "2,2,1" and len(wheel["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 4
    ours = set_simulated_launch_env(nproc_per_node=4, env={}, generation="v6e")  # the simulated host: 4 devices
    assert ours["TORCH_TPU_TOPOLOGY"] == wheel["TORCH_TPU_TOPOLOGY"]
    assert len(ours["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 4
    for env in (wheel, ours):
        message = slice_mismatch({**env, "LOCAL_WORLD_SIZE": "2"})
        assert "describes 4 TPU devices" in message and "set_tpu_launch_env(nproc_per_node=2)" in message
        assert slice_mismatch({**env, "LOCAL_WORLD_SIZE": "4"}) is None
    assert "No TPU topology found for count: 2" in _wheel_env(clean_launch_env, nproc_per_node=2)
