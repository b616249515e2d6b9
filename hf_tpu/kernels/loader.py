"""Load the Hub kernels that ship inside hf_tpu (``hf_tpu/kernels/hub/<repo>/``), through the ``kernels`` library.

Each folder under ``hub/`` is a kernel repository in the Hub layout (``build/torch-tpu/<package>/`` plus its
``metadata.json``), the same bytes one would upload with ``huggingface-cli upload``. ``kernels`` picks the
``torch-tpu`` build variant when ``torch.backends.tpu`` exists, which TorchTPU sets when it is imported. On a
host without TorchTPU (the simulated device, CI) the variant is still the right one to load, because the kernel
also runs on CPU and simulated tensors through its XLA path; :func:`load_local_kernel` then makes ``kernels``
see the TPU backend for the duration of the load only.

Example:
    >>> from hf_tpu.kernels import load_ragged_dot_kernel
    >>> kernel = load_ragged_dot_kernel()                       # doctest: +SKIP
    >>> kernel.experts_forward                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from hf_tpu import _patch

__all__ = ["HUB_DIR", "RAGGED_DOT_REPO", "load_local_kernel", "load_ragged_dot_kernel", "tpu_variant_selection"]

HUB_DIR = Path(__file__).resolve().parent / "hub"
RAGGED_DOT_REPO = HUB_DIR / "ragged-dot-tpu"

_FEATURE = "kernels-variant"


@contextlib.contextmanager
def tpu_variant_selection() -> Iterator[None]:
    """Inside, ``kernels`` resolves build variants as it does under TorchTPU (``torch-tpu``).

    A no-op where ``torch.backends.tpu`` already exists. Otherwise a placeholder ``torch.backends.tpu`` module is
    set through hf_tpu's patch registry and removed on exit.
    """
    import torch

    if hasattr(torch.backends, "tpu"):
        yield
        return
    placeholder = types.ModuleType("torch.backends.tpu", "Placeholder set by hf_tpu while kernels resolves a variant.")
    _patch.patch(torch.backends, "tpu", placeholder, feature=_FEATURE)
    try:
        yield
    finally:
        _patch.revert(_FEATURE)


def load_local_kernel(repo_path: str | Path, *, trust_remote_code: bool | list[str] = False) -> ModuleType:
    """``kernels.get_local_kernel`` on a kernel repository folder, with the ``torch-tpu`` variant selected.

    Example:
        >>> from hf_tpu.kernels.loader import RAGGED_DOT_REPO, load_local_kernel
        >>> load_local_kernel(RAGGED_DOT_REPO).ragged_dot          # doctest: +SKIP
    """
    from kernels import get_local_kernel

    repo_path = Path(repo_path)
    if not (repo_path / "build").is_dir():
        raise FileNotFoundError(
            f"load_local_kernel({str(repo_path)!r}): no build/ folder there; a kernel repository in the Hub layout "
            "has build/<variant>/<package>/__init__.py and build/<variant>/metadata.json."
        )
    with tpu_variant_selection():
        return get_local_kernel(repo_path, trust_remote_code=trust_remote_code)


def load_ragged_dot_kernel() -> ModuleType:
    """The ragged-dot MoE experts kernel shipped with hf_tpu (same code as the Hub repository ``ragged-dot-tpu``).

    Example:
        >>> kernel = load_ragged_dot_kernel()                       # doctest: +SKIP
        >>> out = kernel.ragged_dot(x, w, group_sizes)              # doctest: +SKIP
    """
    return load_local_kernel(RAGGED_DOT_REPO)
