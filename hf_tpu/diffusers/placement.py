"""The ``diffusers`` integration: ``pipe.to("tpu")`` places everything or fails, never half.

Upstream ``DiffusionPipeline.to`` already moves every model component to a ``tpu`` device (the test suite proves
it on the simulated device), and the pipelines keep what belongs on the host there (a CPU generator draws the
latents on the host and copies them over). What it does not do for a ``tpu`` target, as of diffusers 0.42:

- with no TPU at all, ``torch.device("tpu")`` fails with torch's list of device types, not how to get one;
- a sequentially offloaded pipeline is refused for ``cuda``/``xpu`` only; for ``tpu`` it is moved half-way;
- a group-offloaded component is skipped with a log warning and stays on the host;
- a component with weights on the ``meta`` device fails with "Cannot copy out of meta tensor", naming nothing.

The same holds for a Modular Diffusers ``ModularPipeline`` (its ``to`` moves the components it holds, which a
``ComponentsManager`` then reports on the new device). This integration wraps both ``to`` methods (through
:mod:`hf_tpu._patch`, reverted by ``hf_tpu.disable()``) so that for a ``tpu`` target those cases raise an error
naming the component and the fix, and after the move it checks that no tensor of any model component was left
behind, and installs the per-call size and generator checks of :mod:`hf_tpu.diffusers._call_checks` on that
pipeline (a modular pipeline has no such methods: its blocks check their own inputs). Other targets (``cpu``,
``cuda``, a dtype) go straight to upstream. It also gives GroupNorm a contiguous input in graphs compiled for the tpu
device (:mod:`hf_tpu._group_norm`: the channels-last output of diffusers' attention residual, which torch_tpu's
lowering refuses there).

Example:
    >>> import hf_tpu
    >>> hf_tpu.enable("diffusers")                     # doctest: +SKIP
    >>> pipe.to("tpu")                                 # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any

from hf_tpu._patch import patch
from hf_tpu.errors import InvalidArgumentError

__all__ = ["apply", "is_tpu_target"]

FEATURE = "diffusers"
_WRITTEN_FOR = ">=0.35,<0.43"


def is_tpu_target(args: tuple, kwargs: dict) -> Any:
    """The ``tpu`` device a ``DiffusionPipeline.to(*args, **kwargs)`` call asks for, or None for any other target.

    Parsed without ``torch.device`` so that a ``"tpu"`` string is recognised even where torch does not know the
    device type (no torch_tpu and no simulator).
    """
    import torch

    candidates = [kwargs.get("device")] + [a for a in args[:2] if not isinstance(a, torch.dtype)]
    for c in candidates:
        if isinstance(c, torch.device) and c.type == "tpu":
            return c
        if isinstance(c, str) and c.split(":", 1)[0].strip() == "tpu":
            return c
    return None


def _component_problems(pipe: Any) -> list[str]:
    import torch

    problems = []
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        label = f"{name} ({type(module).__name__})"
        hooks = [m._hf_hook for m in module.modules() if getattr(m, "_hf_hook", None) is not None]
        hook_names = {type(h).__name__ for h in hooks}
        if hook_names & {"AlignDevicesHook", "SequentialHook"}:
            problems.append(
                f"{label} is sequentially offloaded (enable_sequential_cpu_offload): call pipe.remove_all_hooks() "
                f"before pipe.to('tpu'), or offload to the TPU with enable_sequential_cpu_offload(device='tpu')"
            )
            continue
        group_check = getattr(pipe, "_maybe_raise_error_if_group_offload_active", None)  # absent before 0.33
        grouped = bool(group_check(raise_error=False, module=module)) if group_check else False
        if grouped:
            problems.append(
                f"{label} is group-offloaded and would stay on the host: reload it without enable_group_offload, "
                f"or group-offload it to the TPU with enable_group_offload(onload_device='tpu')"
            )
            continue
        meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.device.type == "meta"]
        if meta:
            more = f" and {len(meta) - 3} more" if len(meta) > 3 else ""
            problems.append(
                f"{label} has tensors on the meta device with no data ({', '.join(meta[:3])}{more}): load it "
                f"with all its weights (check the checkpoint and the from_pretrained warnings) before moving it"
            )
    return problems


def _to(original: Any) -> Any:
    @functools.wraps(original)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        target = is_tpu_target(args, kwargs)
        if target is None:
            return original(self, *args, **kwargs)
        from hf_tpu.diffusers._call_checks import install_call_checks
        from hf_tpu.diffusers._checks import check_components_on
        from hf_tpu.runtime import require_tpu

        require_tpu(f"{type(self).__name__}.to({str(target)!r})")
        problems = _component_problems(self)
        if problems:
            raise InvalidArgumentError(
                f"{type(self).__name__}.to({str(target)!r}) cannot place every component on the TPU: "
                + "; ".join(problems)
                + "."
            )
        result = original(self, *args, **kwargs)
        check_components_on(self, target)
        install_call_checks(self)
        return result

    to.__hf_tpu_original__ = original  # type: ignore[attr-defined]
    return to


def apply() -> None:
    """Wrap ``DiffusionPipeline.to`` and Modular Diffusers' ``ModularPipeline.to`` (idempotent; ``hf_tpu.disable()``
    restores upstream's)."""
    from diffusers import DiffusionPipeline

    owners = [DiffusionPipeline]
    try:
        from diffusers.modular_pipelines import ModularPipeline
    except ImportError:  # diffusers before Modular Diffusers
        pass
    else:
        owners.append(ModularPipeline)
    for owner in owners:
        current = owner.__dict__["to"]
        original = getattr(current, "__hf_tpu_original__", current)
        patch(owner, "to", _to(original), feature=FEATURE, package="diffusers", versions=_WRITTEN_FOR)
    from hf_tpu import _group_norm
    from hf_tpu.diffusers import minimax_h3_tp, qwen_image_layout

    qwen_image_layout.apply()  # Qwen-Image 2.1's joint sequence layout on the host: one graph per step
    minimax_h3_tp.apply()  # a tensor-parallel plan for MiniMax-H3, which diffusers 0.42 shards by context only
    _group_norm.apply(FEATURE)  # GroupNorm after an attention residual lowers in compiled graphs (VAE, UNet2DModel)
