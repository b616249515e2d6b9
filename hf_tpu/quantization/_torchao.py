"""The calls into torchao that hf_tpu makes, in one place: quantizing a Linear of a TPU-placed model to int4.

Read by :mod:`hf_tpu.quantization._integration`'s wrapped handler; written for torchao 0.18
(``Int4WeightOnlyConfig`` fields ``group_size``, ``int4_choose_qparams_algorithm``).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from hf_tpu.errors import UnsupportedArgumentError

logger = logging.getLogger("hf_tpu.quantization")

__all__ = ["quantize_module_int4"]


def quantize_module_int4(module: torch.nn.Module, config: Any, parameter_name: str = "weight") -> torch.nn.Module:
    """Replace ``module.<parameter_name>`` (on a ``tpu`` device) by its :class:`TpuInt4Tensor`, as torchao's own
    int4 handler does with its layouts; a weight whose ``in_features`` is not a multiple of the group size stays
    as it is (torchao's rule too)."""
    from torchao.quantization.quantize_.workflows.int4.int4_choose_qparams_algorithm import Int4ChooseQParamsAlgorithm

    from hf_tpu.quantization.int4 import quantize_int4

    algorithm = getattr(config, "int4_choose_qparams_algorithm", None)
    if algorithm is not None and algorithm != Int4ChooseQParamsAlgorithm.TINYGEMM:
        raise UnsupportedArgumentError(
            f"Int4WeightOnlyConfig(int4_choose_qparams_algorithm={algorithm}) is not supported on TPU: hf_tpu's TPU "
            "int4 layout chooses min/max parameters per group (torchao's default, TINYGEMM). Drop that argument."
        )
    weight = getattr(module, parameter_name)
    group_size = int(config.group_size)
    if weight.dim() != 2 or weight.shape[-1] % group_size:
        logger.info("int4 on TPU: %s of shape %s left unquantized (group_size %d)", parameter_name,
                    tuple(weight.shape), group_size)
        return module
    setattr(module, parameter_name, torch.nn.Parameter(quantize_int4(weight, group_size), requires_grad=False))
    module.extra_repr = types.MethodType(_extra_repr(module.extra_repr, parameter_name), module)
    return module


def _extra_repr(original: Any, parameter_name: str) -> Any:
    def extra_repr(self: torch.nn.Module) -> str:
        weight = getattr(self, parameter_name)
        return f"{original()}, {parameter_name}=TpuInt4Tensor(group_size={weight.group_size})"

    return extra_repr
