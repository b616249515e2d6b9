"""hf_tpu.runtime: PCI scan against fake sysfs trees, the real-mode branch against torch_tpu's API shapes, none mode.

The real branch cannot run here (no chips), so it is driven by a fake ``/sys/bus/pci/devices`` + ``/dev/vfio``
tree and a fake ``torch.tpu.get_device_properties`` shaped like torch_tpu 0.2.0's
(``_internal/device/_device_module.py``: a ``_TpuDeviceProperties(name, total_memory, multi_processor_count)``
computed from ``_internal/utils/hardware.py``'s tables, raising RuntimeError for an unknown generation).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from _fake_pci import make_sysfs
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu import runtime

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3

# PCI device ids and per-device HBM as torch_tpu 0.2.0's hardware.py lists them (v7: two devices per chip).
TORCH_TPU_TABLE = {
    "v4": ("0x005e", "TPU v4", 32 * GiB),
    "v5e": ("0x0063", "TPU v5e", 16 * GiB),
    "v5p": ("0x0062", "TPU v5p", 95 * GiB),
    "v6e": ("0x006f", "TPU v6e", 32 * GiB),
    "v7": ("0x0076", "TPU v7", 96 * GiB),
}


@dataclasses.dataclass
class FakeTpuDeviceProperties:  # the fields of torch_tpu's _TpuDeviceProperties
    name: str
    total_memory: int
    multi_processor_count: int = 1


def fake_torch_tpu_module(name: str | None, total_memory: int | None) -> types.SimpleNamespace:
    def get_device_properties(device=None):
        if total_memory is None:  # what torch_tpu does for a generation it does not know
            raise RuntimeError(f"unrecognized TPU {name!r}; cannot determine device memory")
        return FakeTpuDeviceProperties(name=name, total_memory=total_memory)

    return types.SimpleNamespace(get_device_properties=get_device_properties, device_count=lambda: 1)


@pytest.fixture
def fresh_runtime(monkeypatch):
    """detect() with no simulator registered, and its cache cleared before and after."""
    monkeypatch.setattr(runtime, "_SIMULATED", None)
    runtime.detect.cache_clear()
    yield monkeypatch
    runtime.detect.cache_clear()


def fake_versions(monkeypatch, **versions: str | None) -> None:
    """Pretend these distributions are installed; torch_tpu also becomes importable (an empty stand-in module)."""
    table = {k.replace("_", "-"): v for k, v in versions.items()}
    monkeypatch.setattr(runtime, "_pkg_version", lambda name: table.get(name.replace("_", "-")))
    if table.get("torch-tpu"):
        module = types.ModuleType("torch_tpu")
        module.__spec__ = importlib.machinery.ModuleSpec("torch_tpu", None)
        monkeypatch.setitem(sys.modules, "torch_tpu", module)


@pytest.mark.parametrize("generation", sorted(TORCH_TPU_TABLE))
def test_pci_scan_finds_each_generation(tmp_path, generation):
    pci_id = TORCH_TPU_TABLE[generation][0]
    other = [("0x8086", "0x1237", True), ("0x1ae0", "0x0001", True)]  # an Intel bridge, a non-TPU Google device
    pci, vfio = make_sysfs(tmp_path, [*other, ("0x1ae0", pci_id, True), ("0x1ae0", pci_id, True)])
    scan = runtime.scan_pci(pci, vfio)
    assert scan == runtime.PciScan(functions=2, vfio=2, generation=generation)
    assert runtime.scan_pci_chips(pci) == (2, generation)


def test_pci_scan_counts_only_vfio_exposed_devices_as_usable(tmp_path):
    pci, vfio = make_sysfs(tmp_path, [("0x1ae0", "0x006f", True), ("0x1ae0", "0x006f", False)])
    assert runtime.scan_pci(pci, vfio) == runtime.PciScan(functions=2, vfio=1, generation="v6e")


def test_pci_scan_of_missing_or_empty_tree(tmp_path):
    assert runtime.scan_pci(tmp_path / "missing", tmp_path / "missing") == runtime.PciScan(0, 0, None)
    pci, vfio = make_sysfs(tmp_path, [("0x10de", "0x2330", True)])  # a GPU, no TPU
    assert runtime.scan_pci(pci, vfio) == runtime.PciScan(0, 0, None)


def test_generation_table_matches_torch_tpu():
    for gen, (pci_id, _, per_device) in TORCH_TPU_TABLE.items():
        spec = runtime.GENERATIONS[gen]
        assert spec["pci_id"] == pci_id
        assert int(spec["hbm_per_chip"]) // int(spec["devices_per_chip"]) == per_device


@pytest.mark.parametrize("generation", sorted(TORCH_TPU_TABLE))
def test_real_mode_reads_torch_tpu_device_properties(tmp_path, fresh_runtime, generation):
    import torch

    pci_id, name, per_device = TORCH_TPU_TABLE[generation]
    pci, vfio = make_sysfs(tmp_path, [("0x1ae0", pci_id, True)] * 4)
    fresh_runtime.setattr(runtime, "PCI_ROOT", str(pci))
    fresh_runtime.setattr(runtime, "VFIO_ROOT", str(vfio))
    fake_versions(fresh_runtime, torch_tpu="0.2.0", libtpu="0.0.52")
    reported = per_device - 3 * GiB  # not the table's figure: proves the value comes from torch.tpu
    fresh_runtime.setattr(torch, "tpu", fake_torch_tpu_module(name, reported), raising=False)

    info = runtime.detect()
    assert info.mode == "real"
    assert (info.device_count, info.chips_on_host, info.generation) == (1, 4, generation)
    assert info.hbm_bytes == reported
    assert (info.torch_tpu_version, info.libtpu_version) == ("0.2.0", "0.0.52")
    assert runtime.is_real() and not runtime.is_simulated()
    assert runtime.require_tpu("device_map='tpu'") is info


def test_real_mode_falls_back_to_the_generation_table_when_torch_tpu_does_not_know_the_chip(tmp_path, fresh_runtime):
    import torch

    pci, vfio = make_sysfs(tmp_path, [("0x1ae0", "0x0076", True)] * 2)
    fresh_runtime.setattr(runtime, "PCI_ROOT", str(pci))
    fresh_runtime.setattr(runtime, "VFIO_ROOT", str(vfio))
    fake_versions(fresh_runtime, torch_tpu="0.2.0", libtpu="0.0.52")
    fresh_runtime.setattr(torch, "tpu", fake_torch_tpu_module("TPU", None), raising=False)
    info = runtime.detect()
    assert info.mode == "real" and info.hbm_bytes == 96 * GiB


@pytest.mark.parametrize(
    ("devices", "torch_tpu", "reason_words"),
    [
        ([], None, ["no TPU chips", "no torch-tpu"]),
        ([], "0.2.0", ["torch-tpu 0.2.0 is installed", "no TPU chips"]),
        ([("0x1ae0", "0x006f", True)], None, ["torch-tpu is not installed", "pip install 'hf-tpu[tpu]'"]),
        ([("0x1ae0", "0x006f", False)], "0.2.0", ["VFIO", "vfio-pci"]),
    ],
)
def test_none_mode_reasons(tmp_path, fresh_runtime, devices, torch_tpu, reason_words):
    pci, vfio = make_sysfs(tmp_path, devices)
    fresh_runtime.setattr(runtime, "PCI_ROOT", str(pci))
    fresh_runtime.setattr(runtime, "VFIO_ROOT", str(vfio))
    fake_versions(fresh_runtime, torch_tpu=torch_tpu)
    info = runtime.detect()
    assert info.mode == "none" and info.device_count == 0 and info.hbm_bytes == 0
    for word in reason_words:
        assert word in info.reason
    with pytest.raises(runtime.TPUNotAvailableError) as err:
        runtime.require_tpu("device_map='tpu'")
    text = str(err.value)
    assert "device_map='tpu'" in text and info.reason in text


def test_none_mode_error_names_both_fixes_in_a_fresh_process(tmp_path):
    """The test suite has the simulator on, so the plain none mode is checked in a process of its own."""
    code = (
        "import sys, hf_tpu, hf_tpu.runtime as r\n"
        f"r.PCI_ROOT = {str(tmp_path)!r}\n"
        "assert r.detect().mode == 'none', r.detect()\n"
        "try:\n"
        "    r.require_tpu(\"device_map='tpu'\")\n"
        "except r.TPUNotAvailableError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    sys.exit('no error raised')\n"
        "assert 'torch' not in sys.modules, 'detect() imported torch in none mode'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout
    assert "device_map='tpu' was requested" in message
    assert "pip install 'hf-tpu[tpu]'" in message  # how to get a real TPU
    assert "HF_TPU_SIMULATE=1" in message and "hf_tpu.sim.enable()" in message and "--simulate" in message


def test_generations_come_from_the_adapter_and_name_torch_tpus_meshes():
    """Without torch-tpu (this venv) hf_tpu._torch_tpu uses its copy of 0.2.0's tables; tests/contract checks the
    copy against the wheel, and that with the wheel installed the tables are read from it."""
    from hf_tpu import _torch_tpu

    if _torch_tpu.installed_version() is None:
        assert _torch_tpu.source() == "hf_tpu's copy of torch-tpu 0.2.0's tables"
        assert _torch_tpu.generations() == _torch_tpu.copied_generations()
    meshes = {gen: spec["topologies"] for gen, spec in runtime.GENERATIONS.items()}
    assert meshes["v6e"] == meshes["v5e"] == {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"}
    assert meshes["v5p"] == meshes["v4"] == {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"}
    assert meshes["v7"] == {2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"}
    assert _torch_tpu.topology("v7", 4) == "1,2,1,2"
    with pytest.raises(_torch_tpu.UnsupportedTopologyError, match=r"torch_tpu runs v7 with 2, 4, 8 device\(s\)"):
        _torch_tpu.topology("v7", 1)
    assert _torch_tpu.valid_counts("v6e") == (1, 4, 8)
