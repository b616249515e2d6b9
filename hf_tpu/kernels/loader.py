"""Load the Hub kernels that ship inside hf_tpu (``hf_tpu/kernels/hub/<repo>/``), through the ``kernels`` library.

Each folder under ``hub/`` is a kernel repository in the Hub layout (``build/torch-tpu/<package>/`` plus its
``metadata.json``), the same bytes one would upload with ``huggingface-cli upload``.

``kernels`` loads the ``torch-tpu`` build variant only where its own backend detection (``_backend()``) answers
``tpu``, and what that detection reads changed between releases (read in each release's ``backends.py``):

- kernels 0.17: ``hasattr(torch.backends, "tpu")``, which torch-tpu 0.2.0 never sets (no file of the wheel mentions
  it; checked after autoload);
- kernels 0.18 and 0.19 (read: 0.18.3, 0.19.1): ``torch.accelerator.current_accelerator().type == "tpu"``, which
  holds on a TPU VM once torch-tpu has renamed the PrivateUse1 backend ``tpu`` (its autoload does so where it finds
  chips, ``torch_tpu/_loader.py``) and on hf_tpu's simulated device, but not on a CPU host.

:func:`kernels_backend` asks the installed ``kernels`` for its answer; hf_tpu finds what to stand in by asking it
again, never by its version:

- :func:`expose_tpu_backend`, applied by ``hf_tpu.enable()`` on a host with TPU chips where ``kernels`` does not
  answer ``tpu`` by itself (kernels 0.17): a placeholder ``torch.backends.tpu`` through hf_tpu's patch registry, so
  that plain ``kernels.get_kernel`` / ``get_local_kernel`` find the variant; ``hf_tpu.disable()`` removes it.
  Nothing where ``kernels`` already answers ``tpu`` (kernels 0.18+ on a TPU VM, the simulated device).
- :func:`tpu_variant_selection`, used by :func:`load_local_kernel`: for the duration of one load, on any host (the
  kernel also runs on CPU and simulated tensors through its XLA path), the first of hf_tpu's stand-ins under which
  ``kernels`` answers ``tpu``: the placeholder ``torch.backends.tpu`` (kernels 0.17), else an answer of
  ``torch.accelerator.current_accelerator()`` whose ``type`` is ``"tpu"`` (kernels 0.18+). Where none does, it
  raises :class:`KernelsDetectionError` naming what ``kernels`` answered.

Example:
    >>> from hf_tpu.kernels import load_ragged_dot_kernel
    >>> kernel = load_ragged_dot_kernel()                       # doctest: +SKIP
    >>> kernel.experts_forward                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from hf_tpu import _patch
from hf_tpu.errors import HfTpuError, MissingFileError

__all__ = [
    "DECODE_ATTENTION_REPO",
    "HUB_DIR",
    "RAGGED_DOT_REPO",
    "KernelsDetectionError",
    "expose_tpu_backend",
    "kernels_backend",
    "load_decode_attention_kernel",
    "load_local_kernel",
    "load_ragged_dot_kernel",
    "tpu_variant_selection",
]

HUB_DIR = Path(__file__).resolve().parent / "hub"
RAGGED_DOT_REPO = HUB_DIR / "ragged-dot-tpu"
DECODE_ATTENTION_REPO = HUB_DIR / "decode-attention-tpu"

_FEATURE = "kernels-variant"
_PROBE = "kernels-probe"  # expose_tpu_backend's question to kernels, answered and reverted at once
# The kernels releases whose backend detection the stand-ins below were written for (0.17.2 and 0.19.1 tested, 0.18.3
# read); outside it hf_tpu._patch warns once, and the stand-ins are still checked by asking kernels again.
_KERNELS_VERSIONS = ">=0.17,<0.20"
# Where kernels keeps its backend detection, newest first: kernels 0.19 (kernels/_internals/backends.py), then 0.17
# and 0.18 (kernels/backends.py). The function is private to kernels: hf_tpu only calls it, to ask its answer.
_DETECTION = (("kernels._internals.backends", "_backend"), ("kernels.backends", "_backend"))


class KernelsDetectionError(HfTpuError, RuntimeError):
    """The installed ``kernels`` does not detect a ``tpu`` backend where hf_tpu needs it to, or keeps its backend
    detection where hf_tpu does not find it: the message names what hf_tpu expected and what it found."""


def _kernels_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _detection() -> tuple[str, Callable[[], object]]:
    """kernels' backend detection function and where it was found (``module._backend``)."""
    for module_name, name in _DETECTION:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        detect = getattr(module, name, None)
        if callable(detect):
            return f"{module_name}.{name}", detect
    expected = " or ".join(f"{m}.{n}()" for m, n in _DETECTION)
    raise KernelsDetectionError(
        f"kernels {_kernels_version()}: hf_tpu expected kernels' backend detection at {expected} (kernels 0.19; "
        "0.17 and 0.18) and found neither, so it cannot tell which build variants kernels loads. Install "
        f"kernels{_KERNELS_VERSIONS} or report the version at the hf_tpu issue tracker."
    )


def kernels_backend() -> str:
    """The backend the installed ``kernels`` detects on this host, whose build variants it loads (``"tpu"``,
    ``"cpu"``, ``"cuda"``, ...): kernels' own answer, asked on every call (it reads torch's state each time).

    Returns:
        The backend's name as kernels writes it in a variant (``Backend.name``).

    Raises:
        KernelsDetectionError: kernels keeps its detection where hf_tpu does not find it (the message says where
            hf_tpu looked).

    Example:
        >>> from hf_tpu.kernels import kernels_backend
        >>> kernels_backend() in ("tpu", "cpu")                     # doctest: +SKIP
        True
    """
    _where, detect = _detection()
    return str(detect().name)


def _placeholder() -> types.ModuleType:
    return types.ModuleType(
        "torch.backends.tpu",
        "Placeholder set by hf_tpu: kernels 0.17 selects its torch-tpu build variant when torch.backends.tpu exists, "
        "and torch-tpu 0.2.0 does not set it. Removed by hf_tpu.disable().",
    )


@dataclasses.dataclass(frozen=True)
class _TpuDeviceAnswer:
    """What :func:`tpu_variant_selection`'s stand-in for ``torch.accelerator.current_accelerator()`` answers on a host
    where ``"tpu"`` is no torch device type (no torch-tpu device, no simulator): the ``type`` and ``index`` kernels
    reads, nothing else."""

    type: str = "tpu"
    index: int | None = None

    def __str__(self) -> str:
        return self.type


def _set_placeholder(feature: str) -> None:
    import torch

    _patch.patch(torch.backends, "tpu", _placeholder(), feature=feature, package="kernels", versions=_KERNELS_VERSIONS)


def _set_accelerator_answer(feature: str) -> None:
    import torch

    current = torch.accelerator.current_accelerator
    try:
        answer = torch.device("tpu")  # a torch-tpu device or the simulator is registered under that name
    except RuntimeError:
        answer = _TpuDeviceAnswer()

    @functools.wraps(current)
    def current_accelerator(*args, **kwargs):
        return answer

    _patch.patch(torch.accelerator, "current_accelerator", current_accelerator, feature=feature, package="kernels",
                 versions=_KERNELS_VERSIONS)  # fmt: skip


#: hf_tpu's stand-ins for what kernels reads, in the order tried: (what it stands in for, who reads it, set it).
_STAND_INS: tuple[tuple[str, str, Callable[[str], None]], ...] = (
    ("torch.backends.tpu", "kernels 0.17", _set_placeholder),
    ("torch.accelerator.current_accelerator()", "kernels 0.18, 0.19", _set_accelerator_answer),
)


def _applicable(stand_in: str) -> bool:
    """Whether the stand-in would change anything: the placeholder only where torch.backends.tpu does not exist."""
    import torch

    return not (stand_in == "torch.backends.tpu" and hasattr(torch.backends, "tpu"))


def _stand_in_for_one_load() -> str | None:
    """Set, under the one-load feature, the first stand-in under which kernels answers ``tpu``; returns what it stands
    in for (None: kernels answered ``tpu`` already). Raises :class:`KernelsDetectionError` when none does (nothing
    stays set)."""
    if kernels_backend() == "tpu":
        return None
    answers = []
    for stands_for, read_by, apply in _STAND_INS:
        if not _applicable(stands_for):
            continue
        apply(_FEATURE)
        answer = kernels_backend()
        if answer == "tpu":
            return stands_for
        _patch.revert(_FEATURE)
        answers.append(f"{answer!r} with {stands_for} standing in (read by {read_by})")
    where, _detect = _detection()
    raise KernelsDetectionError(
        f"kernels {_kernels_version()} does not select the torch-tpu build variant here: its backend detection "
        f"({where}) answers {kernels_backend()!r}, and {'; '.join(answers) or 'no stand-in applies'}. hf_tpu "
        f"knows what kernels{_KERNELS_VERSIONS} reads; install one of those, or report the version at the hf_tpu "
        "issue tracker."
    )


def expose_tpu_backend(feature: str = "kernels") -> bool:
    """On a host with TPU chips where ``kernels`` does not detect the ``tpu`` backend by itself (kernels 0.17, which
    reads ``torch.backends.tpu``), make it resolve build variants for ``tpu`` until ``feature`` is reverted
    (``hf_tpu.disable()``). Returns whether it set anything.

    Does nothing where :mod:`hf_tpu.runtime` finds no real TPU (``kernels`` then keeps its own answer, ``cpu``), where
    ``kernels`` already answers ``tpu`` (kernels 0.18+ on a TPU VM: torch-tpu's device is the current accelerator; the
    simulated device), or where ``torch.backends.tpu`` already exists. Where the placeholder would not make
    ``kernels`` answer ``tpu`` either, it warns, naming what ``kernels`` answered, and sets nothing: hf_tpu's own
    loader (:func:`load_local_kernel`) still selects the variant.

    Without hf_tpu, on kernels 0.17, the same effect is one line before ``get_kernel``:
    ``torch.backends.tpu = types.ModuleType("torch.backends.tpu")``.

    Args:
        feature: the :mod:`hf_tpu._patch` feature the change is recorded under (reverted with it); ``"kernels"``
            by default.

    Returns:
        True when it set ``torch.backends.tpu``, False when it had nothing to do.

    Raises:
        KernelsDetectionError: kernels keeps its backend detection where hf_tpu does not find it.

    Example:
        >>> import hf_tpu
        >>> hf_tpu.enable("kernels")  # on a TPU VM, plain kernels.get_kernel now finds torch-tpu  # doctest: +SKIP
    """
    import torch

    from hf_tpu import runtime

    if not runtime.is_real() or hasattr(torch.backends, "tpu") or kernels_backend() == "tpu":
        return False
    _set_placeholder(_PROBE)  # asked first, under a feature of its own: does this kernels read it?
    try:
        answer = kernels_backend()
    finally:
        _patch.revert(_PROBE)
    if answer != "tpu":
        where, _detect = _detection()
        warnings.warn(
            f"hf_tpu: kernels {_kernels_version()} detects the backend {kernels_backend()!r} on this TPU VM "
            f"({where}), also with a placeholder torch.backends.tpu: plain kernels.get_kernel will not select "
            "torch-tpu build variants (hf_tpu.kernels.load_local_kernel still does). Is torch-tpu's device "
            "initialized (torch.accelerator.current_accelerator() should be tpu)?",
            stacklevel=2,
        )
        return False
    _set_placeholder(feature)
    return True


@contextlib.contextmanager
def tpu_variant_selection() -> Iterator[None]:
    """Inside, ``kernels`` resolves build variants as it does under TorchTPU (``torch-tpu``).

    A no-op where ``kernels`` already detects the ``tpu`` backend. Otherwise the first of hf_tpu's stand-ins under
    which it does is set through hf_tpu's patch registry and removed on exit: a placeholder ``torch.backends.tpu``
    (read by kernels 0.17), else an answer of ``torch.accelerator.current_accelerator()`` whose ``type`` is ``"tpu"``
    (read by kernels 0.18 and 0.19).

    Raises:
        KernelsDetectionError: no stand-in makes the installed ``kernels`` detect ``tpu`` (the message names its
            answers), or its detection is not where hf_tpu looks.
    """
    if _stand_in_for_one_load() is None:
        yield
        return
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
        KernelsDetectionError: the installed ``kernels`` cannot be made to select the ``torch-tpu`` variant (see
            :func:`tpu_variant_selection`).

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


def load_decode_attention_kernel() -> ModuleType:
    """The ragged decode attention kernel shipped with hf_tpu (same code as the Hub repository
    ``decode-attention-tpu``), loaded like :func:`load_ragged_dot_kernel`.

    Returns:
        The kernel module (``decode_attention``, ``reference``, ``decode_attention_op``, ...).

    Raises:
        FileNotFoundError: the shipped repository's ``build/`` folder is missing (a broken install).

    Example:
        >>> kernel = load_decode_attention_kernel()                 # doctest: +SKIP
        >>> out = kernel.decode_attention(query, key, value, lengths)  # doctest: +SKIP
    """
    return load_local_kernel(DECODE_ATTENTION_REPO)
