"""The lowering process's entry for a diffusers pipeline: the pipeline built from its saved configs with every model
component a deferred ``tpu`` tensor (``to_empty``: no weights read, no memory), compiled as
``hf_tpu.diffusers.compile_pipeline`` compiles it, and called once at one resolution, so that exactly the denoiser
graph a chip would compile per step goes through torch_tpu's lowering. Runs inside :mod:`hf_tpu.tpu_compile._child`
only; the text encoders, the scheduler's arithmetic and everything else outside the compiled graph are eager ops the
stand-in answers with shapes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hf_tpu.errors import HfTpuError

__all__ = ["build_deferred_pipeline", "lower_pipeline"]


class _StepDone(HfTpuError):
    """Raised by the scheduler's step, which the pipeline calls right after the denoiser: the step's graph is
    lowered by then, and the scheduler's own eager work (``nonzero`` to find the timestep's index, which the stand-in
    cannot answer without a chip) is not the program being planned."""


def _is_model(cls: type) -> bool:
    import torch

    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def build_deferred_pipeline(path: str, dtype):
    """The pipeline saved at ``path`` (``save_pretrained``'s layout: model_index.json and a folder per component)
    with its model components built from their configs on the meta device; the other components (tokenizers,
    schedulers, processors) loaded as they are (small files). Returns the pipeline and the model components."""
    import importlib

    import torch

    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    pipeline_cls = getattr(importlib.import_module("diffusers"), index["_class_name"])
    components: dict[str, Any] = {}
    models: dict[str, torch.nn.Module] = {}
    for name, spec in index.items():
        if name.startswith("_"):
            continue
        if not isinstance(spec, (list, tuple)) or spec[0] is None:
            components[name] = None
            continue
        library, class_name = spec
        cls = getattr(importlib.import_module(library), class_name)
        folder = os.path.join(path, name)
        if _is_model(cls):
            if library == "transformers":
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(folder)
                with torch.device("meta"):
                    module = cls._from_config(config, dtype=dtype)
            else:
                config = cls.load_config(folder)
                with torch.device("meta"):
                    module = cls.from_config(config).to(dtype)
            models[name] = module.eval()
            components[name] = models[name]
        else:
            components[name] = cls.from_pretrained(folder)
    return pipeline_cls(**components), models


def _bytes(module) -> int:
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def lower_pipeline(
    session,
    pipeline: str,
    height: int = 1024,
    width: int = 1024,
    batch: int = 1,
    guidance_scale: float | None = None,
    dtype: str = "bfloat16",
    capacity: int | None = None,
    max_sequence_length: int | None = None,
) -> dict[str, Any]:
    """Lower the denoiser step of the pipeline saved at ``pipeline`` for one ``height`` x ``width`` call of ``batch``
    images (``guidance_scale``: the pipeline's default when None; above 1 doubles the denoiser's batch where the
    pipeline uses classifier-free guidance). Returns labels and facts for the plan; lowers nothing when the weights
    alone exceed ``capacity``."""
    import inspect

    import torch

    from hf_tpu._patch import enable
    from hf_tpu.diffusers._checks import denoisers
    from hf_tpu.diffusers.compile import compile_pipeline

    torch_dtype = getattr(torch, dtype)
    pipe, models = build_deferred_pipeline(pipeline, torch_dtype)
    names = [name for name, _ in denoisers(pipe)]
    info: dict[str, Any] = {
        "model_type": type(pipe).__name__,
        "parameters": sum(p.numel() for m in models.values() for p in m.parameters()),
        "dtype": dtype,
        "denoisers": names,
        "weights_bytes": sum(_bytes(m) for m in models.values()),
        "denoiser_bytes": sum(_bytes(models[n]) for n in names if n in models),
        "height": height,
        "width": width,
    }
    if capacity is not None and info["weights_bytes"] > capacity:
        info["skipped"] = "the pipeline's weights alone exceed the chip's HBM: nothing was lowered"
        return info
    enable()
    for name, module in models.items():
        models[name] = module.to_empty(device="tpu")
        setattr(pipe, name, models[name])
    pipe.register_modules(**models)
    # backend "tpu" as torch.compile resolves it: compile_pipeline's own check for a chip would refuse this host
    compile_pipeline(pipe, backend=torch._dynamo.lookup_backend("tpu"), cache_dir=None)
    params = set(inspect.signature(pipe.__call__).parameters)
    call: dict[str, Any] = {"height": height, "width": width, "num_inference_steps": 1, "output_type": "latent"}
    if "prompt" in params:
        call["prompt"] = ["a plan"] * batch
    if guidance_scale is not None and "guidance_scale" in params:
        call["guidance_scale"] = guidance_scale
    if max_sequence_length is not None and "max_sequence_length" in params:
        call["max_sequence_length"] = max_sequence_length
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "step"):

        def step(*args, **kwargs):
            raise _StepDone

        scheduler.step = step
    try:
        with session.mode, torch.no_grad():
            pipe(**call)
    except _StepDone:
        pass
    info["labels"] = [f"denoiser-{height}x{width}"] if len(names) == 1 else [f"{n}-{height}x{width}" for n in names]
    return info
