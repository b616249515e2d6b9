"""hf_tpu points torch_tpu's compilation cache tiers where torch_tpu's runtime looks for them, and reads its counters.

torch_tpu reads the cache variables in C++ (no Python source names them): the strings are in the glue library built
for the installed torch, ``csrc/common/glue_<torch>/libpywrap_<torch>_common.so``. Tier 2 takes a *name* (a cache in
``/dev/shm/torch_tpu_cache/<name>``), tier 3 a *path*. On this host (no chips) the PCI bus is stood in
(``fake_tpu_host``), so hf_tpu's runtime is "real" as on a TPU VM; torch_tpu's own ``torch.tpu._get_cache_stats()``
answers without a chip.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch_tpu
from _timeouts import SAFETY_TIMEOUT_S

from hf_tpu import _torch_tpu, compile_cache, runtime
from hf_tpu.compile_cache import CompileCache

TIERS = (_torch_tpu.TIER2_ENV, _torch_tpu.TIER3_ENV)


def _glue_library() -> Path:
    version = "_".join(torch.__version__.split("+")[0].split(".")[:3])
    (lib,) = (Path(torch_tpu.__file__).parent / "csrc" / "common" / f"glue_{version}").glob("libpywrap_*_common.so")
    return lib


def test_the_cache_variables_are_read_by_the_runtime():
    data = _glue_library().read_bytes()
    assert (compile_cache.TORCH_TPU_TIER2_ENV, compile_cache.TORCH_TPU_TIER3_ENV) == TIERS
    for name in TIERS:
        assert name.encode() + b"\0" in data, name
    assert b"GetTier2CompilationCachePath" in data and b"GetTier3CacheRootDir" in data and b"GetTier2CacheName" in data
    assert _torch_tpu.TIER2_ROOT.encode() + b"\0" in data  # where a tier-2 name lives
    assert b"Tier-2 compilation cache is disabled for world size 1." in data


@pytest.fixture
def on_a_chip(fake_tpu_host, monkeypatch):
    """hf_tpu's runtime sees one TPU v6e chip; neither cache variable is set (and both are restored afterwards)."""
    for name in TIERS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    fake_tpu_host("0x006f", 1)
    runtime.detect.cache_clear()
    assert runtime.detect().mode == "real"
    yield
    runtime.detect.cache_clear()


def test_cache_dir_sets_tier3_under_it_and_a_tier2_name_before_the_first_compile(on_a_chip, tmp_path):
    assert torch.tpu._get_cache_stats().num_cache_reqs == 0  # torch_tpu has not compiled (nor read them) yet
    cache = CompileCache(tmp_path / "cc")
    assert Path(os.environ[_torch_tpu.TIER3_ENV]) == tmp_path / "cc" / "torch_tpu"
    name = os.environ[_torch_tpu.TIER2_ENV]
    assert name == _torch_tpu.tier2_name(tmp_path / "cc") and "/" not in name and name not in ("disabled", "default")
    assert cache.problems == []
    tiers = _torch_tpu.cache_tiers()
    assert tiers["tier2"]["where"].startswith(f"/dev/shm/torch_tpu_cache/{name} ")
    assert tiers["tier3"]["value"] == str(tmp_path / "cc" / "torch_tpu")
    assert _torch_tpu.tier2_name(tmp_path / "other") != name


def test_import_hf_tpu_with_hf_tpu_compile_cache_sets_them_before_anything_runs(on_a_chip, tmp_path, monkeypatch):
    import importlib

    import hf_tpu

    monkeypatch.delenv("HF_TPU_SIMULATE", raising=False)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cc"))
    importlib.reload(hf_tpu)  # what `import hf_tpu` runs in a new process, before any model reaches the device
    assert Path(os.environ[_torch_tpu.TIER3_ENV]) == tmp_path / "cc" / "torch_tpu"
    assert os.environ[_torch_tpu.TIER2_ENV] == _torch_tpu.tier2_name(tmp_path / "cc")


def test_values_the_user_set_are_kept(on_a_chip, tmp_path, monkeypatch):
    monkeypatch.setenv(_torch_tpu.TIER2_ENV, "disabled")
    monkeypatch.setenv(_torch_tpu.TIER3_ENV, "gs://bucket/xla")
    CompileCache(tmp_path / "cc")
    assert os.environ[_torch_tpu.TIER2_ENV] == "disabled" and os.environ[_torch_tpu.TIER3_ENV] == "gs://bucket/xla"


def test_a_cache_created_after_torch_tpu_compiled_says_it_comes_too_late(on_a_chip, tmp_path, monkeypatch):
    monkeypatch.setattr(_torch_tpu, "cache_stats", lambda: _torch_tpu.CacheStats(requests=3, hits=1))
    with pytest.warns(compile_cache.CompileCacheWarning, match="take effect in the next process only"):
        cache = CompileCache(tmp_path / "cc")
    assert "HF_TPU_COMPILE_CACHE=" in cache.problems[0]


def test_off_a_chip_nothing_is_set(tmp_path, monkeypatch):
    for name in TIERS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    runtime.detect.cache_clear()
    assert runtime.detect().mode == "none"
    CompileCache(tmp_path / "cc")
    assert not any(name in os.environ for name in TIERS)


def test_clear_removes_what_hf_tpu_put_there_and_nothing_else(on_a_chip, tmp_path, monkeypatch):
    monkeypatch.setattr(_torch_tpu, "TIER2_ROOT", str(tmp_path / "shm"))
    cache = CompileCache(tmp_path / "cc")
    ours = [
        Path(os.environ[_torch_tpu.TIER3_ENV]) / "entry.bin",
        tmp_path / "shm" / os.environ[_torch_tpu.TIER2_ENV] / "entry.bin",
        cache.base / "generation-x" / "key.json",
    ]
    theirs = [tmp_path / "shm" / "default" / "entry.bin", tmp_path / "cc" / "notes.txt"]
    for f in ours + theirs:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
    cache.clear()
    assert [f for f in ours if f.exists()] == [] and all(f.exists() for f in theirs)


SIM_STATS = textwrap.dedent(
    """
    import json, torch, hf_tpu.sim
    stats = torch.tpu._get_cache_stats()
    print("SIM-JSON" + json.dumps({n: type(getattr(stats, n)).__name__ for n in dir(stats) if not n.startswith("_")}))
    """
)


def test_the_simulator_answers_get_cache_stats_with_the_wheels_fields():
    wheel = torch.tpu._get_cache_stats()  # resolved through torch_tpu's public-API fallback; needs no chip
    expected = {n: type(getattr(wheel, n)).__name__ for n in dir(wheel) if not n.startswith("_")}
    assert {"num_cache_reqs", "num_cache_hits", "per_entry_stats"} <= set(expected)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_TPU_SIMULATE": "1"}
    env.pop("HF_TPU_EXPECT_TORCH_TPU", None)
    proc = subprocess.run(
        [sys.executable, "-c", SIM_STATS], env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SIM-JSON"))
    assert json.loads(line[len("SIM-JSON") :]) == expected
    stats = _torch_tpu.cache_stats()
    assert (stats.requests, stats.hits) == (wheel.num_cache_reqs, wheel.num_cache_hits)
