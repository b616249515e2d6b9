"""The aten ops torch-tpu 0.2.0 does not implement: refused on the simulated device as a chip refuses them.

torch_tpu registers ``TpuMissingOpFallback`` as its PrivateUse1 backend fallback (``csrc/eager/tpu_aten_kernels.cc``):
an op with neither a torch_tpu kernel nor a composite of torch's raises "operator '<op>' is not implemented for
TPU. Please file a feature request", unless ``torch_tpu._internal.execution_mode.enable_cpu_fallback`` is on (off by
default), in which case it logs "... Falling back to CPU" and runs the CPU kernel. ``_torch_tpu_ops.py`` lists those
ops, read from torch-tpu's dispatcher by ``scripts/torch_tpu_op_table.py``; the simulator gives each of them a
Python kernel (:func:`handler`) that does the same, adds what hf_tpu suggests instead, and counts the ops the CPU
fallback runs (``hf_tpu.sim.stats().cpu_fallbacks``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hf_tpu.sim._counters import STATE
from hf_tpu.sim._torch_tpu_ops import REFUSED, TORCH_TPU_VERSION, VIA_OUT

__all__ = ["REFUSED", "VIA_OUT", "handler", "message", "qualified_names", "suggestion"]

_LOG = logging.getLogger("hf_tpu.sim")
_WARNED: set[str] = set()

# (op name prefixes, what to do instead): the first match wins.
_SUGGESTIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("_scaled_dot_product", "_efficient_attention", "_flash_attention", "_cudnn_attention", "_fused_sdp"),
        "call torch.nn.functional.scaled_dot_product_attention, which takes torch_tpu's own attention path "
        "(the overrideable fused kernel, or the math decomposition)",
    ),
    (
        ("_weight_int8pack_mm", "_int_mm", "_weight_int4pack", "_convert_weight_to_int4pack", "_dyn_quant",
         "_mixed_dtypes_linear"),
        "keep packed weights as plain tensors and dequantize them to bfloat16 on the device before a plain "
        "matmul (hf_tpu's quantization path does this)",
    ),
    (
        ("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"),
        "train in bfloat16 (torch.autocast('tpu', dtype=torch.bfloat16) or a bfloat16 model) without "
        "torch.amp.GradScaler: bfloat16 keeps float32's exponent range, so no loss scaling is needed",
    ),
    (("median", "nanmedian", "kthvalue", "mode"), "use torch.sort (or torch.topk) and index the element you need"),
    (("_unique", "unique_dim"), "use torch.unique(x) without dim (it runs as _unique2), or keep the work on the CPU"),
    (("nansum",), "use torch.where(x.isnan(), 0, x).sum()"),
    (("std_mean",), "compute x.std(...) and x.mean(...) separately"),
    (("index_select",), "call index_select without out= (or index with x[idx])"),
    (("_to_sparse", "_to_dense", "sparse", "_sparse", "_coalesce", "_indices", "_values", "_nnz", "_dim"),
     "keep sparse tensors on the CPU; torch_tpu supports strided tensors only"),
    (("range",), "use torch.arange"),
    (("logaddexp",), "use torch.logsumexp(torch.stack([a, b]), 0)"),
    (("triu_indices",), "build the indices on the CPU once and move them with .to('tpu')"),
)


def qualified_names() -> dict[str, str]:
    """``{"aten.median.default": "aten::median", ...}``: every refused overload as ``str(OpOverload)`` prints it,
    mapped to the op that torch_tpu's message names (the out= op for :data:`VIA_OUT` entries)."""
    names = {}
    for op in REFUSED:
        names[_overload_str(op)] = f"aten::{op}"
    for op, out in VIA_OUT.items():
        names[_overload_str(op)] = f"aten::{out}"
    return names


def _overload_str(op: str) -> str:
    name, _, overload = op.partition(".")
    return f"aten.{name}.{overload or 'default'}"


def suggestion(op_name: str) -> str | None:
    """What hf_tpu suggests instead of the refused op ``aten::name[.overload]`` (None: nothing specific)."""
    bare = op_name.removeprefix("aten::").partition(".")[0]
    for prefixes, text in _SUGGESTIONS:
        if bare.startswith(prefixes):
            return text
    return None


def message(op_name: str) -> str:
    """torch_tpu's message for a refused op, then hf_tpu's advice."""
    text = f"operator '{op_name}' is not implemented for TPU. Please file a feature request"
    hint = suggestion(op_name)
    advice = f" Instead: {hint}." if hint else ""
    return (
        f"{text}\n(simulated tpu device: torch-tpu {TORCH_TPU_VERSION} sends this op to its missing-op fallback, so a "
        f"chip raises this too.{advice} To run it on the host anyway, as torch_tpu's CPU fallback does, set "
        "hf_tpu.sim.execution_mode.enable_cpu_fallback = True; hf_tpu.sim.stats().cpu_fallbacks counts those ops.)"
    )


def handler(refused_as: str, run_on_host: Callable[[Any, Any, tuple, dict], Any]) -> Any:
    """The simulator's kernel for a refused op (``_ops._HANDLERS`` signature): raise, or run it on the host with
    ``run_on_host`` (the fallback's generic path, ``_ops._generic``, which passes itself in)."""

    def refuse(op: Any, info: Any, args: tuple, kwargs: dict) -> Any:
        if not STATE.cpu_fallback:
            raise RuntimeError(message(refused_as))
        if refused_as not in _WARNED:
            _WARNED.add(refused_as)
            _LOG.warning("operator '%s' is not implemented for TPU. Falling back to CPU", refused_as)
        STATE.cpu_fallbacks += 1
        return run_on_host(op, info, args, kwargs)

    refuse.refused_as = refused_as  # type: ignore[attr-defined]
    return refuse
