"""The simulator's native core (hf_tpu/sim/_native.cpp): built where a compiler is, and it changes nothing but speed."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu.sim
from hf_tpu.sim import _native
from hf_tpu.sim._counters import STATE

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_native_worker.py")


def _env(native: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["HF_TPU_SIM_NATIVE"] = native
    env.pop("HF_TPU_SIMULATE", None)
    return env


def _compiler_present() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


def test_native_core_is_on_where_a_compiler_is():
    if os.environ.get("HF_TPU_SIM_NATIVE", "") == "0":
        assert _native.status().startswith("off") and STATE.native is None
        return
    if not _compiler_present() and os.environ.get("CI", "").lower() != "true":
        pytest.skip("no C++ compiler or ninja here: the simulator runs its ops in Python")
    assert _native.status() == "on", _native.status()
    assert STATE.native is not None
    # a device tensor's storage is the native core's, over CPU memory that it keeps alive
    t = torch.arange(6.0, device="tpu")
    buf = STATE.native.host_storage(t.untyped_storage())
    assert buf is not None and buf.device.type == "cpu" and buf.data_ptr() == t.untyped_storage().data_ptr()
    assert STATE.native.host_storage(torch.arange(3.0).untyped_storage()) is None


def test_python_and_native_paths_agree():
    """The same workload with the native core off and on: equal results, counters and error messages."""
    if not _compiler_present() and os.environ.get("CI", "").lower() != "true":
        pytest.skip("no C++ compiler or ninja here: only the Python path exists")
    lines = {}
    for native in ("0", "1"):
        proc = subprocess.run(
            [sys.executable, str(WORKER)],
            capture_output=True,
            text=True,
            env=_env(native),
            timeout=SAFETY_TIMEOUT_S,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines[native] = json.loads(proc.stdout.strip().splitlines()[-1])
    python, native = lines["0"], lines["1"]
    assert python.pop("native").startswith("off") and native.pop("native") == "on"
    assert python == native
    for name, block in native.items():
        if isinstance(block, dict) and "ok" in block:
            assert block["ok"], name
    assert native["llama_training_step"] is True
    assert native["llama_forward"]["ops"] > 100 and native["llama_forward"]["shape_signatures"] > 0
    assert "Expected all tensors to be on the same device" in native["errors"]["cpu_operand"]
    assert native["errors"]["oom_op_result"].startswith("OutOfMemoryError: TPU out of memory (simulated): aten.cat")


def test_python_path_passes_the_device_tests():
    """With HF_TPU_SIM_NATIVE=0 (no compiler on a laptop), the device, counter, model, pinned-memory and torch_tpu
    surface tests pass as they do here (those that differ check the Python path's own behaviour)."""
    files = ["tests/sim/test_device.py", "tests/sim/test_counters.py", "tests/sim/test_models.py",
             "tests/sim/test_pinned.py", "tests/sim/test_torch_tpu_surface.py"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *files],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env("0"),
        timeout=SAFETY_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_native_declines_to_python_for_what_it_does_not_cover():
    """A CPU operand, emulated precision and a foreign device reach the Python kernel, which raises or handles them."""
    x = torch.randn(3, 4, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="device tpu:1 does not exist"):
        torch.zeros(2, device="tpu:1")
    a = torch.randn(64, 64)
    b = torch.randn(64, 64)
    with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
        exact = (a.to("tpu") @ b.to("tpu")).cpu()
    with torch.tpu.precision(torch.tpu.Precision.DEFAULT):  # torch_tpu's default precision, 'medium': one bf16 pass
        reduced = (a.to("tpu") @ b.to("tpu")).cpu()
    assert torch.equal(exact, a @ b)
    bf16 = a.bfloat16().float() @ b.bfloat16().float()
    torch.testing.assert_close(reduced, bf16)  # the Python kernel ran the contraction at the emulated precision
    assert not torch.equal(reduced, exact)


@pytest.mark.tpu_precision("medium")
def test_the_native_core_runs_contractions_at_medium_and_highest_itself(monkeypatch):
    """Emulation is on by default and costs little: the native core rounds a float32 contraction's operands to
    bfloat16 itself at 'medium' (the same bits as the Python kernel's pass) and runs it unchanged at 'highest' and
    for bfloat16 operands; only 'high' (three passes) runs the Python kernel."""
    if STATE.native is None:
        pytest.skip("native core off: every op runs its Python kernel")
    from hf_tpu.sim import _precision

    calls = []
    passes = _precision._passes
    monkeypatch.setattr(_precision, "_passes", lambda a, b: calls.append(a.dtype) or passes(a, b))
    g = torch.Generator().manual_seed(0)
    m, v, c = torch.randn(8, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, 8, generator=g)
    r = lambda t: t.bfloat16().float()  # noqa: E731
    cases = [
        (torch.mm, (m, m.T), (0, 1)), (torch.bmm, (m[None], m.T[None]), (0, 1)), (torch.mv, (m, v), (0, 1)),
        (torch.dot, (v, v * 3), (0, 1)), (torch.addmm, (c, m, m.T), (1, 2)), (torch.addmv, (v, m, v), (1, 2)),
        (torch.baddbmm, (c[None], m[None], m.T[None]), (1, 2)),
    ]  # fmt: skip
    for fn, args, operands in cases:
        rounded = [r(a) if i in operands else a for i, a in enumerate(args)]
        assert torch.equal(fn(*(a.to("tpu") for a in args)).cpu(), fn(*rounded)), fn
        assert torch.equal(fn(*(a.bfloat16().to("tpu") for a in args)).cpu(), fn(*(a.bfloat16() for a in args)))
        with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
            assert torch.equal(fn(*(a.to("tpu") for a in args)).cpu(), fn(*args)), fn
    assert calls == []
    torch.set_float32_matmul_precision("high")
    m.to("tpu") @ m.to("tpu")
    assert calls == [torch.float32]


def test_native_counts_memory_and_frees_it():
    if STATE.native is None:
        pytest.skip("native core off: test_counters covers the Python path's accounting")
    base = hf_tpu.sim.memory_allocated()
    t = torch.empty(1024, 1024, device="tpu")  # 4 MiB, made by the native core
    u = t * 2
    assert hf_tpu.sim.memory_allocated() == base + 2 * 4 * 1024**2
    v = u[:10]  # a view: no new memory
    assert hf_tpu.sim.memory_allocated() == base + 2 * 4 * 1024**2
    del t, u
    assert hf_tpu.sim.memory_allocated() == base + 4 * 1024**2  # v keeps u's storage alive
    del v
    assert hf_tpu.sim.memory_allocated() == base
    assert hf_tpu.sim.max_memory_allocated() >= base + 8 * 1024**2


def test_a_killed_build_does_not_block_the_next_and_a_built_core_is_reused(tmp_path, monkeypatch, caplog):
    if STATE.native is None:
        pytest.skip("native core off here")
    from torch.utils import cpp_extension

    monkeypatch.setenv("HF_TPU_CACHE", str(tmp_path))
    build = _native._cache_dir(_native._key())
    build.mkdir(parents=True)
    (build / "lock").write_text("")  # torch's lock file, left by a build that was killed
    calls = []

    def fake_load(name, sources, build_directory, **kwargs):  # the real build takes ~40 s: reuse this process's
        assert not (Path(build_directory) / "lock").exists()
        shutil.copy(STATE.native.__file__, Path(build_directory) / f"{name}.so")
        calls.append(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level("WARNING", logger="hf_tpu.sim"):
        assert _native._build() is STATE.native and len(calls) == 1 and (build / "built").is_file()
    # issue 36: the build said when it started and never that it ended
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "building the simulator's native core" in said[0], said
    assert re.fullmatch(r"hf_tpu.sim: built the simulator's native core in \d+ s", said[1]), said
    caplog.clear()
    assert _native._build() is STATE.native and len(calls) == 1  # built: loaded, not compiled again
    assert not caplog.records  # nothing built, nothing said


def test_a_failed_build_falls_back_to_python_with_a_warning_or_raises_when_required(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Error building extension 'hf_tpu_sim_native': c++: not found")

    monkeypatch.setattr(_native, "_build", broken)
    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.delenv("HF_TPU_SIM_NATIVE", raising=False)
    with caplog.at_level("WARNING", logger="hf_tpu.sim"):
        assert _native.load() is None
    assert _native.status().startswith("unavailable (Error building extension") and "native core" in caplog.text
    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.setenv("HF_TPU_SIM_NATIVE", "1")
    with pytest.raises(RuntimeError, match="HF_TPU_SIM_NATIVE=1 but the simulator's native core could not be built"):
        _native.load()
    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.setenv("HF_TPU_SIM_NATIVE", "0")
    assert _native.load() is None and _native.status() == "off (HF_TPU_SIM_NATIVE=0)"
