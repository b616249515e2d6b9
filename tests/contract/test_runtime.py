"""hf_tpu's picture of the TPU generations against torch-tpu's own: tables, PCI scan, device properties, names.

The wheel's code runs as on a TPU VM; only the PCI bus is stood in (``fake_tpu_host``), built from the wheel's own
PCI device-id table. ``get_device_properties`` needs no device init in 0.2.0 (it reads the PCI scan), so nothing
else is stood in.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch_tpu._internal.utils import hardware

from hf_tpu import _torch_tpu, runtime

PCI_IDS = {_torch_tpu._key(name): pci for pci, name in hardware._PCI_DEVICE_ID_TO_NAME.items()}


def test_hf_tpu_copy_of_the_tables_equals_the_wheel():
    """Where torch-tpu is absent hf_tpu uses its copy; it must say what the wheel says."""
    assert _torch_tpu._from_wheel(hardware) == _torch_tpu.copied_generations()
    assert _torch_tpu.generations() == _torch_tpu._from_wheel(hardware)
    assert _torch_tpu.source() == "torch-tpu 0.2.0"
    assert _torch_tpu.GOOGLE_PCI_VENDOR == hardware._GOOGLE_PCI_VENDOR_ID == runtime._GOOGLE_PCI_VENDOR
    for gen in runtime.GENERATIONS.values():
        assert gen["topologies"] == dict(hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID[gen["pci_id"]])


def test_the_tables_load_from_the_wheel_without_importing_torch_tpu(monkeypatch):
    """Where torch_tpu is not imported (the simulator keeps it from autoloading), the adapter loads the wheel's
    hardware.py on its own; the tables are the same."""
    monkeypatch.delitem(sys.modules, _torch_tpu.HARDWARE_MODULE)
    _torch_tpu._hardware.cache_clear()
    try:
        alone = _torch_tpu._hardware()
        assert alone is not hardware and alone.__name__ == "hf_tpu._torch_tpu_hardware"
        assert _torch_tpu._from_wheel(alone) == _torch_tpu._from_wheel(hardware)
    finally:
        _torch_tpu._hardware.cache_clear()


def test_every_name_hf_tpu_relies_on_exists_in_the_wheel(monkeypatch):
    assert _torch_tpu.missing_names() == []
    # ... and the check can fail: a name the wheel does not have is reported by name.
    names = dict(_torch_tpu.EXPECTED_NAMES)
    names["torch.tpu"] = (*names["torch.tpu"], "memory_allocated")
    monkeypatch.setattr(_torch_tpu, "EXPECTED_NAMES", names)
    assert _torch_tpu.missing_names() == ["torch.tpu.memory_allocated"]


def test_torch_tpu_device_queries_are_internal_so_hf_tpu_uses_torch_accelerator():
    """torch.tpu.device_count/is_available/synchronize/current_device raise outside torch in 0.2.0."""
    for name in ("device_count", "is_available", "synchronize", "current_device"):
        with pytest.raises(RuntimeError, match="internal"):
            getattr(torch.tpu, name)()
    for name in ("device_count", "synchronize", "current_accelerator", "get_memory_info", "memory_allocated"):
        assert callable(getattr(torch.accelerator, name))


@pytest.mark.parametrize("generation", sorted(PCI_IDS))
def test_device_properties_and_pci_scan_agree_with_the_wheel(generation, fake_tpu_host, monkeypatch):
    fake_tpu_host(PCI_IDS[generation], 8)
    props = torch.tpu.get_device_properties()
    gen = runtime.GENERATIONS[generation]
    assert props.name == gen["name"] == torch.tpu.get_device_name()
    assert props.total_memory == gen["hbm_per_chip"] // gen["devices_per_chip"] == hardware.get_hbm_bytes_per_device()
    assert runtime._real_hbm(generation) == props.total_memory
    scan = runtime.scan_pci()
    assert (scan.vfio, scan.generation) == (hardware.get_tpu_device_count(), generation)

    # `--nproc_per_node=tpu`: one process per device torch_tpu counts (v7: its PCI scan already counts both
    # devices of a chip, so the launcher must not double them).
    import argparse

    from hf_tpu.distributed import launch as L

    args = argparse.Namespace(nproc_per_node="tpu")
    L._resolve_nproc(args, simulate=False)
    assert args.nproc_per_node == str(hardware.get_tpu_device_count()) == "8"


def test_unknown_generation_raises_in_the_wheel_and_hf_tpu_has_no_hbm_for_it(fake_tpu_host):
    fake_tpu_host("0x0001", 4)  # a Google PCI device that is not a TPU the wheel knows
    with pytest.raises(RuntimeError, match="unrecognized TPU"):
        torch.tpu.get_device_properties()
    assert runtime.scan_pci().vfio == hardware.get_tpu_device_count() == 0
    assert runtime._real_hbm(None) == 0
