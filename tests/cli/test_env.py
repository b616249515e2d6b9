"""``hf-tpu env`` (table and --json, run as a separate process) and the checks behind its "known problems"."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu import __version__, runtime
from hf_tpu.cli import env as env_cmd
from hf_tpu.cli.main import available_commands, build_parser, main

REPO = Path(__file__).resolve().parents[2]


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def hf_tpu_cli(
    *args: str, simulate_env: bool = False, timeout: float = SAFETY_TIMEOUT_S, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE" and not k.startswith("TORCH_TPU_TIER")}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if simulate_env:
        env["HF_TPU_SIMULATE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def expected_versions() -> dict[str, str | None]:
    out = {"python": platform.python_version(), "hf_tpu": __version__}
    for label, dist in env_cmd.PACKAGES:
        if dist is not None:
            out[label] = installed(dist)
    return out


def expected_plain_mode() -> str:
    """What this host is without the simulator: real only with VFIO-exposed chips and torch-tpu installed."""
    return "real" if runtime.scan_pci().vfio and installed("torch-tpu") else "none"


def test_env_json_reports_installed_versions_and_mode():
    proc = hf_tpu_cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"] == expected_versions()
    assert report["versions"]["torch"] == installed("torch") is not None
    assert report["runtime"]["mode"] == expected_plain_mode()
    if report["runtime"]["mode"] == "none":
        assert report["torch_imported"] is False  # nothing touched torch (and so torch_tpu) on a host without chips
    for problem in report["problems"]:
        assert problem["level"] in ("error", "warning", "info") and problem["problem"] and problem["fix"]


def test_env_table_lists_every_version_and_the_mode():
    proc = hf_tpu_cli("env")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label, version in expected_versions().items():
        tested = f"  (hf_tpu's range: {env_cmd.REQUIREMENTS[label]})" if label in env_cmd.REQUIREMENTS else ""
        found = rf"^  {re.escape(label)} +{re.escape((version or 'not installed') + tested)}$"
        assert re.search(found, out, re.MULTILINE), label
    assert re.search(rf"^  mode +{expected_plain_mode()}$", out, re.MULTILINE)
    assert "Known problems" in out
    if not installed("jax"):
        assert "hf-tpu[kernels]" in out


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env-var"])
def test_env_reports_simulated_mode(how):
    if runtime.scan_pci().vfio:
        pytest.skip("this host has TPU chips: the simulator refuses to run here")
    args = {"flag-before": ("--simulate", "env", "--json"), "flag-after": ("env", "--json", "--simulate")}
    proc = hf_tpu_cli(*args.get(how, ("env", "--json")), simulate_env=how == "env-var")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["runtime"]["mode"] == "simulated"
    assert report["runtime"]["device_count"] == 1 and report["runtime"]["hbm_bytes"] > 0
    assert report["runtime"]["generation"] in runtime.GENERATIONS
    assert report["runtime"]["sim_native"].split(" ")[0] in ("on", "off", "unavailable")


def test_check_flag_fails_only_on_error_level_problems(monkeypatch, capsys):
    monkeypatch.setattr(env_cmd, "find_problems", lambda *a, **k: [env_cmd.Finding("warning", "w", "f")])
    assert main(["env", "--check"]) == 0
    monkeypatch.setattr(env_cmd, "find_problems", lambda *a, **k: [env_cmd.Finding("error", "broken", "mend it")])
    assert main(["env", "--check"]) == 1
    out = capsys.readouterr().out
    assert "[error] broken" in out and "fix: mend it" in out


def test_requirements_agree_with_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = {}
    for dep in deps:
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)(.*)", dep).groups()
        specs[name.lower().replace("-", "_")] = spec.replace(" ", "")
    for name, spec in env_cmd.REQUIREMENTS.items():
        assert specs[name] == spec, f"{name}: pyproject says {specs[name]!r}, hf-tpu env checks {spec!r}"


def test_the_compatibility_page_states_the_ranges_hf_tpu_env_checks():
    """docs/compatibility.md's table gives each package's range as pyproject.toml and hf-tpu env have it, and oldest
    and newest tested releases inside that range."""
    from packaging.specifiers import SpecifierSet

    rows = {}
    for line in (REPO / "docs" / "compatibility.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`"):
            rows[cells[0]] = (cells[1].strip("`"), cells[2], cells[3])
    assert set(rows) == set(env_cmd.REQUIREMENTS)
    for name, (spec, oldest, newest) in rows.items():
        assert spec == env_cmd.REQUIREMENTS[name], name
        assert oldest in SpecifierSet(spec) and newest in SpecifierSet(spec), (name, spec, oldest, newest)
    # the two ends are the pins CI installs (.ci/oldest.txt for the oldest tier, .ci/newest.txt for the others)
    for column, pins in ((1, _pins(".ci/oldest.txt")), (2, _pins(".ci/newest.txt"))):
        pins = {name: version for name, version in pins.items() if name not in _optional_ranges()}
        assert set(pins) == set(rows), f"{column}: {sorted(pins)} vs the page's {sorted(rows)}"
        for name, version in pins.items():
            assert rows[name][column] == version, (f"docs/compatibility.md says {name} {rows[name][column]}, "
                                                   f"CI installs {version}: update the page or the pin")  # fmt: skip


def _pins(path: str) -> dict[str, str]:
    """``{package: version}`` of a pins file (``name==version`` lines, ``#`` comments)."""
    pins = {}
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path}: {line!r} is not name==version"
            pins[name.strip()] = version.strip()
    return pins


def _optional_ranges() -> dict[str, str]:
    """``{package: range}`` of pyproject.toml's extras (peft, ...), the core dependencies left out."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ranges = {}
    for dep in (dep for deps in extras.values() for dep in deps):
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^]]*\])?(.*)", dep).groups()
        name = name.lower().replace("-", "_")
        if name not in env_cmd.REQUIREMENTS:
            ranges[name] = spec.split(";")[0].replace(" ", "")
    return ranges


def test_the_newest_pins_sit_at_the_top_of_each_range():
    """A pin bumped in .ci/newest.txt past pyproject.toml's range is named here (pip would refuse the install); a
    range whose upper end leaves a newer minor release untested than the newest pin is named too."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    optional = _optional_ranges()
    for name, version in _pins(".ci/newest.txt").items():
        if name in optional:  # an extra's library, pinned so that CI runs the release the suite was run with
            spec = optional[name]
            assert version in SpecifierSet(spec), f".ci/newest.txt pins {name} {version} outside {spec}"
            continue
        spec = SpecifierSet(env_cmd.REQUIREMENTS[name])
        assert version in spec, f".ci/newest.txt pins {name} {version}, outside pyproject's {spec}: widen the range"
        v = Version(version)
        if name != "torch":  # torch: torch-tpu 0.2.0's own range, of which 2.13.0 is tested
            assert f"{v.major}.{v.minor + 1}.0" not in spec, f"{name} {spec} admits {v.major}.{v.minor + 1}, untested"
    for name, version in _pins(".ci/oldest.txt").items():
        spec = SpecifierSet(env_cmd.REQUIREMENTS[name])
        assert version in spec, f".ci/oldest.txt pins {name} {version}, outside pyproject's {spec}"
        v = Version(version)
        if name != "torch" and v.minor:
            below = f"{v.major}.{v.minor - 1}.99"
            assert below not in spec, f"{name} {spec} admits {below}, older than the oldest tested: raise the range"


def test_env_lists_each_version_beside_its_range(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name, spec in env_cmd.REQUIREMENTS.items():
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert line.endswith(f"(hf_tpu's range: {spec})"), line


# --- find_problems on made-up environments -----------------------------------------------------------------

GOOD = {
    "torch": "2.13.0+cpu",
    "torch-tpu": None,
    "libtpu": None,
    "transformers": "5.24.0",
    "diffusers": "0.42.1",
    "accelerate": "1.15.0",
    "kernels": "0.17.2",
    "huggingface_hub": "2.4.0",
    "jax": "0.10.2",
    "jaxlib": "0.10.2",
    "torch_xla": None,
}
SIMULATED = {"mode": "simulated", "pci_functions": 0, "pci_vfio": 0}


def problems(versions=None, rt=None, env=None, torch_range=None):
    return env_cmd.find_problems({**GOOD, **(versions or {})}, rt or SIMULATED, env or {}, torch_range)


def one(found, level, *words):
    hits = [p for p in found if p.level == level and all(w in p.problem + " " + p.fix for w in words)]
    assert len(hits) == 1, found
    return hits[0]


def test_a_good_simulated_environment_has_no_problems():
    assert problems() == []
    assert problems(rt={**SIMULATED, "sim_native": "on"}) == []
    assert problems(rt={**SIMULATED, "sim_native": "off (HF_TPU_SIM_NATIVE=0)"}) == []  # chosen: nothing to fix


def test_a_simulator_without_its_native_core_says_how_to_get_it():
    found = problems(rt={**SIMULATED, "sim_native": "unavailable (error building extension)"})
    hit = one(found, "warning", "native core", "unavailable")
    assert "compiler" in hit.fix and "HF_TPU_SIM_NATIVE=0" in hit.fix


@pytest.mark.parametrize("torch_version", ["2.10.0", "2.16.0", "2.15.1+cpu"])
def test_torch_outside_torch_tpu_range(torch_version):
    with_tt = problems(
        {"torch": torch_version, "torch-tpu": "0.2.0", "libtpu": "0.0.52"}, torch_range=">=2.11.0,<=2.15.0"
    )
    one(with_tt, "error", f"torch {torch_version}", "torch-tpu 0.2.0", "torch==2.13.0")
    without = problems({"torch": torch_version})
    one(without, "warning", f"torch {torch_version}", ">=2.11.0,<=2.15.0")
    assert problems({"torch": "2.11.0"}) == [] and problems({"torch": "2.15.0"}) == []


def test_torch_tpu_without_libtpu():
    one(problems({"torch-tpu": "0.2.0"}), "error", "without libtpu", "pip install libtpu")
    one(problems({"libtpu": "0.0.52"}), "info", "libtpu 0.0.52", "hf-tpu[tpu]")


def test_transformers_4_is_an_error_and_other_libraries_warn():
    one(problems({"transformers": "4.57.1"}), "error", "transformers 4.57.1", ">=5.23,<5.26")
    one(problems({"diffusers": "0.30.0"}), "warning", "diffusers 0.30.0")
    one(problems({"transformers": None}), "error", "transformers is not installed")


def test_missing_jax_disables_the_kernels_xla_path():
    one(problems({"jax": None, "jaxlib": None}), "info", "XLA path", "hf-tpu[kernels]")
    one(problems({"jaxlib": None}), "warning", "without jaxlib")


def test_torch_tpu_on_a_host_without_chips_suggests_simulate():
    rt = {"mode": "none", "pci_functions": 0, "pci_vfio": 0}
    found = problems({"torch-tpu": "0.2.0", "libtpu": "0.0.52"}, rt)
    one(found, "info", "no TPU chips", "--simulate", "HF_TPU_SIMULATE=1")
    assert [p.level for p in found] == ["info"]


def test_chip_problems():
    rt = {"mode": "none", "pci_functions": 4, "pci_vfio": 0}
    one(problems(rt=rt), "error", "torch-tpu is not installed", "hf-tpu[tpu]")
    one(problems({"torch-tpu": "0.2.0", "libtpu": "0.0.52"}, rt), "error", "VFIO", "vfio-pci")
    real = {"mode": "real", "pci_functions": 4, "pci_vfio": 4}
    tt = {"torch-tpu": "0.2.0", "libtpu": "0.0.52"}
    assert problems(tt, real) == []
    one(problems(tt, real, {"HF_TPU_SIMULATE": "1"}), "warning", "unset HF_TPU_SIMULATE")
    one(problems(tt, real, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}), "warning", "import torch_tpu")


def test_foreign_settings():
    one(problems({"torch_xla": "2.9.0"}), "warning", "torch_xla 2.9.0", "uninstall")
    one(problems(env={"PJRT_DEVICE": "TPU"}), "info", "PJRT_DEVICE=TPU")


def test_problems_are_sorted_by_severity():
    found = problems({"torch-tpu": "0.2.0", "jax": None, "jaxlib": None, "diffusers": "0.1"})
    levels = [p.level for p in found]
    assert levels == sorted(levels, key=["error", "warning", "info"].index) and len(set(levels)) == 3


# --- the command frame ----------------------------------------------------------------------------------


def test_simulate_flag_is_accepted_before_and_after_the_command():
    assert build_parser(["env"]).parse_args(["env"]).simulate is False
    assert build_parser(["--simulate", "env"]).parse_args(["--simulate", "env"]).simulate is True
    assert build_parser(["env", "--simulate"]).parse_args(["env", "--simulate"]).simulate is True
    args = build_parser(["env"]).parse_args(["--sim-generation", "v5e", "env", "--json"])
    assert (args.sim_generation, args.json) == ("v5e", True)


def test_only_present_commands_are_listed_and_help_imports_no_torch():
    assert "env" in available_commands()
    for name in available_commands():
        assert (REPO / "hf_tpu" / "cli" / f"{name}.py").is_file()
    code = (
        "import sys\nfrom hf_tpu.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'diffusers', 'jax', 'torch_tpu') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HF_TPU_SIMULATE", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert "env" in proc.stdout and "--simulate" in proc.stdout


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "usage: hf-tpu" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_env_shows_torch_tpu_cache_tiers_and_where_they_live(tmp_path):
    env = {"TORCH_TPU_TIER2_COMPILATION_CACHE": "mine", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": str(tmp_path)}
    proc = hf_tpu_cli("env", extra_env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^  tier 2 \(per host\) +/dev/shm/torch_tpu_cache/mine ", proc.stdout, re.MULTILINE)
    assert re.search(rf"^  tier 3 \(persistent\) +{re.escape(str(tmp_path))} ", proc.stdout, re.MULTILINE)
    report = json.loads(hf_tpu_cli("env", "--json").stdout)["torch_tpu_cache"]
    assert report["tier3"]["value"] is None and report["tier3"]["where"].startswith("off")


def test_a_path_as_the_tier2_cache_name_is_a_warning():
    env = {"TORCH_TPU_TIER2_COMPILATION_CACHE": "/data/xla"}
    found = env_cmd.find_problems({"torch": "2.13.0"}, {"mode": "none"}, env)
    (finding,) = [f for f in found if "TIER2" in f.problem]
    assert finding.level == "warning" and "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT=/data/xla" in finding.fix
