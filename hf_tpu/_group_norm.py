"""GroupNorm in a graph compiled for a ``tpu`` device gets a contiguous input (torch_tpu 0.2.0's lowering needs one).

torch_tpu 0.2.0 has no ``native_group_norm`` kernel of its own (only the backward, ``csrc/ops/group_norm``): on a tpu
tensor the dispatcher runs torch's CompositeExplicitAutograd kernel, ``math_group_norm``, which takes
``input.view(1, N * groups, -1)``. torch's ``group_norm`` hands it the input in the input's own suggested memory format
on a PrivateUse1 device (it makes CUDA inputs contiguous), so a channels-last intermediate reaches that ``view``. One
such is every diffusers ``Attention`` with a residual over a 4-D input (the VAE's and ``UNet2DModel``'s mid-block
attention): ``hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)`` is a channels-last view, the
residual add and the rescale keep its layout, and the next ResNet's GroupNorm gets it. While torch_tpu lowers a
compiled graph it runs each FX node on tensors with torch's strides (``torch_tpu/_internal/export/export.py``,
``EagerLikeFxInterpreter.run_node``), so ``compile_pipeline(pipe, vae=True)`` failed on a v5e for SD3's VAE with
``BackendCompilerFailed: ... view(): cannot create a view of shape [1, 32, 262144] from the input tensor of shape
[1, 512, 128, 128] and strides [512, 1, 65536, 512]``, and the same happens with no chip (tests/contract).

The fix is a decomposition in the table the tpu backend's AOTAutograd traces with (torch_tpu's
``torch_tpu._internal.compile._backend._TPU_DECOMPOSITIONS``; the simulator's
:data:`hf_tpu.sim._backend.DECOMPOSITIONS` mirrors it): a ``native_group_norm`` whose input is not contiguous is
traced as ``contiguous()`` then the same op, what torch's ``group_norm`` does for CUDA; a contiguous input is left to
the op as before (the decomposition declines), so a graph without such an input is unchanged. Eager GroupNorm is left
alone (the SD3 VAE decoded eagerly on the chip; why its eager strides differ there was not found without one).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from hf_tpu import _patch, runtime

logger = logging.getLogger("hf_tpu.patch")

__all__ = ["TORCH_TPU_TABLE", "apply", "contiguous_group_norm", "decompositions"]

#: (module, attribute) of torch_tpu 0.2.0's decomposition table, read by its backend at each compile.
TORCH_TPU_TABLE = ("torch_tpu._internal.compile._backend", "_TPU_DECOMPOSITIONS")
_TORCH_TPU_VERSIONS = "==0.2.0"


def contiguous_group_norm(input, weight, bias, N, C, HxW, group, eps):  # noqa: A002, N803 - aten's parameter names
    """``aten.native_group_norm`` traced with a contiguous input: ``NotImplemented`` (trace the op itself) when the
    input is contiguous already, else the op on ``input.contiguous()``."""
    import torch

    if input.is_contiguous():
        return NotImplemented
    return torch.ops.aten.native_group_norm.default(input.contiguous(), weight, bias, N, C, HxW, group, eps)


def decompositions() -> dict:
    """The decompositions this module adds: ``{aten.native_group_norm.default: contiguous_group_norm}`` (built on
    call: importing this module imports no torch)."""
    import torch

    return {torch.ops.aten.native_group_norm.default: contiguous_group_norm}


def _add_to(owner: Any, name: str, feature: str, package: str | None, versions: str | None) -> None:
    added = decompositions()
    if all(getattr(owner, name).get(op) is fn for op, fn in added.items()):
        return  # in force already
    table = _patch.original(owner, name)
    _patch.patch(owner, name, {**table, **added}, feature=feature, package=package, versions=versions)


def apply(feature: str) -> None:
    """Add the decomposition to the tpu backend's table: torch_tpu's where torch_tpu is loaded (a TPU host, or the
    chipless lowering of :mod:`hf_tpu.tpu_compile`), the simulator's where the simulated device runs. Idempotent;
    reverted with ``feature``.

    Args:
        feature: the integration the patch belongs to (``"diffusers"``).
    """
    import importlib

    if "torch_tpu" in sys.modules:  # never imported here: on a simulated host it must not load
        try:
            owner = importlib.import_module(TORCH_TPU_TABLE[0])
        except ImportError:  # pragma: no cover - another torch_tpu layout
            owner = None
        if owner is not None and isinstance(getattr(owner, TORCH_TPU_TABLE[1], None), dict):
            _add_to(owner, TORCH_TPU_TABLE[1], feature, "torch-tpu", _TORCH_TPU_VERSIONS)
        else:  # pragma: no cover - another torch_tpu layout
            logger.warning("hf_tpu[%s]: torch_tpu has no %s.%s; GroupNorm in compiled graphs is left as it is",
                           feature, *TORCH_TPU_TABLE)  # fmt: skip
    if runtime.is_simulated():
        from hf_tpu.sim import _backend

        _add_to(_backend, "DECOMPOSITIONS", feature, None, None)
