"""``torch.compile`` on the simulated device, as torch_tpu 0.2.0 patches it when it initialises a device.

torch_tpu's ``_loader._init_device_impl`` replaces ``torch.compile`` with ``_default_tpu_compile``: with no
``backend`` given, each graph goes through ``_default_backend_selector``, which picks the ``"tpu"`` backend when an
input is a ``tpu`` tensor and torch_tpu's default CPU backend (``_backend.get_default_cpu_backend``: ``"inductor"``,
or ``"aot_eager"`` without a C++ compiler) otherwise; with a TPU backend (``"tpu"``, the selector) and no
``dynamic`` given, ``dynamic=False``. It also wraps ``torch._TorchCompileInductorWrapper.__call__``: inductor on
graphs with ``tpu`` inputs raises ``_INDUCTOR_TPU_ERROR`` unless ``options={'tpu_backend': 'pallas'}``.

Without this, ``torch.compile(model)`` on the simulator would send ``tpu`` graphs to inductor, whose own Pallas code
generator for the device type ``tpu`` fails pages later with ``No module named 'jax'``. :func:`install` applies the
same rules (through :mod:`hf_tpu._patch`, so ``hf_tpu.disable()`` reverts them).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "INDUCTOR_TPU_ERROR",
    "default_backend_selector",
    "default_cpu_backend",
    "has_tpu_inputs",
    "install",
    "select_backend",
]

# torch_tpu 0.2.0's _loader._INDUCTOR_TPU_ERROR, word for word.
INDUCTOR_TPU_ERROR = (
    "torch.compile(..., backend='inductor') on TPU is experimental and does"
    " not yet have full TPU support; compilation is likely to fail with"
    " cryptic errors, e.g."
    " https://github.com/google-pytorch/torch_tpu/issues/4300. Pass"
    " backend='tpu' or do not specify `backend` in torch.compile to use"
    " TorchTPU, which does have full TPU support. If you do want to run"
    " Inductor on TPU, you can bypass this error by passing"
    " options={'tpu_backend': 'pallas'}."
)


def has_tpu_inputs(example_inputs: Any) -> bool:
    """True if any tensor in ``example_inputs`` (any pytree) is on a ``tpu`` device (``_loader._has_tpu_inputs``)."""
    if not hasattr(torch, "tpu"):
        return False
    flat, _ = pytree.tree_flatten(example_inputs)
    return any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in flat)


def default_cpu_backend() -> str:
    """torch_tpu's backend for CPU-only graphs: inductor, or aot_eager where inductor has no C++ compiler."""
    import torch._inductor.config

    return "aot_eager" if torch._inductor.config.cpp.cxx[0] is None else "inductor"


def select_backend(example_inputs: Any) -> str:
    """The name of the backend a graph with these inputs gets when none is given (``_get_default_backend_impl``)."""
    return "tpu" if has_tpu_inputs(example_inputs) else default_cpu_backend()


def default_backend_selector(graph_module: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """The backend ``torch.compile`` gets when none is given: ``"tpu"`` for graphs with tpu inputs."""
    from torch._dynamo.backends import registry

    return registry.lookup_backend(select_backend(example_inputs))(graph_module, example_inputs, **kwargs)


def _is_tpu_backend(backend: Any) -> bool:
    from hf_tpu.sim._backend import tpu_backend

    return backend == "tpu" or backend is default_backend_selector or backend is tpu_backend


def _compile(original: Any) -> Any:
    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") is None:
            kwargs["backend"] = default_backend_selector
        if "dynamic" not in kwargs and _is_tpu_backend(kwargs["backend"]):
            kwargs["dynamic"] = False
        return original(*args, **kwargs)

    compile._hf_tpu_sim = True  # type: ignore[attr-defined]
    return compile


def _inductor_call(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self: Any, model_: Any, inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        if (getattr(self, "config", None) or {}).get("tpu_backend") != "pallas" and has_tpu_inputs(inputs_):
            raise RuntimeError(INDUCTOR_TPU_ERROR)
        return original(self, model_, inputs_, *args, **kwargs)

    __call__._hf_tpu_sim = True  # type: ignore[attr-defined]
    return __call__


def install() -> None:
    """Patch ``torch.compile`` and the inductor wrapper as torch_tpu does on a TPU host (idempotent, reversible)."""
    from hf_tpu._patch import patch

    if not getattr(torch.compile, "_hf_tpu_sim", False):
        patch(torch, "compile", _compile(torch.compile), feature="sim", package="torch", versions=">=2.11,<=2.15")
    wrapper = torch._TorchCompileInductorWrapper
    if not getattr(wrapper.__call__, "_hf_tpu_sim", False):
        patch(
            wrapper,
            "__call__",
            _inductor_call(wrapper.__call__),
            feature="sim",
            package="torch",
            versions=">=2.11,<=2.15",
        )
