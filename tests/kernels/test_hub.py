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
from hf_tpu.kernels import DECODE_ATTENTION_REPO, RAGGED_DOT_REPO, load_local_kernel, tpu_variant_selection

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "hf-tpu-test/ragged-dot-tpu"


REPOS = [RAGGED_DOT_REPO, DECODE_ATTENTION_REPO]


@pytest.mark.parametrize("repo", REPOS, ids=lambda r: r.name)
def test_repo_has_the_hub_layout_and_valid_metadata(repo):
    from kernels import Metadata

    variant = repo / "build" / "torch-tpu"
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert str(metadata.name) == repo.name and metadata.version == 1
    from kernels._rust import Backend

    assert metadata.backend.backend_type == Backend.TPU
    assert (variant / metadata.name.python_name / "__init__.py").is_file()
    assert (repo / "README.md").is_file()
    # python-depends only takes names kernels knows; jax is not one, so the kernel imports it lazily instead
    assert json.loads((variant / "metadata.json").read_text())["python-depends"] == []


@pytest.mark.parametrize("repo", REPOS, ids=lambda r: r.name)
def test_metadata_records_the_digest_of_the_variants_files(repo):
    """metadata.json's digest (what kernels 0.19 checks on every load, and warns about when it is missing: hf-tpu serve
    printed that warning above its first line) is the sha256 of each file of the variant, base64; an edited kernel
    file without a new digest fails here (python scripts/hub_kernel_digest.py writes it), and kernels' own check
    agrees where it has one."""
    import base64
    import hashlib

    variant = repo / "build" / "torch-tpu"
    digest = json.loads((variant / "metadata.json").read_text())["digest"]
    files = {f.relative_to(variant).as_posix(): base64.b64encode(hashlib.sha256(f.read_bytes()).digest()).decode()
             for f in sorted(variant.rglob("*"))
             if f.is_file() and f.name != "metadata.json" and "__pycache__" not in f.parts}  # fmt: skip
    assert digest == {"algorithm": "sha256", "files": files}, (
        "metadata.json's digest is stale: python scripts/hub_kernel_digest.py rewrites it"
    )
    try:
        from kernels._internals.digest import DigestVerificationResult, verify_digest
    except ImportError:  # kernels 0.17 and 0.18 check no digest
        return
    from kernels import Metadata

    metadata = Metadata.read_from_file(variant / "metadata.json")
    result = verify_digest(variant, metadata=metadata, location=None, cache=False)
    assert isinstance(result, DigestVerificationResult.Success), str(result)


def _kernels_reads_torch_backends_tpu() -> bool:
    """Which signal the installed kernels reads, as the release notes of hf_tpu's stand-ins say (a test's oracle, not
    hf_tpu's: hf_tpu asks kernels): 0.17 reads torch.backends.tpu, 0.18 and later torch.accelerator."""
    from packaging.version import Version

    from kernels import __version__

    return Version(Version(__version__).base_version) < Version("0.18")


@pytest.fixture
def cpu_host(monkeypatch):
    """What kernels reads on a CPU host without torch-tpu or the simulator: no torch.backends.tpu, no accelerator
    (the simulator, when an earlier test registered it, answers both otherwise)."""
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    return torch.accelerator.current_accelerator


@pytest.fixture
def tpu_vm(monkeypatch):
    """What a TPU VM with torch-tpu 0.2.0 shows (the stand-ins): hf_tpu.runtime finds chips, torch-tpu's device is the
    current accelerator (its autoload renamed PrivateUse1 'tpu'), torch.backends.tpu does not exist; the kernels
    integration off."""
    from hf_tpu import runtime

    monkeypatch.setattr(runtime, "is_real", lambda: True)
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    tpu = types.SimpleNamespace(type="tpu", index=0)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: tpu)
    hf_tpu.disable("kernels")
    yield
    hf_tpu.disable("kernels")


def test_kernels_detects_tpu_from_the_signal_hf_tpu_stands_in_for(cpu_host, monkeypatch):
    """kernels' own detection (kernels_backend: its _backend()): on a CPU host 'cpu', and plain get_local_kernel
    rejects torch-tpu; 'tpu' under exactly one of hf_tpu's stand-ins, the one this release reads (kernels 0.17:
    torch.backends.tpu, which torch-tpu 0.2.0 does not set (tests/contract/test_kernels.py shows it with the wheel);
    0.18+: torch.accelerator.current_accelerator().type)."""
    from kernels import get_local_kernel

    from hf_tpu.kernels import kernels_backend

    assert kernels_backend() == "cpu"
    with pytest.raises(FileNotFoundError, match="torch-tpu"):
        get_local_kernel(RAGGED_DOT_REPO)
    answers, modules = {}, []
    for signal, owner, name, value in (
        ("torch.backends.tpu", torch.backends, "tpu", types.ModuleType("torch.backends.tpu")),
        ("accelerator", torch.accelerator, "current_accelerator",
         lambda check_available=False: types.SimpleNamespace(type="tpu")),
    ):  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(owner, name, value, raising=False)
            answers[signal] = kernels_backend()
            if answers[signal] == "tpu":
                modules.append(get_local_kernel(RAGGED_DOT_REPO))  # kernels' own selection, once it answers tpu
    old = _kernels_reads_torch_backends_tpu()
    assert answers == {"torch.backends.tpu": "tpu" if old else "cpu", "accelerator": "cpu" if old else "tpu"}
    assert len(modules) == 1 and callable(modules[0].experts_forward) and callable(modules[0].ragged_dot)


def test_enable_on_a_tpu_vm_lets_plain_kernels_find_the_variant_until_disable(tpu_vm):
    """Where kernels does not detect tpu by itself (0.17) hf_tpu sets the placeholder until disable(); where it does
    (0.18+: torch-tpu's device is the accelerator) hf_tpu sets nothing. Either way plain kernels finds torch-tpu."""
    from kernels import get_local_kernel

    from hf_tpu.kernels import kernels_backend

    before = kernels_backend()
    assert before == ("cpu" if _kernels_reads_torch_backends_tpu() else "tpu")
    hf_tpu.enable("kernels")
    placeholder = getattr(torch.backends, "tpu", None)
    targets = [r.target for r in hf_tpu._patch.applied("kernels")]
    assert targets == (["torch.backends.tpu"] if before != "tpu" else [])
    module = get_local_kernel(RAGGED_DOT_REPO)  # plain kernels, no hf_tpu helper
    assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")
    hf_tpu.enable("kernels")  # idempotent
    assert getattr(torch.backends, "tpu", None) is placeholder
    hf_tpu.disable("kernels")
    assert not hasattr(torch.backends, "tpu")
    assert kernels_backend() == before
    if before != "tpu":
        with pytest.raises(FileNotFoundError, match="torch-tpu"):
            get_local_kernel(RAGGED_DOT_REPO)


def test_a_tpu_vm_where_kernels_still_sees_cpu_is_warned_about_and_nothing_is_set(tpu_vm, monkeypatch):
    """A TPU VM where kernels answers 'cpu' even with the placeholder (kernels 0.18+ where torch-tpu's device is not
    the accelerator; kernels' detection stood in by one that reads the accelerator only, on any release): one warning
    naming kernels' answer, and nothing set."""
    from hf_tpu.kernels import kernels_backend, loader

    def reads_the_accelerator_only():
        device = torch.accelerator.current_accelerator()
        return types.SimpleNamespace(name="tpu" if getattr(device, "type", None) == "tpu" else "cpu")

    monkeypatch.setattr(loader, "_detection", lambda: ("kernels._backend (stood in)", reads_the_accelerator_only))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert kernels_backend() == "cpu"
    with pytest.warns(UserWarning, match=r"detects the backend 'cpu' on this TPU VM .*also with a placeholder"):
        assert loader.expose_tpu_backend("kernels") is False
    assert hf_tpu._patch.applied("kernels") == [] and not hasattr(torch.backends, "tpu")


def test_selfcheck_names_a_wrong_variant(cpu_host, monkeypatch):
    """What hf-tpu selftest reports on a TPU VM where kernels does not pick torch-tpu (runtime finds no chips)."""
    from hf_tpu import runtime
    from hf_tpu.kernels._selftest import check_variant_selection

    monkeypatch.setattr(runtime, "is_real", lambda: False)
    hf_tpu.disable("kernels")
    with pytest.raises(AssertionError, match=r"^variant: .*did not select the torch-tpu build variant.*'cpu'"):
        check_variant_selection()
    monkeypatch.setattr(runtime, "is_real", lambda: True)  # a TPU VM: torch-tpu's device is the accelerator
    tpu = types.SimpleNamespace(type="tpu", index=0)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: tpu)
    assert check_variant_selection() == "torch-tpu"
    assert not hasattr(torch.backends, "tpu")


def test_enable_without_chips_leaves_kernels_detection_alone(cpu_host, monkeypatch):
    from hf_tpu import runtime
    from hf_tpu.kernels import kernels_backend

    monkeypatch.setattr(runtime, "is_real", lambda: False)
    hf_tpu.disable("kernels")
    with hf_tpu.enabled("kernels"):  # (its experts registration loads the shipped kernel: stand-ins for one load)
        assert not hasattr(torch.backends, "tpu")
        assert torch.accelerator.current_accelerator is cpu_host
        assert hf_tpu._patch.applied("kernels") == []
        assert kernels_backend() == "cpu"


def test_enable_keeps_an_existing_torch_backends_tpu(tpu_vm, monkeypatch):
    """A torch.backends.tpu set by someone else (the simulator, a later torch-tpu) is left alone, also by disable."""
    existing = types.ModuleType("torch.backends.tpu")
    monkeypatch.setattr(torch.backends, "tpu", existing, raising=False)
    with hf_tpu.enabled("kernels"):
        assert torch.backends.tpu is existing
    assert torch.backends.tpu is existing


def test_hf_tpu_loader_selects_the_variant_and_leaves_torch_as_it_was(cpu_host):
    from hf_tpu.kernels import kernels_backend

    module = load_local_kernel(RAGGED_DOT_REPO)
    assert not hasattr(torch.backends, "tpu") and torch.accelerator.current_accelerator is cpu_host
    assert module.__file__.endswith("build/torch-tpu/ragged_dot_tpu/__init__.py")
    with tpu_variant_selection():
        assert kernels_backend() == "tpu"
        with tpu_variant_selection():  # nested: kernels answers tpu already, nothing more is set
            assert kernels_backend() == "tpu"
        assert kernels_backend() == "tpu"
        # the one stand-in this kernels reads, not both
        assert hasattr(torch.backends, "tpu") == _kernels_reads_torch_backends_tpu()
        assert (torch.accelerator.current_accelerator is cpu_host) == _kernels_reads_torch_backends_tpu()
    assert not hasattr(torch.backends, "tpu") and torch.accelerator.current_accelerator is cpu_host
    assert kernels_backend() == "cpu"
    with pytest.raises(FileNotFoundError, match="no build/ folder"):
        load_local_kernel(RAGGED_DOT_REPO / "build")


def test_a_kernels_that_reads_something_else_is_named(cpu_host, monkeypatch):
    """A kernels whose detection no stand-in moves, or whose detection is not where hf_tpu looks: an error naming
    kernels' answer (or where hf_tpu looked), and torch left as it was."""
    from hf_tpu.kernels import KernelsDetectionError, kernels_backend, loader

    monkeypatch.setattr(loader, "_STAND_INS", loader._STAND_INS[:0])
    with pytest.raises(KernelsDetectionError, match=r"does not select the torch-tpu build variant.*answers 'cpu'"):
        load_local_kernel(RAGGED_DOT_REPO)
    monkeypatch.setattr(loader, "_DETECTION", (("kernels.no_such_module", "_backend"),))
    expected = r"expected kernels' backend detection at kernels\.no_such_module\._backend\(\).*found neither"
    with pytest.raises(KernelsDetectionError, match=expected):
        kernels_backend()
    assert not hasattr(torch.backends, "tpu") and torch.accelerator.current_accelerator is cpu_host


def _fake_hub_cache(root, repo_id: str, version: int, source=RAGGED_DOT_REPO) -> None:
    """A Hugging Face Hub cache entry for a kernel repo: refs/v<N> -> commit, snapshots/<commit>/ the files of
    ``source`` (a shipped kernel folder)."""
    from huggingface_hub.file_download import repo_folder_name

    storage = root / repo_folder_name(repo_id=repo_id, repo_type="kernel")
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / f"v{version}").write_text(COMMIT)
    (storage / "refs" / "main").write_text(COMMIT)
    snapshot = storage / "snapshots" / COMMIT
    shutil.copytree(source, snapshot, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _point_kernels_at_the_cache(monkeypatch, root) -> None:
    """kernels' Hub cache at ``root``: kernels 0.19 reads KERNELS_CACHE on every call; 0.17 read it once, at import,
    into ``CACHE_DIR`` (bound by name in its resolver, install and locking modules)."""
    import importlib
    import importlib.util

    monkeypatch.setenv("KERNELS_CACHE", str(root))
    for name in ("kernels.resolver", "kernels.install", "kernels.locking"):
        if importlib.util.find_spec(name) is not None and hasattr(importlib.import_module(name), "CACHE_DIR"):
            monkeypatch.setattr(importlib.import_module(name), "CACHE_DIR", str(root))


@pytest.mark.parametrize("backend", ["real", "simulated"])
def test_get_kernel_offline_from_the_local_hub_cache(tmp_path, monkeypatch, backend):
    import huggingface_hub.constants
    from kernels import get_kernel

    _fake_hub_cache(tmp_path, REPO_ID, version=1)
    _point_kernels_at_the_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    if backend == "real":  # the seed's plain get_kernel on a TPU VM, with hf_tpu.enable() (runtime: chips found)
        from hf_tpu import runtime

        monkeypatch.setattr(runtime, "is_real", lambda: True)
        tpu = types.SimpleNamespace(type="tpu", index=0)  # torch-tpu's device, the accelerator on a TPU VM
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: tpu)
        with hf_tpu.enabled("kernels"):
            module = get_kernel(REPO_ID, version=1, trust_remote_code=[REPO_ID])
        assert not hasattr(torch.backends, "tpu")
    else:
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
        with tpu_variant_selection():
            module = get_kernel(REPO_ID, version=1, trust_remote_code=[REPO_ID])
    # resolved from the cache's snapshot: kernels 0.17 imports it from there; 0.19 reuses a build of the same kernel id
    # already imported ("Kernel ids are unique per build": the shipped copy, when an earlier test loaded it) and
    # records where it resolved it
    from kernels import get_loaded_kernels

    if not module.__file__.startswith(str(tmp_path / "kernels--hf-tpu-test--ragged-dot-tpu" / "snapshots" / COMMIT)):
        loaded = [k for k in get_loaded_kernels() if k.repo_info is not None and k.repo_info.repo_id == REPO_ID]
        assert loaded and str(loaded[-1].repo_info.revision) == COMMIT and loaded[-1].module is module  # (the newest)
    with pytest.raises(ValueError, match="Version 2 not found"), tpu_variant_selection():
        get_kernel(REPO_ID, version=2, trust_remote_code=True)
    # the same build loaded from two places registers its op once and shares it
    shipped = load_local_kernel(RAGGED_DOT_REPO)
    assert module.OP_NAMESPACE == shipped.OP_NAMESPACE
    assert module.ragged_dot_op is shipped.ragged_dot_op


def test_get_kernel_loads_the_decode_attention_kernel_offline_from_the_local_hub_cache(tmp_path, monkeypatch):
    """The decode-attention-tpu folder as a Hub repository: plain ``kernels.get_kernel`` (the variant selected as
    hf_tpu's loader does) resolves it from the cache, and it computes the attention (its reference on the CPU)."""
    import huggingface_hub.constants
    from kernels import get_kernel

    repo_id = "hf-tpu-test/decode-attention-tpu"
    _fake_hub_cache(tmp_path, repo_id, version=1, source=DECODE_ATTENTION_REPO)
    _point_kernels_at_the_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delattr(torch.backends, "tpu", raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    with tpu_variant_selection():
        module = get_kernel(repo_id, version=1, trust_remote_code=[repo_id])
    assert callable(module.decode_attention)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    mask = torch.arange(16)[None, :] < torch.tensor([[16], [3]])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :],
                                                            enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(module.decode_attention(q, k, v, torch.tensor([16, 3])), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("repo", REPOS, ids=lambda r: r.name)
def test_kernel_is_standalone_and_loads_without_importing_jax(repo):
    """The Hub kernel must not need hf_tpu, and loading it must not import jax (only running it does)."""
    code = (
        "import sys, types, torch, kernels\n"
        "# what kernels reads on a TPU VM, stood in: torch.backends.tpu (kernels 0.17: docs/kernels.md's line\n"
        "# without hf_tpu), torch-tpu's device as the accelerator (kernels 0.18+)\n"
        "torch.backends.tpu = types.ModuleType('torch.backends.tpu')\n"
        "torch.accelerator.current_accelerator = lambda check_available=False: types.SimpleNamespace(type='tpu')\n"
        f"m = kernels.get_local_kernel(__import__('pathlib').Path({str(repo)!r}))\n"
        "assert callable(getattr(m, 'experts_forward', None) or m.decode_attention)\n"
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
        cwd=repo,
    )
    assert result.returncode == 0, result.stderr[-2000:]
