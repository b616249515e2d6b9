"""``hf-tpu env``: what is installed, which TPU runtime this process gets, and what is known to break.

Everything is read from package metadata, sysfs and the environment: nothing initialises torch_tpu's device
(on a host without chips libtpu would look for the cloud metadata server for minutes), and torch is imported
only when the simulated device is on or real chips are present.

Example:
    $ hf-tpu env
    $ hf-tpu env --json
    $ hf-tpu --simulate env --check     # exit status 1 when an error-level problem is found
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any, Literal

from hf_tpu import _torch_tpu

__all__ = ["PACKAGES", "Finding", "collect", "find_problems", "format_table", "register", "run"]

# (label, distribution name) in the order they are shown; None = not a distribution.
PACKAGES: list[tuple[str, str | None]] = [
    ("python", None),
    ("hf_tpu", None),
    ("torch", "torch"),
    ("torch-tpu", "torch-tpu"),
    ("libtpu", "libtpu"),
    ("transformers", "transformers"),
    ("diffusers", "diffusers"),
    ("accelerate", "accelerate"),
    ("kernels", "kernels"),
    ("huggingface_hub", "huggingface_hub"),
    ("jax", "jax"),
    ("jaxlib", "jaxlib"),
    ("torch_xla", "torch_xla"),
]

# What torch-tpu 0.2.0 declares (Requires-Dist); used when torch-tpu is not installed to say whether it could be.
TORCH_TPU_TORCH_RANGE = ">=2.11.0,<=2.15.0"

# The ranges hf_tpu is written for and tested with (the oldest and newest releases tested, docs/compatibility.md),
# listed by `hf-tpu env` beside each version; outside one, a warning naming it (an error for transformers). Must agree
# with pyproject.toml (a test checks it).
REQUIREMENTS: dict[str, str] = {
    "torch": ">=2.11,<=2.15",
    "transformers": ">=5.23,<5.26",
    "diffusers": ">=0.42,<0.43",
    "accelerate": ">=1.15,<1.17",
    "kernels": ">=0.17,<0.20",
    "huggingface_hub": ">=2.4,<2.5",
}

# Environment variables that change what hf_tpu, torch_tpu or libtpu do.
ENV_NAMES = ("HF_TPU_SIMULATE", "TORCH_DEVICE_BACKEND_AUTOLOAD", "PJRT_DEVICE", "XLA_FLAGS", "JAX_PLATFORMS")
ENV_PREFIXES = ("HF_TPU_", "TPU_", "TORCH_TPU_", "LIBTPU_")

Level = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One known problem: how bad it is, what was found, and what to do."""

    level: Level
    problem: str
    fix: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    from hf_tpu import __version__

    out: dict[str, str | None] = {}
    for label, dist in PACKAGES:
        if label == "python":
            out[label] = platform.python_version()
        elif label == "hf_tpu":
            out[label] = __version__
        else:
            out[label] = _version(dist)
    return out


def _relevant_env() -> dict[str, str]:
    return {
        k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or any(k.startswith(p) for p in ENV_PREFIXES)
    }


def _torch_tpu_requirement(name: str) -> str | None:
    """The version specifier the installed torch-tpu declares for ``name`` (e.g. torch, libtpu)."""
    for req in importlib.metadata.requires("torch-tpu") or []:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*([^;]*)", req)
        if m and m.group(1).lower().replace("_", "-") == name and ";" not in req:
            return m.group(3).strip() or None
    return None


def _contains(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except InvalidVersion:
        return True  # an unparseable local build: do not cry wolf


def _autoload(versions: dict[str, str | None], env: dict[str, str]) -> bool:
    """Whether ``import torch`` loads torch_tpu in this environment (its ``torch.backends`` entry point)."""
    if versions.get("torch-tpu") is None:
        return False
    eps = importlib.metadata.entry_points(group="torch.backends")
    return any(ep.name == "torch_tpu" for ep in eps) and env.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "0"


def find_problems(
    versions: dict[str, str | None],
    runtime: dict[str, Any],
    env: dict[str, str],
    torch_tpu_torch_range: str | None = None,
) -> list[Finding]:
    """The known incompatibilities of an environment, most serious first.

    ``versions`` maps package labels (see :data:`PACKAGES`) to versions or None, ``runtime`` is
    ``RuntimeInfo.to_dict()`` plus ``pci_functions`` / ``pci_vfio``, ``env`` the relevant environment variables.

    Example:
        >>> find_problems({"torch": "2.9.0", "torch-tpu": None}, {"mode": "none"}, {})[0].level
        'warning'
    """
    out: list[Finding] = []
    torch_v, tt_v, libtpu_v = versions.get("torch"), versions.get("torch-tpu"), versions.get("libtpu")
    mode = runtime.get("mode")
    pci_functions, pci_vfio = runtime.get("pci_functions", 0), runtime.get("pci_vfio", 0)

    if torch_v is None:
        out.append(Finding("error", "torch is not installed", "pip install torch==2.13.0"))
    else:
        torch_range = torch_tpu_torch_range or TORCH_TPU_TORCH_RANGE
        if not _contains(torch_range, torch_v):
            if tt_v:
                out.append(
                    Finding(
                        "error",
                        f"torch {torch_v} is outside the range torch-tpu {tt_v} supports ({torch_range}): "
                        "its C++ glue will not load",
                        f"pip install 'torch{torch_range}' (e.g. torch==2.13.0)",
                    )
                )
            else:
                out.append(
                    Finding(
                        "warning",
                        f"torch {torch_v} is outside the range torch-tpu 0.2.0 supports ({torch_range}): "
                        "installing torch-tpu would replace it",
                        "pip install torch==2.13.0 before installing hf-tpu",
                    )
                )
    if tt_v and not libtpu_v:
        out.append(
            Finding(
                "error",
                f"torch-tpu {tt_v} is installed without libtpu: it cannot drive a TPU",
                "pip install libtpu (or pip install 'hf-tpu[tpu]')",
            )
        )
    if pci_functions and not tt_v:
        out.append(
            Finding(
                "error",
                f"{pci_functions} TPU PCI device(s) on this host but torch-tpu is not installed",
                "pip install 'hf-tpu[tpu]' (torch-tpu and libtpu)",
            )
        )
    if pci_functions and not pci_vfio:
        out.append(
            Finding(
                "error",
                f"{pci_functions} TPU PCI device(s) but none exposed through VFIO: torch-tpu sees no chip",
                "bind the chips to vfio-pci (a TPU VM image does this) and check that no other process holds them",
            )
        )
    for name, spec in REQUIREMENTS.items():
        v = versions.get(name)
        if name == "torch" or v is None:
            continue
        if not _contains(spec, v):
            level: Level = "error" if name == "transformers" else "warning"
            out.append(
                Finding(
                    level,
                    f"{name} {v} is outside the range hf_tpu is written for ({spec})",
                    f"pip install '{name}{spec}'",
                )
            )
    for name in ("transformers", "accelerate"):
        if versions.get(name) is None:
            out.append(
                Finding("error", f"{name} is not installed", "pip install -e . (installs hf_tpu's dependencies)")
            )
    native = runtime.get("sim_native") or ""
    if mode == "simulated" and native.startswith("unavailable"):
        out.append(
            Finding(
                "warning",
                f"the simulator's native core is {native}",
                "install a C++ compiler and ninja (pip install ninja) for ~2-6x faster simulated ops, or set "
                "HF_TPU_SIM_NATIVE=0 to choose the Python path",
            )
        )
    if pci_vfio and env.get("HF_TPU_SIMULATE", "").lower() in ("1", "true", "yes", "on"):
        out.append(
            Finding(
                "warning",
                "HF_TPU_SIMULATE is set on a host with TPU chips: the simulator refuses to run next to real chips",
                "unset HF_TPU_SIMULATE",
            )
        )
    if pci_vfio and tt_v and env.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
        out.append(
            Finding(
                "warning",
                "TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch_tpu is not loaded with torch, so 'tpu' is not a device yet",
                "unset TORCH_DEVICE_BACKEND_AUTOLOAD, or import torch_tpu before using the tpu device",
            )
        )
    if versions.get("torch_xla"):
        out.append(
            Finding(
                "warning",
                f"torch_xla {versions['torch_xla']} is installed next to torch: it pins its own torch and drives "
                "libtpu itself; hf_tpu uses torch-tpu",
                "pip uninstall torch_xla (use a separate environment for it)",
            )
        )
    if tt_v and not pci_functions and mode == "none":
        out.append(
            Finding(
                "info",
                f"torch-tpu {tt_v} is installed but this host has no TPU chips: 'tpu' is not a valid device here",
                "pass --simulate (or set HF_TPU_SIMULATE=1) to use the simulated tpu device, or run on a TPU VM",
            )
        )
    if mode == "none" and not tt_v and not pci_functions:
        out.append(
            Finding(
                "info",
                "no TPU and the simulated device is off: asking for 'tpu' raises TPUNotAvailableError",
                "pass --simulate (or set HF_TPU_SIMULATE=1), or install 'hf-tpu[tpu]' on a TPU VM",
            )
        )
    if libtpu_v and not tt_v:
        out.append(Finding("info", f"libtpu {libtpu_v} is installed without torch-tpu", "pip install 'hf-tpu[tpu]'"))
    if versions.get("jax") is None:
        out.append(
            Finding(
                "info",
                "jax is not installed: the kernels' XLA path (ragged-dot MoE experts on a CPU host) is unavailable",
                "pip install 'hf-tpu[kernels]'",
            )
        )
    elif versions.get("jaxlib") is None:
        out.append(
            Finding("warning", "jax is installed without jaxlib: it cannot run", "pip install 'hf-tpu[kernels]'")
        )
    if "PJRT_DEVICE" in env:
        out.append(
            Finding(
                "info",
                f"PJRT_DEVICE={env['PJRT_DEVICE']} is a torch_xla setting; torch_tpu and hf_tpu do not read it",
                "unset PJRT_DEVICE unless torch_xla needs it",
            )
        )
    tier2 = env.get(_torch_tpu.TIER2_ENV, "")
    if "/" in tier2:
        out.append(
            Finding(
                "warning",
                f"{_torch_tpu.TIER2_ENV}={tier2} is a path, but torch_tpu takes a cache *name* there (its tier-2 "
                f"cache lives in {_torch_tpu.TIER2_ROOT}/<name>, per host, gone after a restart)",
                f"set {_torch_tpu.TIER2_ENV} to a plain name, and {_torch_tpu.TIER3_ENV}={tier2} for a persistent "
                "cache (or let hf_tpu's cache_dir / HF_TPU_COMPILE_CACHE set both)",
            )
        )
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda f: order[f.level])


def collect() -> dict[str, Any]:
    """Everything ``hf-tpu env`` reports, as plain data (what ``--json`` prints).

    Example:
        >>> report = collect()  # doctest: +SKIP
        >>> report["runtime"]["mode"]  # doctest: +SKIP
        'none'
    """
    from hf_tpu import runtime

    versions = package_versions()
    env = _relevant_env()
    info = runtime.detect().to_dict()
    scan = runtime.scan_pci()
    info["pci_functions"], info["pci_vfio"] = scan.functions, scan.vfio
    if info.get("generation") is None:
        info["generation"] = scan.generation
    if info.get("mode") == "simulated":
        from hf_tpu.sim import _native, _torch_tpu_ops
        from hf_tpu.sim._counters import STATE

        info["sim_native"] = _native.status()
        info["sim_refused_ops"] = (
            f"{len(_torch_tpu_ops.REFUSED)} aten ops refused as torch-tpu {_torch_tpu_ops.TORCH_TPU_VERSION} refuses "
            f"them; CPU fallback {'on' if STATE.cpu_fallback else 'off'} "
            f"(hf_tpu.sim.execution_mode.enable_cpu_fallback), {STATE.cpu_fallbacks} op(s) run on the host"
        )
    torch_range = _torch_tpu_requirement("torch") if versions.get("torch-tpu") else None
    problems = find_problems(versions, info, env, torch_range)
    return {
        "versions": versions,
        "tested_ranges": dict(REQUIREMENTS),
        "runtime": info,
        "torch_tpu_autoload": _autoload(versions, env),
        "torch_imported": "torch" in sys.modules,
        "env": env,
        "torch_tpu_cache": _torch_tpu.cache_tiers(),
        "problems": [asdict(p) for p in problems],
    }


def _gib(n: int | None) -> str:
    return f"{n / 1024**3:.1f} GiB" if n else "-"


def format_table(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`collect`'s report."""
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, str]]) -> None:
        lines.append(title)
        width = max((len(k) for k, _ in rows), default=0)
        lines.extend(f"  {k.ljust(width)}  {v}" for k, v in rows)
        lines.append("")

    tested = report.get("tested_ranges", {})
    section("Versions", [(k, (v or "not installed") + (f"  (hf_tpu's range: {tested[k]})" if k in tested else ""))
                         for k, v in report["versions"].items()])  # fmt: skip
    rt = report["runtime"]
    gen = rt.get("generation")
    section(
        "TPU runtime",
        [
            ("mode", rt["mode"]),
            ("reason", rt.get("reason", "")),
            ("devices (this process)", str(rt.get("device_count", 0))),
            ("TPU chips on host", f"{rt.get('pci_vfio', 0)} usable, {rt.get('pci_functions', 0)} on the PCI bus"),
            ("generation", gen or "-"),
            ("HBM per device", _gib(rt.get("hbm_bytes"))),
            ("torch_tpu autoload", "on" if report["torch_tpu_autoload"] else "off"),
            *([("simulator native core", rt["sim_native"])] if rt.get("sim_native") else []),
            *([("simulator op table", rt["sim_refused_ops"])] if rt.get("sim_refused_ops") else []),
        ],
    )
    tiers = report["torch_tpu_cache"]
    section(
        "torch_tpu compilation cache",
        [
            ("tier 1", "in this process's memory"),
            ("tier 2 (per host)", f"{tiers['tier2']['where']}  [{tiers['tier2']['variable']}]"),
            ("tier 3 (persistent)", f"{tiers['tier3']['where']}  [{tiers['tier3']['variable']}]"),
        ],
    )
    env = report["env"]
    if env:
        section("Environment", list(env.items()))
    else:
        lines.extend(["Environment: none of the variables that matter is set", ""])
    problems = report["problems"]
    if not problems:
        lines.append("Known problems: none")
    else:
        lines.append("Known problems")
        for p in problems:
            lines.append(f"  [{p['level']}] {p['problem']}")
            lines.append(f"      fix: {p['fix']}")
    return "\n".join(lines).rstrip() + "\n"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "env",
        help="versions, TPU runtime mode, chips and HBM, known incompatibilities and their fixes",
        description="Report versions, the TPU runtime this process gets, and known problems with their fixes. "
        "Never initialises a TPU.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when an error-level problem is found")
    return parser


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_table(report), end="")
    if args.check and any(p["level"] == "error" for p in report["problems"]):
        return 1
    return 0
