"""Load the Hub kernels that ship inside hf_tpu (``hf_tpu/kernels/hub/<repo>/``), through the ``kernels`` library.

Each folder under ``hub/`` is a kernel repository in the Hub layout (``build/torch-tpu/<package>/`` plus its
``metadata.json``), the same bytes one would upload with ``huggingface-cli upload``.

``kernels`` 0.17 picks the ``torch-tpu`` build variant only when ``torch.backends.tpu`` exists
(``kernels.backends._backend``), and torch-tpu 0.2.0 never sets that attribute (no file of the wheel mentions it;
checked after autoload). Two things close that gap:

- :func:`expose_tpu_backend`, applied by ``hf_tpu.enable()`` on a host with TPU chips: a placeholder
  ``torch.backends.tpu`` through hf_tpu's patch registry, so that plain ``kernels.get_kernel`` /
  ``get_local_kernel`` find the variant; ``hf_tpu.disable()`` removes it.
- :func:`tpu_variant_selection`, used by :func:`load_local_kernel`: the same placeholder for the duration of one
  load, on any host (the kernel also runs on CPU and simulated tensors through its XLA path).

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
from hf_tpu.errors import MissingFileError

__all__ = [
    "HUB_DIR",
    "RAGGED_DOT_REPO",
    "expose_tpu_backend",
    "load_local_kernel",
    "load_ragged_dot_kernel",
    "tpu_variant_selection",
]

HUB_DIR = Path(__file__).resolve().parent / "hub"
RAGGED_DOT_REPO = HUB_DIR / "ragged-dot-tpu"

_FEATURE = "kernels-variant"
# kernels' backend detection read for this: kernels/backends.py `_backend()`, `hasattr(torch.backends, "tpu")`.
_KERNELS_VERSIONS = ">=0.17,<0.18"


def _placeholder() -> types.ModuleType:
    return types.ModuleType(
        "torch.backends.tpu",
        "Placeholder set by hf_tpu: kernels selects its torch-tpu build variant when torch.backends.tpu exists, and "
        "torch-tpu 0.2.0 does not set it. Removed by hf_tpu.disable().",
    )


def expose_tpu_backend(feature: str = "kernels") -> bool:
    """On a host with TPU chips, make ``kernels`` resolve build variants for the ``tpu`` backend until ``feature``
    is reverted (``hf_tpu.disable()``). Returns whether it set anything.

    Does nothing where ``torch.backends.tpu`` already exists (a future torch-tpu, or hf_tpu's simulator) or where
    :mod:`hf_tpu.runtime` finds no real TPU (``kernels`` then keeps its own answer, ``cpu``).

    Without hf_tpu, the same effect is one line before ``get_kernel``:
    ``torch.backends.tpu = types.ModuleType("torch.backends.tpu")``.

    Args:
        feature: the :mod:`hf_tpu._patch` feature the change is recorded under (reverted with it); ``"kernels"``
            by default.

    Returns:
        True when it set ``torch.backends.tpu``, False when it had nothing to do.

    Example:
        >>> import hf_tpu
        >>> hf_tpu.enable("kernels")  # on a TPU VM, plain kernels.get_kernel now finds torch-tpu  # doctest: +SKIP
    """
    import torch

    from hf_tpu import runtime

    if hasattr(torch.backends, "tpu") or not runtime.is_real():
        return False
    _patch.patch(torch.backends, "tpu", _placeholder(), feature=feature, package="kernels", versions=_KERNELS_VERSIONS)
    return True


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
    _patch.patch(
        torch.backends, "tpu", _placeholder(), feature=_FEATURE, package="kernels", versions=_KERNELS_VERSIONS
    )
    try:
        yield
    finally:
        _patch.revert(_FEATURE)


def load_local_kernel(repo_path: str | Path, *, trust_remote_code: bool | list[str] = False) -> ModuleType:
    """``kernels.get_local_kernel`` on a kernel repository folder, with the ``torch-tpu`` variant selected.

    Args:
        repo_path: a kernel repository in the Hub layout (``build/<variant>/<package>/__init__.py``).
        trust_remote_code: passed to ``kernels.get_local_kernel``; False by default.

    Returns:
        The kernel's Python module.

    Raises:
        FileNotFoundError (MissingFileError): ``repo_path`` has no ``build/`` folder.

    Example:
        >>> from hf_tpu.kernels.loader import RAGGED_DOT_REPO, load_local_kernel
        >>> load_local_kernel(RAGGED_DOT_REPO).ragged_dot          # doctest: +SKIP
    """
    from kernels import get_local_kernel

    repo_path = Path(repo_path)
    if not (repo_path / "build").is_dir():
        raise MissingFileError(
            f"load_local_kernel({str(repo_path)!r}): no build/ folder there; a kernel repository in the Hub layout "
            "has build/<variant>/<package>/__init__.py and build/<variant>/metadata.json."
        )
    with tpu_variant_selection():
        return get_local_kernel(repo_path, trust_remote_code=trust_remote_code)


def load_ragged_dot_kernel() -> ModuleType:
    """The ragged-dot MoE experts kernel shipped with hf_tpu (same code as the Hub repository ``ragged-dot-tpu``).

    Returns:
        The kernel module (``ragged_dot``, ``experts_forward``, ``make_experts_forward``, ...).

    Raises:
        FileNotFoundError: the shipped repository's ``build/`` folder is missing (a broken install).

    Example:
        >>> kernel = load_ragged_dot_kernel()                       # doctest: +SKIP
        >>> out = kernel.ragged_dot(x, w, group_sizes)              # doctest: +SKIP
    """
    return load_local_kernel(RAGGED_DOT_REPO)
