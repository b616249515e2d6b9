"""The shipped kernel repository as a Hub kernel: layout, metadata, variant selection, offline get_kernel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu
from hf_tpu.kernels import RAGGED_DOT_REPO, load_local_kernel, tpu_variant_selection

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "hf-tpu-test/ragged-dot-tpu"


def test_repo_has_the_hub_layout_and_valid_metadata():
    from kernels import Metadata

    variant = RAGGED_DOT_REPO / "build" / "torch-tpu"
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert str(metadata.name) == "ragged-dot-tpu" and metadata.version == 1
    from kernels._rust import Backend

    assert metadata.backend.backend_type == Backend.TPU
    assert (variant / metadata.name.python_name / "__init__.py").is_file()
    assert (RAGGED_DOT_REPO / "README.md").is_file()
    # python-depends only takes names kernels knows; jax is not one, so the kernel imports it lazily instead
    assert json.loads((variant / "metadata.json").read_text())["python-depends"] == []


def test_kernels_picks_torch_tpu_only_when_torch_backends_tpu_exists(monkeypatch):
    """kernels 0.17's detection (kernels/backends.py, _backend): the tpu backend iff torch.backends.tpu exists,
    which torch-tpu 0.2.0 does not set (tests/contract/test_kernels.py shows it with the wheel)."""
    from kernels import get_local_kernel

    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    with pytest.raises(FileNotFoundError, match="torch-tpu"):
        get_local_kernel(RAGGED_DOT_REPO)
    monkeypatch.setattr(torch.backends, "tpu", types.ModuleType("torch.backends.tpu"), raising=False)
    module = get_local_kernel(RAGGED_DOT_REPO)  # kernels' own selection, once the attribute is there
    assert callable(module.experts_forward) and callable(module.ragged_dot)


@pytest.fixture
def host_with_chips(monkeypatch):
    """hf_tpu.runtime's answer "this host has TPU chips and torch-tpu" (the only stand-in), kernels integration off."""
    from hf_tpu import runtime

    monkeypatch.setattr(runtime, "is_real", lambda: True)
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    hf_tpu.disable("kernels")
    yield
    hf_tpu.disable("kernels")


def test_enable_on_a_host_with_chips_lets_plain_kernels_find_the_variant_until_disable(host_with_chips):
    from kernels import get_local_kernel

    hf_tpu.enable("kernels")
    placeholder = torch.backends.tpu
    assert [r.target for r in hf_tpu._patch.applied("kernels")] == ["torch.backends.tpu"]
    module = get_local_kernel(RAGGED_DOT_REPO)  # plain kernels, no hf_tpu helper
    assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")
    hf_tpu.enable("kernels")  # idempotent
    assert torch.backends.tpu is placeholder
    hf_tpu.disable("kernels")
    assert not hasattr(torch.backends, "tpu")
    with pytest.raises(FileNotFoundError, match="torch-tpu"):
        get_local_kernel(RAGGED_DOT_REPO)


def test_selfcheck_names_a_wrong_variant(monkeypatch):
    """What hf-tpu selftest reports on a TPU VM where kernels does not pick torch-tpu (runtime finds no chips)."""
    from hf_tpu import runtime
    from hf_tpu.kernels._selftest import check_variant_selection

    monkeypatch.setattr(runtime, "is_real", lambda: False)
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    hf_tpu.disable("kernels")
    with pytest.raises(AssertionError, match=r"^variant: .*did not select the torch-tpu build variant.*'cpu'"):
        check_variant_selection()
    monkeypatch.setattr(runtime, "is_real", lambda: True)
    assert check_variant_selection() == "torch-tpu"
    assert not hasattr(torch.backends, "tpu")


def test_enable_without_chips_leaves_kernels_detection_alone(host_with_chips, monkeypatch):
    from hf_tpu import runtime

    monkeypatch.setattr(runtime, "is_real", lambda: False)
    with hf_tpu.enabled("kernels"):
        assert not hasattr(torch.backends, "tpu")
        assert hf_tpu._patch.applied("kernels") == []


def test_enable_keeps_an_existing_torch_backends_tpu(host_with_chips, monkeypatch):
    """A torch.backends.tpu set by someone else (the simulator, a later torch-tpu) is left alone, also by disable."""
    existing = types.ModuleType("torch.backends.tpu")
    monkeypatch.setattr(torch.backends, "tpu", existing, raising=False)
    with hf_tpu.enabled("kernels"):
        assert torch.backends.tpu is existing
    assert torch.backends.tpu is existing


def test_hf_tpu_loader_selects_the_variant_and_leaves_torch_as_it_was(monkeypatch):
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    module = load_local_kernel(RAGGED_DOT_REPO)
    assert not hasattr(torch.backends, "tpu")
    assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")
    with tpu_variant_selection():
        assert hasattr(torch.backends, "tpu")
    assert not hasattr(torch.backends, "tpu")
    with pytest.raises(FileNotFoundError, match="no build/ folder"):
        load_local_kernel(RAGGED_DOT_REPO / "build")


def _fake_hub_cache(root, repo_id: str, version: int) -> None:
    """A Hugging Face Hub cache entry for a kernel repo: refs/v<N> -> commit, snapshots/<commit>/ the files."""
    from huggingface_hub.file_download import repo_folder_name

    storage = root / repo_folder_name(repo_id=repo_id, repo_type="kernel")
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / f"v{version}").write_text(COMMIT)
    (storage / "refs" / "main").write_text(COMMIT)
    snapshot = storage / "snapshots" / COMMIT
    shutil.copytree(RAGGED_DOT_REPO, snapshot, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


@pytest.mark.parametrize("backend", ["real", "simulated"])
def test_get_kernel_offline_from_the_local_hub_cache(tmp_path, monkeypatch, backend):
    import huggingface_hub.constants
    import kernels.resolver
    from kernels import get_kernel

    _fake_hub_cache(tmp_path, REPO_ID, version=1)
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    if backend == "real":  # the seed's plain get_kernel on a TPU VM, with hf_tpu.enable() (runtime: chips found)
        from hf_tpu import runtime

        monkeypatch.setattr(runtime, "is_real", lambda: True)
        with hf_tpu.enabled("kernels"):
            module = get_kernel(REPO_ID, version=1, trust_remote_code=[REPO_ID])
        assert not hasattr(torch.backends, "tpu")
    else:
        with tpu_variant_selection():
            module = get_kernel(REPO_ID, version=1, trust_remote_code=[REPO_ID])
    assert module.__file__.startswith(str(tmp_path / "kernels--hf-tpu-test--ragged-dot-tpu" / "snapshots" / COMMIT))
    with pytest.raises(ValueError, match="Version 2 not found"), tpu_variant_selection():
        get_kernel(REPO_ID, version=2, trust_remote_code=True)
    # the same build loaded from two places registers its op once and shares it
    shipped = load_local_kernel(RAGGED_DOT_REPO)
    assert module.OP_NAMESPACE == shipped.OP_NAMESPACE
    assert module.ragged_dot_op is shipped.ragged_dot_op


def test_kernel_is_standalone_and_loads_without_importing_jax():
    """The Hub kernel must not need hf_tpu, and loading it must not import jax (only running it does)."""
    code = (
        "import sys, types, torch, kernels\n"
        "torch.backends.tpu = types.ModuleType('torch.backends.tpu')  # docs/kernels.md's line without hf_tpu\n"
        f"m = kernels.get_local_kernel(__import__('pathlib').Path({str(RAGGED_DOT_REPO)!r}))\n"
        "assert callable(m.experts_forward)\n"
        "bad = [n for n in ('hf_tpu', 'jax') if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=SAFETY_TIMEOUT_S,
        cwd=RAGGED_DOT_REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
