"""The contract tier: hf_tpu's real-mode code against torch-tpu 0.2.0's own Python, on a host without chips.

These tests run in ``.ci/run``'s second environment (``.venv-tpu``: torch 2.13.0 + torch-tpu 0.2.0 + libtpu), with
torch_tpu autoloaded as on a TPU VM (``TORCH_DEVICE_BACKEND_AUTOLOAD=1``). They call the wheel's real functions
(topology tables, ``set_tpu_launch_env``, ``torch.tpu.pallas.jax_op``, the patched ``torch.compile``, device
properties); a stand-in replaces only what needs a chip (the PCI scan, device init), and is built from the wheel's
own code or data.

Where torch-tpu is not installed (the README's test venv) the whole directory is skipped, unless
``HF_TPU_EXPECT_TORCH_TPU=1`` (set by ``.ci/run``) says it must be there: then a missing torch-tpu is an error.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def _torch_tpu_version() -> str | None:
    try:
        return importlib.metadata.version("torch-tpu")
    except importlib.metadata.PackageNotFoundError:
        return None


TORCH_TPU_VERSION = _torch_tpu_version()


def pytest_ignore_collect(collection_path, config):
    """Skip the tier's modules (they import torch_tpu at module level) where torch-tpu is not installed."""
    if TORCH_TPU_VERSION is not None:
        return None
    if os.environ.get("HF_TPU_EXPECT_TORCH_TPU") == "1":
        raise RuntimeError("HF_TPU_EXPECT_TORCH_TPU=1 but torch-tpu is not installed in this environment")
    return collection_path.name.startswith("test_") or None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` (``.ci/run``'s contract step) tests that share a module-scoped fixture (one lowering
    process, one set of plans) go to one worker as an ``xdist_group``, so the fixture is built once; every other test
    of the tier is handed out on its own. The groups are the connected sets of a module's tests linked by a shared
    module-scoped fixture. Runs before xdist's own hook, which reads the marker (pytest < 9.2: pyproject.toml)."""
    here = os.path.dirname(os.path.abspath(__file__))
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    linked: list[tuple[pytest.Item, list[str]]] = []
    for item in items:
        if not str(item.path).startswith(here + os.sep) or item.get_closest_marker("xdist_group"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        keys = [
            f"{item.module.__name__}.{name}"  # (no "::": JUnit would read the group as the test's name)
            for name in info.names_closure
            if any(d.scope == "module" for d in info.name2fixturedefs.get(name, ()))
        ]
        for a, b in zip(keys, keys[1:]):
            parent[find(a)] = find(b)
        if keys:
            linked.append((item, keys))
    for item, keys in linked:
        item.add_marker(pytest.mark.xdist_group(find(keys[0])))


@pytest.fixture(scope="session")
def torch_tpu_version() -> str:
    """The installed torch-tpu version (the tier is written for 0.2.0)."""
    assert TORCH_TPU_VERSION is not None
    return TORCH_TPU_VERSION


def make_pci_tree(root, pci_id: str, count: int, vendor: str = "0x1ae0"):
    """A sysfs PCI tree with ``count`` devices ``vendor:pci_id``, each exposed through VFIO: what a TPU VM shows
    torch_tpu. Returns ``(pci_dir, vfio_dir)``."""
    from _fake_pci import make_sysfs

    return make_sysfs(root, [(vendor, pci_id, True)] * count)


@pytest.fixture
def fake_tpu_host(tmp_path, monkeypatch):
    """``fake_tpu_host(pci_id, count)``: the wheel's hardware module (its real scan code) and hf_tpu's PCI scan
    read a fake sysfs tree with ``count`` TPU devices of that PCI id; only the paths are stood in."""
    import pathlib
    import types

    from torch_tpu._internal.utils import hardware

    from hf_tpu import runtime

    made = {"n": 0}

    def install(pci_id: str, count: int):
        made["n"] += 1
        pci, vfio = make_pci_tree(tmp_path / f"host{made['n']}", pci_id, count)
        paths = {"/sys/bus/pci/devices": pci, "/dev/vfio": vfio}

        def path(p, *rest):
            return pathlib.Path(paths.get(str(p), p), *rest)

        monkeypatch.setattr(hardware, "pathlib", types.SimpleNamespace(Path=path))
        monkeypatch.setattr(runtime, "PCI_ROOT", str(pci))
        monkeypatch.setattr(runtime, "VFIO_ROOT", str(vfio))
        return pci, vfio

    return install
