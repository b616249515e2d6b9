"""The chip tier's plumbing: where it runs, how a case skips, and the records it writes as the cases come.

Where (:func:`tier_mode`): on a real TPU (chips exposed through VFIO and torch-tpu installed, read from the PCI bus
without opening any device) the tier runs when it is the session's whole selection (``-m chip``, one process: one
program at a time may hold a chip); with ``HF_TPU_CHIP_TIER=simulate`` it runs on the simulated device (a CPU host);
anywhere else every case is skipped with the command to run. Nothing here imports torch or transformers.

Records (:class:`ChipRecords`): one JSON file (``--chip-record PATH`` or ``HF_TPU_CHIP_RECORD``) with a header (date,
commit, versions, device) and one row per case ``{"test", "passed", "outcome", "seconds", "precision", "tolerance",
"max_err", "reason"}``, rewritten (atomically) after every phase of every case, so that a machine that stops
answering leaves every finished case on disk. A case's comparisons (:class:`Comparison`, reported through the report's
``user_properties``, which also cross xdist) give ``precision``, ``tolerance`` and ``max_err``: the worst one of the
case, by ``max_err / tolerance``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TIER_ENV = "HF_TPU_CHIP_TIER"  # "simulate": run on the simulated device
RECORD_ENV = "HF_TPU_CHIP_RECORD"  # the records' file (or --chip-record PATH)
COMMIT_ENV = "HF_TPU_COMMIT"  # the commit for the header where the checkout has no .git (a copied tree)
SUBPROCESS_ENV = "HF_TPU_CHIP_SUBPROCESS_S"  # seconds a case's own process may run (default: the suite's safety)
COMMAND = "python -m pytest -m chip tests/chip -p no:xdist -p no:cacheprovider"
PROPERTY = "hf_tpu_chip_comparison"  # the user_properties key a comparison travels under
VERSIONS = ("torch", "torch-tpu", "libtpu", "transformers")
OTHER_PACKAGES = ("accelerate", "diffusers", "torchao", "peft", "jax", "fastapi", "uvicorn", "openai", "httpx", "httpx2",
                  "prometheus-client")  # fmt: skip


_STATE = {"device_opened": False}


def device_opened() -> bool:
    """Whether this process has opened the ``tpu`` device (then a child process cannot have the chip)."""
    return _STATE["device_opened"]


def mark_device_opened() -> None:
    _STATE["device_opened"] = True


@dataclass(frozen=True)
class TierMode:
    """Where the tier runs in this session: ``mode`` is ``"real"``, ``"simulate"`` or None (skip, ``reason``)."""

    mode: str | None
    reason: str = ""
    generation: str | None = None
    chips: int = 0


def no_chip_reason() -> str:
    return f"needs a TPU chip: run `{COMMAND}` on a TPU VM, or set {TIER_ENV}=simulate"


def tier_mode(environ: dict[str, str] | None = None, *, selected: bool = True, scan: Any = None) -> TierMode:
    """Decide where the tier runs, without opening a device.

    Args:
        environ: the environment (default: ``os.environ``).
        selected: whether the session selected the tier on its own (``-m chip``, no xdist worker); a real chip is
            used only then.
        scan: a :class:`hf_tpu.runtime.PciScan` (tests pass one); default: the host's PCI bus.

    Returns:
        A :class:`TierMode`.
    """
    environ = os.environ if environ is None else environ
    asked = environ.get(TIER_ENV, "").strip().lower()
    if asked == "simulate":
        return TierMode("simulate")
    if asked not in ("", "real", "auto"):
        return TierMode(None, f"{TIER_ENV}={asked!r} is not known: set it to 'simulate', or unset it on a TPU VM")
    if scan is None:
        from hf_tpu.runtime import scan_pci

        scan = scan_pci()
    torch_tpu = _version("torch-tpu") or (importlib.util.find_spec("torch_tpu") and "unknown")
    if not scan.vfio or not torch_tpu:
        reason = no_chip_reason()
        if scan.vfio:
            reason = (
                f"this host has {scan.vfio} TPU chip(s) but torch-tpu is not installed (pip install -e '.[tpu]'); "
                + reason
            )
        return TierMode(None, reason, scan.generation, scan.vfio)
    if not selected:
        return TierMode(None, f"a TPU chip is here, but the chip tier runs alone, in one process: `{COMMAND}`",
                        scan.generation, scan.vfio)  # fmt: skip
    return TierMode("real", "", scan.generation, scan.vfio)


def session_selects_tier(markexpr: str, environ: dict[str, str] | None = None) -> bool:
    """Whether a session runs the tier alone: ``-m`` names ``chip`` (not ``not chip``) and it is no xdist worker."""
    environ = os.environ if environ is None else environ
    expr = " ".join(markexpr.split())
    return "chip" in expr and "not chip" not in expr and "PYTEST_XDIST_WORKER" not in environ


def skip_and_order(items: list, mode: TierMode) -> None:
    """The collection hook's work (tests/chip/conftest.py): every ``chip`` case skipped, with the mode's reason, where
    the tier does not run; the chip cases ordered by ``chip(order=N)`` (default 50; stable), the other tests left
    where they are."""
    import pytest

    positions = [i for i, item in enumerate(items) if item.get_closest_marker("chip")]
    chip_items = [items[i] for i in positions]
    if mode.mode is None:
        for item in chip_items:
            item.add_marker(pytest.mark.skip(reason=mode.reason))
    ordered = sorted(chip_items, key=lambda item: item.get_closest_marker("chip").kwargs.get("order", 50))
    for i, item in zip(positions, ordered, strict=True):
        items[i] = item


def missing_packages(*names: str) -> str | None:
    """A skip reason naming the packages (import names) that are not installed, or None when all are."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if not missing:
        return None
    pip = {"prometheus_client": "prometheus-client", "compressed_tensors": "compressed-tensors"}
    return f"needs {', '.join(missing)}: pip install {' '.join(pip.get(n, n) for n in missing)}"


def subprocess_seconds(environ: dict[str, str] | None = None) -> float:
    """Seconds a case's own process may run: ``HF_TPU_CHIP_SUBPROCESS_S`` (a machine whose commands are capped sets
    it), else the suite's one safety timeout (tests/_timeouts.py)."""
    from _timeouts import SAFETY_TIMEOUT_S

    environ = os.environ if environ is None else environ
    value = environ.get(SUBPROCESS_ENV, "").strip()
    return float(value) if value else float(SAFETY_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------------------------
# Comparisons and records
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """One comparison of a case against the CPU: float32 (``precision`` the matmul precision in force, ``tolerance``
    of :func:`hf_tpu.numerics.float32_tolerance`, ``max_err`` = ``max|tpu - cpu| / max|cpu|``), bfloat16
    (``precision="bfloat16"``), or a count (tokens that differ, graphs compiled: ``tolerance`` the count allowed)."""

    what: str
    precision: str | None
    tolerance: float | None
    max_err: float | None

    def badness(self) -> float:
        """``max_err / tolerance`` (a count over an allowance of 0: 0 when equal, infinite otherwise)."""
        if self.max_err is None:
            return -1.0
        if not self.tolerance:
            return 0.0 if self.max_err == 0 else math.inf
        return self.max_err / self.tolerance


def worst(comparisons: list[Comparison]) -> Comparison | None:
    """The comparison closest to (or furthest past) its tolerance; the first of equals."""
    best: Comparison | None = None
    for c in comparisons:
        if best is None or c.badness() > best.badness():
            best = c
    return best


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def commit(environ: dict[str, str] | None = None) -> str | None:
    """``HF_TPU_COMMIT``, else ``git rev-parse HEAD`` of the checkout (with ``+dirty`` when tracked files changed)."""
    environ = os.environ if environ is None else environ
    if environ.get(COMMIT_ENV):
        return environ[COMMIT_ENV]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True,
                              timeout=subprocess_seconds(environ)).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, check=False,
                               capture_output=True, text=True, timeout=subprocess_seconds(environ)).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def header(mode: TierMode, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The records' header: date (UTC), commit, the tier's mode and device, versions, the optional packages found."""
    if mode.mode == "real":
        device = (
            f"TPU {mode.generation or '(unknown generation)'} through torch_tpu ({mode.chips} chip(s) on the host)"
        )
    elif mode.mode == "simulate":
        device = "simulated tpu (hf_tpu.sim, CPU memory)"
    else:
        device = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(environ),
        "mode": mode.mode or "skipped",
        "device": device,
        "command": " ".join([Path(sys.executable).name, "-m", "pytest", *sys.argv[1:]]),
        **{name.replace("-", "_"): _version(name) for name in VERSIONS},
        "packages": {name: _version(name) for name in OTHER_PACKAGES},
        "python": sys.version.split()[0],
    }


class ChipRecords:
    """The rows of one session, keyed by test id in the order they came, written to ``path`` after every report."""

    def __init__(self, path: str | os.PathLike, head: dict[str, Any]) -> None:
        self.path = Path(path)
        self.head = dict(head)
        self.rows: dict[str, dict[str, Any]] = {}
        self.write()

    def add(self, report: Any) -> None:
        """Fold one ``TestReport`` (setup, call or teardown) into its test's row and rewrite the file."""
        row = self.rows.setdefault(report.nodeid, {
            "test": report.nodeid, "passed": None, "outcome": None, "seconds": 0.0, "precision": None,
            "tolerance": None, "max_err": None, "reason": None,
        })  # fmt: skip
        row["seconds"] = round(row["seconds"] + float(getattr(report, "duration", 0.0) or 0.0), 3)
        found = [Comparison(**value) for key, value in getattr(report, "user_properties", ()) if key == PROPERTY]
        chosen = worst(found)
        if chosen is not None:
            row.update(precision=chosen.precision, tolerance=chosen.tolerance, max_err=chosen.max_err)
        if report.skipped:
            row.update(outcome="skipped", passed=None, reason=_skip_reason(report))
        elif report.failed:
            row.update(outcome="failed", passed=False, reason=_failure(report))
        elif report.when == "call" or (report.when == "teardown" and row["outcome"] is None):
            row.update(outcome="passed", passed=True)
        self.write()

    def summary(self) -> dict[str, int]:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for row in self.rows.values():
            if row["outcome"] in counts:
                counts[row["outcome"]] += 1
        return counts

    def write(self) -> None:
        data = {**self.head, "summary": self.summary(), "rows": list(self.rows.values())}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)[-500:]


def _failure(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text[-1500:]


def comparison_property(c: Comparison) -> tuple[str, dict[str, Any]]:
    """The ``user_properties`` entry of a comparison (plain data, so it crosses xdist)."""
    return PROPERTY, asdict(c)
