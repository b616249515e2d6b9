"""Free HBM for device_map planning: the entry points torch-tpu 0.2.0 really has.

``torch.tpu.memory_allocated`` does not exist; torch_tpu's C++ allocator (``torch_tpu::TpuAllocator``, a
``c10::DeviceAllocator``) implements ``getMemoryInfo`` and ``getDeviceStats``, which answer torch's
``torch.accelerator.get_memory_info`` and ``memory_allocated``. Their values need a chip; here the wheel shows the
names, and hf_tpu's real-mode branch runs against them on a host without chips (where they raise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch_tpu
from torch_tpu._internal.utils import hardware

from hf_tpu import runtime


def test_torch_tpu_has_no_memory_functions_of_its_own():
    assert not hasattr(torch.tpu, "memory_allocated") and not hasattr(torch.tpu, "mem_get_info")
    assert callable(torch.accelerator.get_memory_info) and callable(torch.accelerator.memory_allocated)


def test_the_wheels_allocator_implements_the_memory_entry_points():
    major, minor = torch.__version__.split(".")[:2]
    glue = Path(torch_tpu.__file__).parent / "csrc" / "common" / f"glue_{major}_{minor}_0"
    (lib,) = glue.glob("libpywrap_*_common.so")
    data = lib.read_bytes()
    for symbol in (b"TpuAllocator13getMemoryInfo", b"TpuAllocator14getDeviceStats", b"N9torch_tpu12TpuAllocatorE"):
        assert symbol in data, symbol


def test_real_mode_planning_reads_torch_accelerator_and_says_when_it_cannot(fake_tpu_host, monkeypatch):
    """On this host (no chips) torch.accelerator has no device: hf_tpu's real branch warns instead of silently
    counting 0, and takes the total from the wheel's get_device_properties."""
    from hf_tpu.device_map import devices

    fake_tpu_host("0x0063", 4)  # v5e
    info = runtime.RuntimeInfo("real", 1, 4, hardware.get_hbm_bytes_per_device(), "v5e", "0.2.0", None, "test")
    monkeypatch.setattr(runtime, "detect", lambda: info)
    with pytest.warns(RuntimeWarning, match=r"get_memory_info\(0\).*memory_allocated\(0\)"):
        mem = devices.tpu_memory(0)
    assert mem.total == torch.tpu.get_device_properties().total_memory == 16 * 1024**3 and mem.used == 0
