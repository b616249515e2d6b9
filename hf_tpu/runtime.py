"""Which TPU this process has: a real one through torch_tpu, the simulated one, or none.

The decision is made once per process and never falls back silently: asking for ``tpu`` with neither real
chips nor the simulator raises :class:`TPUNotAvailableError`, which says how to get one or the other.

An unknown attribute raises the built-in ``AttributeError`` from the module's ``__getattr__`` (the protocol
``hasattr`` and ``getattr`` with a default rely on), not an hf_tpu error.

Example:
    >>> from hf_tpu import runtime
    >>> info = runtime.detect()
    >>> info.mode in ("real", "simulated", "none")
    True
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from hf_tpu.errors import UserError

__all__ = [
    "GENERATIONS",
    "PciScan",
    "RuntimeInfo",
    "TPUNotAvailableError",
    "detect",
    "device_count",
    "hbm_bytes",
    "is_real",
    "is_simulated",
    "require_tpu",
    "scan_pci",
    "scan_pci_chips",
    "simulated_distributed",
]

GiB = 1024**3

# GENERATIONS (a module attribute computed on first use, see __getattr__): the TPU generations torch_tpu knows,
# read through hf_tpu._torch_tpu from the installed torch-tpu's hardware tables, or from hf_tpu's copy of 0.2.0's
# tables where torch-tpu is absent (tests/contract keeps the copy equal to the wheel). Per generation: name,
# hbm_per_chip, devices_per_chip (v7: 2 devices per chip, each seeing half the HBM), pci_id, and topologies
# (devices per host -> TORCH_TPU_TOPOLOGY). torch_tpu shows one device per process.
_GOOGLE_PCI_VENDOR = "0x1ae0"
GENERATIONS: dict[str, dict]  # declared for readers and linters; the value comes from __getattr__


def _generations() -> dict[str, dict]:
    from hf_tpu import _torch_tpu

    return {
        key: {
            "name": g.name,
            "hbm_per_chip": g.hbm_per_chip,
            "devices_per_chip": g.devices_per_chip,
            "pci_id": g.pci_id,
            "topologies": dict(g.topologies),
        }
        for key, g in _torch_tpu.generations().items()
    }


def __getattr__(name: str):
    if name == "GENERATIONS":
        return _generations()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Mode = Literal["real", "simulated", "none"]

INSTALL_HINT = (
    "install torch-tpu on a TPU VM (`pip install 'hf-tpu[tpu]'`), or run on the simulated device: set "
    "HF_TPU_SIMULATE=1, call hf_tpu.sim.enable(), or pass --simulate to the hf-tpu command"
)


class TPUNotAvailableError(UserError, RuntimeError):
    """A TPU was asked for, and this process has neither real TPU chips nor the simulated device."""


@dataclass(frozen=True)
class RuntimeInfo:
    """Which TPU this process runs on, as :func:`detect` decided it (``hf-tpu env`` prints it).

    Attributes:
        mode: ``"real"`` (torch_tpu on TPU chips), ``"simulated"`` (:mod:`hf_tpu.sim`) or ``"none"``.
        device_count: devices this process can address (torch_tpu: 1 per process, seen as ``tpu:0``).
        chips_on_host: TPU devices on the PCI bus exposed through VFIO, as torch_tpu counts them (v7: 2 per chip).
        hbm_bytes: memory of one device, in bytes.
        generation: key of :data:`GENERATIONS` (``"v5e"``, ...), or None when unknown.
        torch_tpu_version: the installed torch-tpu's version, or None.
        libtpu_version: the installed libtpu's version, or None.
        reason: why this mode was chosen, in words.
    """

    mode: Mode
    device_count: int  # devices this process can address (torch_tpu: 1 per process, seen as tpu:0)
    chips_on_host: int  # TPU devices on the PCI bus exposed through VFIO, as torch_tpu counts them (v7: 2 per chip)
    hbm_bytes: int  # memory of one device
    generation: str | None  # key of GENERATIONS, or None
    torch_tpu_version: str | None
    libtpu_version: str | None
    reason: str  # why this mode was chosen, for `hf-tpu env`

    def to_dict(self) -> dict:
        """The fields as a plain dict.

        Returns:
            Each field's name mapped to its value (for JSON output).
        """
        return asdict(self)


_SIMULATED: RuntimeInfo | None = None
# The simulator's side of torch.distributed, handed over by hf_tpu.sim.enable (see simulated_distributed).
_SIM_DISTRIBUTED: Any = None


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# Where the PCI scan looks; tests point these at a fake tree.
PCI_ROOT = "/sys/bus/pci/devices"
VFIO_ROOT = "/dev/vfio"


@dataclass(frozen=True)
class PciScan:
    """What the PCI bus shows, read from sysfs the way torch_tpu's ``hardware`` module does.

    Attributes:
        functions: Google TPU PCI functions of a known generation.
        vfio: of those, the ones exposed through VFIO: the devices torch_tpu can use (v7: 2 per chip).
        generation: key of :data:`GENERATIONS` of the first one found, or None.
    """

    functions: int  # Google TPU PCI functions of a known generation
    vfio: int  # of those, the ones exposed through VFIO: the devices torch_tpu can use (v7: 2 per chip)
    generation: str | None  # key of GENERATIONS, or None


def scan_pci(root: str | os.PathLike | None = None, vfio_root: str | os.PathLike | None = None) -> PciScan:
    """Scan the PCI bus for Google TPUs without initialising any runtime (no libtpu, no metadata server).

    torch_tpu 0.2.0 counts a TPU function only when its IOMMU group is present under ``/dev/vfio``; ``vfio``
    is that count, ``functions`` counts every TPU function so that a chip bound to another driver is reported.

    Args:
        root: the sysfs PCI devices folder; None (the default) reads ``/sys/bus/pci/devices`` (tests point it at
            a fake tree).
        vfio_root: the VFIO folder; None (the default) reads ``/dev/vfio``.

    Returns:
        A :class:`PciScan`: TPU functions found, how many are exposed through VFIO, and their generation (all
        zero / None when the folder cannot be read).

    Example:
        >>> scan_pci("/nonexistent")
        PciScan(functions=0, vfio=0, generation=None)
    """
    by_pci = {v["pci_id"]: k for k, v in _generations().items()}
    base = Path(PCI_ROOT if root is None else root)
    vfio_base = Path(VFIO_ROOT if vfio_root is None else vfio_root)
    functions = vfio = 0
    generation = None
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return PciScan(0, 0, None)
    for dev in entries:
        try:
            if (dev / "vendor").read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            device_id = (dev / "device").read_text().strip()
        except OSError:
            continue
        if device_id not in by_pci:
            continue
        functions += 1
        generation = generation or by_pci[device_id]
        try:
            (vfio_base / (dev / "iommu_group").readlink().name).stat()
        except OSError:
            continue
        vfio += 1
    return PciScan(functions, vfio, generation)


def scan_pci_chips(root: str | os.PathLike | None = None) -> tuple[int, str | None]:
    """``(TPU PCI functions, generation)`` on this host; see :func:`scan_pci`.

    Args:
        root: the sysfs PCI devices folder; None (the default) reads ``/sys/bus/pci/devices``.

    Returns:
        The number of TPU PCI functions (whether or not exposed through VFIO) and the generation's key of
        :data:`GENERATIONS` (None when there are none).

    Example:
        >>> scan_pci_chips("/nonexistent")
        (0, None)
    """
    scan = scan_pci(root)
    return scan.functions, scan.generation


def _set_simulated(info: RuntimeInfo | None, distributed: Any = None) -> None:
    """Called by :mod:`hf_tpu.sim` when it registers (or, in tests, forgets) the simulated device; ``distributed``
    hands over the simulator's side of ``torch.distributed`` (:func:`simulated_distributed`)."""
    global _SIMULATED, _SIM_DISTRIBUTED
    _SIMULATED = info
    _SIM_DISTRIBUTED = distributed if info is not None else None
    detect.cache_clear()


def simulated_distributed() -> Any | None:
    """The simulator's side of ``torch.distributed`` (:class:`hf_tpu.sim.DistributedSide`: ``register()`` of its
    ``tpu_dist`` backend, ``prepare_rank()``) when this process runs on the simulated device, else None.

    Distributed code asks here, so that it never imports the simulator (which stays the bottom of the house).

    Returns:
        The simulator's side, or None without the simulated device.

    Example:
        >>> side = simulated_distributed()
        >>> side is None or hasattr(side, "register")
        True
    """
    return _SIM_DISTRIBUTED


def _real_hbm(generation: str | None) -> int:
    import torch

    tpu = getattr(torch, "tpu", None)
    if tpu is not None and hasattr(tpu, "get_device_properties"):
        try:
            return int(tpu.get_device_properties().total_memory)
        except RuntimeError:  # torch_tpu raises on a generation it does not recognise; use the table below
            pass
    if generation is None:
        return 0
    spec = _generations()[generation]
    return int(spec["hbm_per_chip"]) // int(spec["devices_per_chip"])


@functools.cache
def detect() -> RuntimeInfo:
    """Decide the runtime mode of this process (cached; the simulator resets it when it is enabled).

    Returns:
        A :class:`RuntimeInfo`: ``"simulated"`` once :func:`hf_tpu.sim.enable` ran, ``"real"`` when TPU chips are
        exposed through VFIO and torch-tpu is installed, otherwise ``"none"`` with the reason.
    """
    torch_tpu_version = _pkg_version("torch-tpu") or _pkg_version("torch_tpu")
    libtpu_version = _pkg_version("libtpu")
    if _SIMULATED is not None:
        return _SIMULATED
    scan = scan_pci()
    chips, generation = scan.vfio, scan.generation
    if chips and torch_tpu_version:
        return RuntimeInfo(
            mode="real",
            device_count=1,
            chips_on_host=chips,
            hbm_bytes=_real_hbm(generation),
            generation=generation,
            torch_tpu_version=torch_tpu_version,
            libtpu_version=libtpu_version,
            reason=f"{chips} TPU chip(s) on the PCI bus and torch-tpu {torch_tpu_version} installed",
        )
    if scan.functions and not chips:
        reason = (
            f"{scan.functions} TPU PCI device(s) found but none is exposed through VFIO ({VFIO_ROOT}), so "
            "torch-tpu cannot use them: check that the chips are bound to vfio-pci and not held by another driver"
        )
    elif chips:
        reason = f"{chips} TPU chip(s) found but torch-tpu is not installed: pip install 'hf-tpu[tpu]'"
    elif torch_tpu_version:
        reason = f"torch-tpu {torch_tpu_version} is installed but this host has no TPU chips"
    else:
        reason = "no TPU chips and no torch-tpu"
    return RuntimeInfo("none", 0, chips, 0, generation, torch_tpu_version, libtpu_version, reason)


def is_simulated() -> bool:
    """Whether this process runs on the simulated device.

    Returns:
        True when :func:`detect`'s mode is ``"simulated"``.
    """
    return detect().mode == "simulated"


def is_real() -> bool:
    """Whether this process runs on real TPU chips through torch_tpu.

    Returns:
        True when :func:`detect`'s mode is ``"real"``.
    """
    return detect().mode == "real"


def device_count() -> int:
    """TPU devices this process can address.

    Returns:
        :attr:`RuntimeInfo.device_count` of :func:`detect` (0 without a TPU).
    """
    return detect().device_count


def hbm_bytes() -> int:
    """Memory of one TPU device.

    Returns:
        :attr:`RuntimeInfo.hbm_bytes` of :func:`detect`, in bytes (0 without a TPU).
    """
    return detect().hbm_bytes


def require_tpu(what: str = "a tpu device") -> RuntimeInfo:
    """Return the runtime info, or raise :class:`TPUNotAvailableError` naming ``what`` was asked and the fix.

    Args:
        what: what the caller asked for, quoted in the error (``"device_map='tpu'"``, ...).

    Returns:
        The :class:`RuntimeInfo` of :func:`detect`, whose mode is ``"real"`` or ``"simulated"``.

    Raises:
        TPUNotAvailableError: no TPU chips and no simulated device, or torch_tpu cannot be imported.
    """
    info = detect()
    if info.mode == "none":
        raise TPUNotAvailableError(
            f"{what} was requested but this process has no TPU ({info.reason}): {INSTALL_HINT}."
        )
    if info.mode == "real" and importlib.util.find_spec("torch_tpu") is None:  # pragma: no cover - defensive
        raise TPUNotAvailableError(f"{what} was requested but torch_tpu cannot be imported: {INSTALL_HINT}.")
    return info
