"""The simulator's optional native core (``_native.cpp``): its per-op work in C++ instead of Python.

The Python fallback (``_ops.py``) costs roughly 15-20 us per device op, which makes a tiny model's forward about 3x
its CPU time. The native core runs the common case of each op (device tensors in, tensors out or written in place)
without entering Python: it keeps device storages, counts ops, shape signatures and device memory, and hands
anything else to the op's Python kernel, so behaviour, errors and counters stay the same (tests/sim/test_native.py
compares the two). Its C++ PrivateUse1 hooks also give torch a pinned-memory allocator and storage resizing, which
hooks written in Python cannot. It is compiled once per torch version and source with ``torch.utils.cpp_extension``
(a C++ compiler and ninja are needed; about 40 s on 2 cores) into ``$HF_TPU_CACHE/sim-native`` (default
``~/.cache/hf_tpu``).

``HF_TPU_SIM_NATIVE=0`` keeps the pure-Python path; ``HF_TPU_SIM_NATIVE=1`` makes a failed build an error.
Without a compiler the simulator still works, in Python, and ``hf-tpu env`` says why it is slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from hf_tpu import _env

__all__ = ["load", "status"]

_LOG = logging.getLogger("hf_tpu.sim")
_SOURCE = Path(__file__).with_name("_native.cpp")
_STATE: dict[str, object] = {}


def _cache_dir(tag: str) -> Path:
    root = _env.CACHE.get() or os.path.join(os.path.expanduser("~"), ".cache", "hf_tpu")
    return Path(root) / "sim-native" / tag


def load() -> ModuleType | None:
    """The compiled native core, building it on first use; None where it is off or cannot be built."""
    if "module" in _STATE:
        return _STATE["module"]  # type: ignore[return-value]
    setting = _env.SIM_NATIVE.get()  # False: off; True: the native core or an error; None: where it builds
    module = None
    if setting is False:
        _STATE["reason"] = "off (HF_TPU_SIM_NATIVE=0)"
    else:
        try:
            module = _build()
            _STATE["reason"] = "on"
        except Exception as e:  # noqa: BLE001 -- any build failure leaves the Python path, said once
            if setting is True:
                raise RuntimeError(
                    f"HF_TPU_SIM_NATIVE=1 but the simulator's native core could not be built: {e}. Install a C++ "
                    "compiler and ninja (pip install ninja), or unset HF_TPU_SIM_NATIVE to use the Python path."
                ) from e
            first = _first_error(e)
            _STATE["reason"] = f"unavailable ({first[:200]}); the simulator runs in Python, about 2x slower per op"
            _LOG.warning(
                "hf_tpu.sim: the native core could not be built (%s); the simulator runs its ops in Python, which is "
                "slower. Install a C++ compiler and ninja to speed it up, or set HF_TPU_SIM_NATIVE=0 to silence this.",
                first[:200],
            )
    _STATE["module"] = module
    return module


def _first_error(e: Exception) -> str:
    """The line of a build failure that says what went wrong (a compiler's "error:" line when there is one)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith(("[", "c++", "g++", "clang")):
            return line
    return lines[0] if lines else type(e).__name__


def status() -> str:
    """'on', 'off (...)', 'unavailable (...)', or 'not loaded' (before the simulator was enabled)."""
    return str(_STATE.get("reason", "not loaded"))


def _key() -> str:
    """What the build depends on: the source, torch's version and Python's."""
    import torch

    return hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]


def _build() -> ModuleType:
    key = _key()
    name = f"hf_tpu_sim_native_{key}"
    build = _cache_dir(key)
    built = build / f"{name}.so"
    done = build / "built"  # written after a build succeeded: the .so is complete
    if not (built.is_file() and done.is_file()):
        build.mkdir(parents=True, exist_ok=True)
        with open(build / "hf_tpu.lock", "w") as lock:
            _lock(lock)  # one builder per cache directory; released by the OS if its process dies
            if not (built.is_file() and done.is_file()):
                _LOG.warning(
                    "hf_tpu.sim: building the simulator's native core in %s (once per torch version, about 40 s on "
                    "2 cores; HF_TPU_SIM_NATIVE=0 skips it)", build
                )
                started = time.monotonic()
                _compile(name, build)
                done.write_text(f"{name}\n")
                _LOG.warning("hf_tpu.sim: built the simulator's native core in %.0f s", time.monotonic() - started)
    return _import(name, built)


def _lock(f) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: torch's own lock file (below) serialises the builds
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def _compile(name: str, build: Path) -> None:
    from torch.utils import cpp_extension

    # torch's lock file: under our lock nobody else builds here, so one left behind is a killed build's (torch
    # would wait on it forever)
    stale = build / "lock"
    if stale.exists() and os.name != "nt":
        stale.unlink()
    cpp_extension.load(
        name=name,
        sources=[str(_SOURCE)],
        build_directory=str(build),
        extra_cflags=["-O2"],
        verbose=False,
    )


def _import(name: str, path: Path) -> ModuleType:
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the simulator's native core from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
