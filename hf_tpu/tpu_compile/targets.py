"""The TPUs a program can be compiled for without one: libtpu's described topologies, with each chip's HBM, HBM
bandwidth and peak bf16 FLOP rate (Google's published per-chip figures), used to project a step's time from the
compiler's byte and FLOP counts.

Example:
    >>> from hf_tpu.tpu_compile.targets import target
    >>> t = target("v6e-1")
    >>> t.topology, t.chips, t.hbm_bytes // 2**30
    ('v6e:1x1', 1, 32)
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_tpu.errors import UserError

__all__ = ["TARGETS", "Target", "UnknownTargetError", "target"]

GiB = 1024**3


class UnknownTargetError(UserError, ValueError):
    """A target name that is not in :data:`TARGETS`."""


@dataclass(frozen=True)
class Target:
    """A TPU slice hf_tpu compiles for: ``topology`` is the name libtpu describes it by
    (``jax.experimental.topologies.get_topology_desc(topology, "tpu")``). Figures are per *device*, the unit one
    torch_tpu process owns and one program runs on: a chip, or half a chip on v7 (two devices per chip).

    Attributes:
        name: the key in :data:`TARGETS` (``"v6e-1"``, ...).
        topology: libtpu's name of the slice (``"v6e:1x1"``, ...).
        chips: the chips in the slice.
        hbm_bytes: HBM per device, in bytes.
        hbm_bandwidth: HBM bandwidth per device, in bytes per second.
        peak_flops: peak bfloat16 FLOP/s per device.
        devices_per_chip: torch_tpu devices per chip (2 on v7, else 1).
    """

    name: str
    topology: str
    chips: int
    hbm_bytes: int  # per device
    hbm_bandwidth: float  # bytes/s per device
    peak_flops: float  # bf16 FLOP/s per device
    devices_per_chip: int = 1

    def describe(self) -> str:
        """One line for reports.

        Returns:
            The name, chip count, and HBM size and bandwidth per chip (per device for two-device chips).
        """
        unit = "device, half a chip" if self.devices_per_chip == 2 else "chip"
        return (
            f"{self.name} ({self.chips} chip{'s' if self.chips > 1 else ''}, {self.hbm_bytes / GiB:.0f} GiB HBM and "
            f"{self.hbm_bandwidth / 1e12:.2f} TB/s per {unit})"
        )


def _family(prefix: str, topologies: dict[int, str], hbm_gib: float, bw: float, flops: float, per_chip: int = 1):
    return {
        f"{prefix}-{n}": Target(f"{prefix}-{n}", topo, n, int(hbm_gib * GiB), bw, flops, per_chip)
        for n, topo in topologies.items()
    }


#: Target name -> :class:`Target`. Names follow Cloud TPU's slice names (``v6e-4`` = 4 chips).
TARGETS: dict[str, Target] = {
    **_family("v5e", {1: "v5e:1x1", 4: "v5e:2x2", 8: "v5e:2x4"}, 16, 819e9, 197e12),
    **_family("v6e", {1: "v6e:1x1", 4: "v6e:2x2", 8: "v6e:2x4"}, 32, 1640e9, 918e12),
    **_family("v5p", {4: "v5p:2x2x1", 8: "v5p:2x2x2"}, 95, 2765e9, 459e12),
    # v7 (Ironwood): 192 GiB, 7.37 TB/s and 2,307 bf16 TFLOP/s per chip, which libtpu and torch_tpu show as two
    # devices (tpu7x:2x2x1 has 8 devices for 4 chips): a program runs on one, with half of each.
    **_family("tpu7x", {4: "tpu7x:2x2x1", 8: "tpu7x:2x2x2"}, 96, 3685e9, 1153.5e12, per_chip=2),
}


def target(name: str) -> Target:
    """The :class:`Target` called ``name``.

    Args:
        name: a key of :data:`TARGETS` (``"v5e-1"``, ``"v6e-8"``, ...).

    Returns:
        The :class:`Target`.

    Raises:
        UnknownTargetError: ``name`` is not one of :data:`TARGETS` (the message lists them).
    """
    found = TARGETS.get(name)
    if found is None:
        raise UnknownTargetError(f"unknown TPU target {name!r}: use one of {', '.join(TARGETS)}")
    return found
