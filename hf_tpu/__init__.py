"""hf_tpu: the Hugging Face stack on Google TPUs through TorchTPU, and on a simulated ``tpu`` device anywhere.

``import hf_tpu`` is cheap: torch_tpu, jax, transformers and diffusers are imported only by the feature that
needs them. Set ``HF_TPU_SIMULATE=1`` (or call :func:`hf_tpu.sim.enable`) to get a ``tpu`` device backed by
CPU memory on a machine without TPU chips.

An unknown attribute raises the built-in ``AttributeError`` from the module's ``__getattr__`` (the protocol
``hasattr`` and ``getattr`` with a default rely on), not an hf_tpu error.

Example:
    >>> import hf_tpu
    >>> hf_tpu.enable()          # teach accelerate/transformers/diffusers about the TPU   # doctest: +SKIP
    >>> hf_tpu.disable()         # and put them back exactly as they were                  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from hf_tpu import _env
from hf_tpu._patch import disable, enable, enabled, is_enabled
from hf_tpu._version import __version__

__all__ = ["__version__", "disable", "enable", "enabled", "is_enabled", "runtime", "sim", "warmup"]

# Public names that live in submodules, imported on first use.
_LAZY: dict[str, str] = {
    "runtime": "hf_tpu.runtime",
    "sim": "hf_tpu.sim",
    "warmup": "hf_tpu._warmup:warmup",
}

if TYPE_CHECKING:  # pragma: no cover
    from hf_tpu import runtime, sim


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'hf_tpu' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


if _env.SIMULATE.get():
    if "torch" not in sys.modules:
        # torch-tpu's autoload (at `import torch`) would claim the PrivateUse1 device the simulator needs.
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    importlib.import_module("hf_tpu.sim").enable()

if _env.COMPILE_CACHE.get():
    # torch_tpu reads its cache settings once, before its first compile: on a chip, point them at the cache now.
    importlib.import_module("hf_tpu.compile_cache").CompileCache.from_env()
