"""A fake sysfs PCI tree, as a TPU VM shows it to torch_tpu's and hf_tpu's chip scans (``tests/`` is on ``sys.path``
through tests/conftest.py). Used by tests/test_runtime.py and, against the wheel's own scan, by tests/contract."""

from __future__ import annotations

from pathlib import Path


def make_sysfs(root: str | Path, devices: list[tuple[str, str, bool]]) -> tuple[Path, Path]:
    """One PCI function per ``(vendor, device id, exposed through VFIO)``; returns ``(pci_dir, vfio_dir)``."""
    root = Path(root)
    pci, vfio, groups = root / "pci", root / "vfio", root / "iommu_groups"
    for d in (pci, vfio, groups):
        d.mkdir(parents=True, exist_ok=True)
    for i, (vendor, device, exposed) in enumerate(devices):
        dev = pci / f"0000:00:{i + 4:02x}.0"
        dev.mkdir()
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "device").write_text(device + "\n")
        group = groups / str(10 + i)
        group.mkdir()
        (dev / "iommu_group").symlink_to(group)
        if exposed:
            (vfio / str(10 + i)).write_text("")
    return pci, vfio
