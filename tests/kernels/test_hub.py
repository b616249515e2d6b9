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


def test_kernels_picks_torch_tpu_only_on_a_tpu_backend(monkeypatch):
    from kernels import get_local_kernel

    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    with pytest.raises(FileNotFoundError, match="torch-tpu"):
        get_local_kernel(RAGGED_DOT_REPO)
    monkeypatch.setattr(torch.backends, "tpu", types.ModuleType("torch.backends.tpu"), raising=False)
    module = get_local_kernel(RAGGED_DOT_REPO)  # kernels' own selection, as under TorchTPU
    assert callable(module.experts_forward) and callable(module.ragged_dot)


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
    if backend == "real":  # what importing torch_tpu does
        monkeypatch.setattr(torch.backends, "tpu", types.ModuleType("torch.backends.tpu"), raising=False)
        module = get_kernel(REPO_ID, version=1, trust_remote_code=[REPO_ID])
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
        "torch.backends.tpu = types.ModuleType('torch.backends.tpu')\n"
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
