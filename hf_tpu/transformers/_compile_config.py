"""``generate(compile_config=CompileConfig())`` on a TPU-placed model: refused before any work, with the fix.

``CompileConfig()``'s defaults are CUDA's: ``backend="inductor"``, ``mode="reduce-overhead"`` (CUDA graphs). On a
chip, torch_tpu's ``torch.compile`` refuses ``backend="inductor"`` for tpu inputs at the first compiled step, after
the prefill already ran; transformers itself compiles with torch_tpu's ``"tpu"`` backend when no ``compile_config``
is given (``PreTrainedModel._default_compile_config``). hf_tpu does not reroute such a config to ``"tpu"``: that
would honour neither its backend nor its mode, and the same code would then behave differently with and without
hf_tpu (torch_tpu raises). It raises at the start of ``generate`` instead, naming the one-line fix. A config with
``options={"tpu_backend": ...}`` (torch_tpu's own switch for running Inductor on TPU) or any other backend passes.
"""

from __future__ import annotations

from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = ["check_compile_config"]


def _compile_config(model: Any, arguments: dict, extra_kwargs: dict) -> tuple[Any, Any]:
    generation_config = arguments.get("generation_config") or getattr(model, "generation_config", None)
    config = extra_kwargs.get("compile_config")
    if config is None:
        config = getattr(generation_config, "compile_config", None)
    return config, generation_config


def check_compile_config(model: Any, arguments: dict, extra_kwargs: dict) -> None:
    """Raise ValueError when ``generate`` on a tpu model is given an Inductor ``CompileConfig``."""
    device = getattr(model, "device", None)
    if device is None or device.type != "tpu":
        return
    config, generation_config = _compile_config(model, arguments, extra_kwargs)
    if config is None or getattr(config, "backend", None) != "inductor":
        return
    if extra_kwargs.get("disable_compile", getattr(generation_config, "disable_compile", False)):
        return
    if (getattr(config, "options", None) or {}).get("tpu_backend"):
        return
    raise InvalidArgumentError(
        f"generate(compile_config={config!r}) on a model on the tpu device: torch_tpu's torch.compile refuses "
        "backend='inductor' for tpu tensors (it would fail at the first compiled step), and mode='reduce-overhead' "
        "(CUDA graphs) has no TPU meaning. Pass CompileConfig(backend='tpu', dynamic=False, mode='default'), or leave "
        "compile_config out: transformers then compiles with torch_tpu's 'tpu' backend. (torch_tpu runs Inductor on "
        "TPU only when asked explicitly: options={'tpu_backend': 'pallas'}.)"
    )
