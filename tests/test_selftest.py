"""hf_tpu.selftest (the check registry and runner) and ``hf-tpu selftest`` on the simulated device."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _timeouts import SAFETY_TIMEOUT_S

from docs import pages
from hf_tpu import runtime, selftest
from hf_tpu.cli.main import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def registry(monkeypatch):
    """An empty registry, and discover() that finds nothing, for the duration of a test."""
    monkeypatch.setattr(selftest, "_REGISTRY", {})
    monkeypatch.setattr(selftest, "discover", list)
    return selftest._REGISTRY


def test_register_twice_under_one_name_is_an_error(registry):
    @selftest.register_check("dup")
    def first(ctx):
        return {}

    selftest.register_check("dup")(first)  # the same function again (a module re-import) is fine
    with pytest.raises(ValueError, match="registered twice"):

        @selftest.register_check("dup")
        def second(ctx):
            return {}


def test_statuses_figures_and_order(registry):
    @selftest.register_check("runtime", order=0)
    def _rt(ctx):
        return {"mode": "fake"}

    @selftest.register_check("zz_skip", order=5)
    def _skip(ctx):
        raise selftest.SkipCheck("needs 2 chips, found 1")

    @selftest.register_check("aa_fail", order=5, quick=False)
    def _fail(ctx):
        raise AssertionError("tpu says 5, cpu says 4")

    results = selftest.run_checks()
    assert [r.name for r in results] == ["runtime", "aa_fail", "zz_skip"]
    by_name = {r.name: r for r in results}
    assert by_name["runtime"].status == "passed" and by_name["runtime"].figures == {"mode": "fake"}
    assert by_name["zz_skip"].status == "skipped" and by_name["zz_skip"].reason == "needs 2 chips, found 1"
    failed = by_name["aa_fail"]
    assert failed.status == "failed" and "AssertionError: tpu says 5, cpu says 4" in failed.error
    assert "test_selftest.py" in failed.error  # says where

    assert [r.name for r in selftest.run_checks(quick=True)] == ["runtime", "zz_skip"]
    assert [r.name for r in selftest.run_checks(only=["aa_fail"])] == ["aa_fail"]
    with pytest.raises(KeyError, match="unknown self-test check"):
        selftest.run_checks(only=["nope"])


def test_exclusive_checks_run_before_any_check_uses_the_device(registry):
    """On a TPU VM the first device operation claims the chips for this process; a check that launches one rank
    per chip must run before that."""
    ran: list[str] = []

    @selftest.register_check("runtime", order=0)
    def _rt(ctx):
        ran.append("runtime")

    @selftest.register_check("device", order=1)
    def _dev(ctx):
        ran.append("device")

    @selftest.register_check("tensor_parallel", order=90, exclusive=True, quick=False)
    def _tp(ctx):
        assert ran == [], f"the exclusive check ran after {ran}"
        ran.append("tensor_parallel")

    results = selftest.run_checks()
    assert [(r.name, r.status) for r in results] == [
        ("tensor_parallel", "passed"),
        ("runtime", "passed"),
        ("device", "passed"),
    ]
    assert ran == ["tensor_parallel", "runtime", "device"]


def test_the_real_tensor_parallel_check_is_exclusive():
    selftest.discover()
    registered = selftest.checks()
    assert registered["tensor_parallel"].exclusive
    assert next(iter(registered)) == "tensor_parallel"


def test_torch_tpu_api_check_names_what_the_installed_wheel_lacks(monkeypatch):
    """On a real TPU the check fails naming each missing name (hf_tpu._torch_tpu.missing_names reads them)."""
    import torch

    from hf_tpu import _torch_tpu

    selftest.discover()
    check = selftest.checks()["torch_tpu_api"]
    ctx = selftest.CheckContext()
    ctx.info = runtime.RuntimeInfo("real", 1, 4, 16 * 1024**3, "v5e", "0.2.0", None, "test")
    names = dict(_torch_tpu.EXPECTED_NAMES)
    names["torch.accelerator"] = (*names["torch.accelerator"], "no_such_entry_point")
    monkeypatch.setattr(_torch_tpu, "EXPECTED_NAMES", names)
    assert hasattr(torch.accelerator, "get_memory_info")
    with pytest.raises(RuntimeError, match=r"lacks .*torch\.accelerator\.no_such_entry_point"):
        check.fn(ctx)
    ctx.info = runtime.RuntimeInfo("simulated", 1, 0, 16 * 1024**3, "v5e", None, None, "test")
    with pytest.raises(selftest.SkipCheck, match="simulated device does not use torch_tpu"):
        check.fn(ctx)


def test_a_failed_runtime_check_skips_the_rest(registry):
    @selftest.register_check("runtime", order=0)
    def _rt(ctx):
        raise runtime.TPUNotAvailableError("no TPU here")

    @selftest.register_check("device", order=1)
    def _dev(ctx):  # pragma: no cover - must not run
        raise AssertionError("ran without a device")

    results = selftest.run_checks()
    assert [(r.name, r.status) for r in results] == [("runtime", "failed"), ("device", "skipped")]
    assert "no tpu device" in results[1].reason


def test_discover_finds_the_runtime_and_device_checks():
    names = selftest.discover()
    assert "hf_tpu._selftest" in names
    assert {"runtime", "device", "compile"} <= set(selftest.checks())


def test_cli_exit_status_and_table(registry, capsys, tmp_path):
    @selftest.register_check("ok")
    def _ok(ctx):
        return {"answer": 42}

    assert main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "passed" in out and "answer=42" in out and "1 passed, 0 failed, 0 skipped" in out

    @selftest.register_check("bad")
    def _bad(ctx):
        raise RuntimeError("broken on purpose")

    report = tmp_path / "r.json"
    assert main(["selftest", "--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "bad failed: RuntimeError: broken on purpose" in out
    data = json.loads(report.read_text())
    assert data["summary"] == {"passed": 1, "failed": 1, "skipped": 0}
    assert data["command"] == ["hf-tpu", "selftest", "--report", str(report)]
    checks = {c["name"]: c for c in data["checks"]}
    assert {name: c["status"] for name, c in checks.items()} == {"ok": "passed", "bad": "failed"}
    assert "broken on purpose" in checks["bad"]["error"] and checks["ok"]["figures"] == {"answer": 42}
    assert main(["selftest", "--only", "missing"]) == 2


def test_what_checks_print_goes_to_the_report_not_above_the_table(registry, capsys, tmp_path):
    @selftest.register_check("noisy")
    def _noisy(ctx):
        import warnings

        print({"loss": 1.25})  # what a Trainer prints
        print("a library warning", file=sys.stderr)
        warnings.warn("a python warning", UserWarning, stacklevel=1)
        os.write(1, b"written to fd 1\n")
        os.write(2, b"written to fd 2\n")
        return {"answer": 42}

    report = tmp_path / "r.json"
    assert main(["selftest", "--report", str(report)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("check") and "answer=42" in out
    for noise in ("'loss': 1.25", "a library warning", "a python warning", "written to fd"):
        assert noise not in out + err
    output = json.loads(report.read_text())["output"]
    for noise in ("'loss': 1.25", "a library warning", "a python warning", "written to fd 1", "written to fd 2"):
        assert noise in output
    assert main(["selftest", "--debug"]) == 0  # --debug: shown after the table, on stderr
    out, err = capsys.readouterr()
    assert "'loss': 1.25" not in out and "'loss': 1.25" in err and "written to fd 2" in err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HF_TPU_SIMULATE"}
    env.update(PYTHONPATH=str(REPO), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    return subprocess.run(
        [sys.executable, "-m", "hf_tpu.cli", *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=SAFETY_TIMEOUT_S,
    )


@pytest.mark.skipif(runtime.scan_pci().vfio > 0, reason="this host has TPU chips: the simulator refuses to run")
def test_selftest_passes_on_the_simulated_device(tmp_path):
    """The full self-test, once (the slowest command of this file): every check passes; the figures of the
    runtime, device, compile, generation, diffusers, serving and training checks are what they must be."""
    report_path = tmp_path / "selftest.json"
    proc = run_cli("--simulate", "selftest", "--report", str(report_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith("check"), proc.stdout[:2000]  # the table first, nothing above it
    # docs/first_hour.md shows this command's table (its block is not run again by tests/docs: this test runs it)
    shown = pages.shown_output("docs/first_hour.md", "hf-tpu --simulate selftest --report selftest.json")
    printed = proc.stdout.replace(str(report_path), "selftest.json")
    assert pages.match_output(shown, printed) is None, pages.match_output(shown, printed)
    report = json.loads(report_path.read_text())
    assert report["versions"]["torch"] == importlib.metadata.version("torch")
    assert report["versions"]["transformers"] == importlib.metadata.version("transformers")
    assert report["runtime"]["mode"] == "simulated" and report["runtime"]["generation"] == "v6e"
    checks = {c["name"]: c for c in report["checks"]}
    assert {"runtime", "device", "compile"} <= set(checks)
    # The torch_tpu names are checked on a real TPU (tests/contract checks them against the wheel).
    assert checks.pop("torch_tpu_api")["status"] == "skipped"
    assert all(c["status"] == "passed" for c in checks.values()), checks
    assert report["summary"]["failed"] == 0
    assert report["checks"][0]["name"] == "tensor_parallel"  # exclusive: before this process uses the device
    assert checks["runtime"]["figures"]["hbm_gib"] == 32.0
    assert checks["compile"]["figures"]["cold_compiles"] >= 1 and checks["compile"]["figures"]["warm_compiles"] == 0
    assert checks["device"]["figures"]["roundtrip_h2d_copies"] == 1
    # torch_tpu's own cache counters (the simulator mirrors torch.tpu._get_cache_stats()): warm-up compiled, the
    # generate after it missed nothing, i.e. recompiled nothing, eager ops included.
    gen = checks["generation"]["figures"]
    assert gen["warmup_tpu_cache_misses"] >= gen["warmup_compiles"] >= 1
    assert gen["generate_tpu_cache_requests"] > 0 and gen["generate_tpu_cache_misses"] == 0
    _diffusers_check_reports_images_and_compiles(checks["diffusers"])
    # The serving and training checks' figures (their tests ran each check once more, in-process; this run is enough).
    serving = checks["serving"]["figures"]
    assert serving["second_compiles"] == 0 and serving["warmup_and_first_compiles"] > 0
    assert 0 < serving["step_shapes"] <= 3
    training = checks["training"]["figures"]  # losses equal the CPU's, no compile after the first step
    assert training["max_loss_diff"] < 1e-4 and training["trainer_device"] == "tpu:0"
    assert training["warm_compiles_per_step"] == 0 and training["warm_shape_signatures_per_step"] == 0


@pytest.mark.skipif(runtime.scan_pci().functions > 0, reason="this host has TPU chips")
def test_selftest_without_a_tpu_fails_with_the_fix(tmp_path):
    proc = run_cli("selftest", "--only", "runtime,device")
    assert proc.returncode == 1
    assert "runtime failed: TPUNotAvailableError" in proc.stdout and "--simulate" in proc.stdout
    assert "0 passed, 1 failed, 1 skipped" in proc.stdout


def _diffusers_check_reports_images_and_compiles(check: dict) -> None:
    assert check["status"] == "passed", check
    f = check["figures"]
    assert f["compiled"] == "unet"
    assert f["cold_compiles"] >= 1 and f["cold_graphs"] >= 1  # a fresh process: the first compiled call compiles
    assert f["warm_compiles"] == 0 and f["warm_graphs"] == 0 and f["warm_shape_signatures"] == 0
    assert f["cold_s"] > 0 and f["warm_s"] > 0 and f["eager_s"] > 0
    assert all(f[f"{k}_max_abs_diff"] <= 1e-3 for k in ("eager", "cold", "warm"))


def test_diffusers_check_is_skipped_without_diffusers(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else find_spec(name, *a)
    )
    (result,) = selftest.run_checks(only=["diffusers"])
    assert result.status == "skipped" and "diffusers is not installed" in result.reason


def test_tensor_parallel_check_waits_for_the_launch_without_a_fixed_timeout(monkeypatch):
    from hf_tpu.distributed import _selftest as tp_check

    monkeypatch.delenv(tp_check.TIMEOUT_ENV, raising=False)
    assert tp_check._timeout() is None  # no limit: a busy host must not fail the check
    monkeypatch.setenv(tp_check.TIMEOUT_ENV, "90")
    assert tp_check._timeout() == 90.0
    monkeypatch.setenv(tp_check.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="HF_TPU_SELFTEST_TIMEOUT_S='soon': give a positive number of seconds"):
        tp_check._timeout()


def test_piped_progress_is_a_line_per_check_on_stderr_and_figures_are_never_cut(registry, capfd):
    """issue 36: `hf-tpu selftest --simulate | cat` was silent until the end, and the table cut figures with an
    ellipsis; now a piped stderr gets a line per check and the table shows whole figures, then "+N more"."""
    long_figures = {f"figure_{i}": 1234567.125 + i for i in range(8)}

    @selftest.register_check("many")
    def _many(ctx):
        return long_figures

    @selftest.register_check("few")
    def _few(ctx):
        return {"answer": 42}

    assert main(["selftest"]) == 0
    out, err = capfd.readouterr()
    assert "hf-tpu selftest: check 1/2: few" in err and "hf-tpu selftest: check 2/2: many" in err
    assert "check 1/2" not in out  # progress never mixes with the table
    row = next(line for line in out.splitlines() if line.startswith("many"))
    shown = row.split("s  ", 1)[1]
    figures, more = shown.rsplit(", +", 1)
    for item in figures.split(", "):  # each figure whole, exactly as the report has it
        name, value = item.split("=")
        assert float(value) == long_figures[name]
    assert more == f"{len(long_figures) - len(figures.split(', '))} more"
    assert "..." not in out and "…" not in out
