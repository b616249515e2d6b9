"""The public ``torch.tpu`` submodules of torch-tpu 0.2.0 on the simulated device (``_internal/public_api.py``).

``torch.tpu.distributed``, ``torch.tpu.ops``, ``torch.tpu.compiler``, ``torch.tpu.pallas``, ``torch.tpu.optimizers``
and ``torch.tpu.profiler`` export the same names as the wheel's (tests/contract/test_simulator_vs_wheel.py compares
them with ``_PUBLIC_MODULES``). A name behaves as the wheel's where no chip is needed:

- ``distributed.set_tpu_launch_env``: the launch environment for simulated chips (hf_tpu's
  ``set_simulated_launch_env``: same variables, same rules; the simulated host has ``HF_TPU_SIM_DEVICES`` devices,
  4 by default), keeping torch's device-backend autoload on so that each rank's ``import torch`` enables its own
  simulated ``tpu:0`` through hf_tpu's entry point (``hf_tpu._autoload``) when torch-tpu is not installed;
  ``spmd_safe`` runs the function (the simulator runs collectives eagerly on every rank);
  ``topology_aware_mesh`` returns the ranks in row-major order (a simulated host has no physical layout);
- ``ops.ragged_dot`` (``torch.ops.tpu._ragged_dot``'s semantics: rows split into consecutive groups, each times its
  own matrix) with static shapes and no host sync, through ops torch_tpu has (searchsorted, index_select, bmm);
  ``ops.all_gather_dim`` / ``reduce_scatter_dim`` through torch's functional collectives; ``ops.max_pool{1,2,3}d``
  and their backward (maxima recomputed from the input) through torch's pooling; ``ops.optimization_barrier``
  is the identity;
- ``compiler.custom_compiler_options`` is a context manager that checks its argument (the simulator compiles
  nothing with XLA).

Every other name needs a chip (Pallas kernels, DMA windows, TPU embeddings, optimizers of the TPU runtime) and
raises :class:`NotImplementedError` naming it and the wheel's function.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hf_tpu import _env

__all__ = ["EXPORTS", "install"]

SIM_DEVICES_ENV = _env.SIM_DEVICES.name


def _needs_chip(public: str, target: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{public} is not available on the simulated tpu device: torch-tpu 0.2.0 runs it on a TPU chip "
            f"({target}). Run this code on a TPU VM, or keep it out of the simulated path."
        )

    refuse.__name__ = public.rpartition(".")[2]
    refuse.__qualname__ = refuse.__name__
    return refuse


# ---- torch.tpu.distributed ---------------------------------------------------------------------------------------


def simulated_host_devices() -> int:
    """Devices on the simulated host (``HF_TPU_SIM_DEVICES``, default 4): what torch_tpu counts on a real one."""
    return _env.SIM_DEVICES.get()  # (a value that is not a positive number raises, naming the variable)


def set_tpu_launch_env(*, nnodes: int | None = None, nproc_per_node: int | None = None) -> None:
    """torch_tpu's ``set_tpu_launch_env`` for simulated chips (see the module docstring)."""
    from hf_tpu import _torch_tpu
    from hf_tpu._launch_env import set_simulated_launch_env

    if _torch_tpu.installed_version() is None:
        # the ranks enable their simulated device through hf_tpu's autoload entry point at `import torch`
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    set_simulated_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node or simulated_host_devices())


def spmd_safe(func: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``func`` SPMD-safe (torch_tpu fuses its collectives with the surrounding ops); runs it unchanged."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


def topology_aware_mesh(
    mesh_shape: tuple[int, ...],
    *,
    dcn_mesh_shape: tuple[int, ...] | None = None,
    allow_split_physical_axes: bool = False,
    contiguous_submeshes: bool = False,
) -> torch.Tensor:
    """An int64 tensor of global ranks of shape ``mesh_shape`` (row-major on the simulated host)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    size = 1
    for n in mesh_shape:
        size *= int(n)
    if size != world:
        raise ValueError(f"topology_aware_mesh: the product of mesh_shape {tuple(mesh_shape)} is {size}, expected the "
                         f"world size {world}")  # fmt: skip
    if dcn_mesh_shape is not None and len(dcn_mesh_shape) != len(mesh_shape):
        raise ValueError("topology_aware_mesh: dcn_mesh_shape must have the same rank as mesh_shape")
    return torch.arange(world, dtype=torch.int64).reshape(tuple(mesh_shape))


class _DistributedModule(types.ModuleType):
    @property
    def window_num_stripes(self) -> int:
        raise RuntimeError("TorchTPU device ops backend is not initialized.")

    @window_num_stripes.setter
    def window_num_stripes(self, value: int) -> None:
        raise RuntimeError("TorchTPU device ops backend is not initialized.")

    @property
    def window_stripe_chunk_mb(self) -> int:
        raise RuntimeError("TorchTPU device ops backend is not initialized.")

    @window_stripe_chunk_mb.setter
    def window_stripe_chunk_mb(self, value: int) -> None:
        raise RuntimeError("TorchTPU device ops backend is not initialized.")


# ---- torch.tpu.ops -------------------------------------------------------------------------------------------------


def ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``result[start_i:end_i] = lhs[start_i:end_i] @ rhs[i]`` with groups of ``group_sizes[i]`` consecutive rows."""
    if lhs.dim() != 2 or rhs.dim() != 3 or group_sizes.dim() != 1 or rhs.size(0) != group_sizes.size(0):
        raise ValueError(
            f"ragged_dot: expected lhs (m, k), rhs (g, k, n) and group_sizes (g,), got {tuple(lhs.shape)}, "
            f"{tuple(rhs.shape)} and {tuple(group_sizes.shape)}"
        )
    # static shapes, no host sync (as torch_tpu's kernel): each row's group from the running group ends, rows past
    # the last group give zeros
    ends = torch.cumsum(group_sizes, 0)
    rows = torch.arange(lhs.size(0), device=lhs.device, dtype=ends.dtype)
    group = torch.searchsorted(ends, rows, right=True)
    inside = group < rhs.size(0)
    weights = rhs.index_select(0, group.clamp(max=rhs.size(0) - 1))  # (m, k, n)
    result = torch.bmm(lhs.unsqueeze(1), weights).squeeze(1)
    result = torch.where(inside.unsqueeze(1), result, torch.zeros((), dtype=result.dtype, device=result.device))
    if out is None:
        return result
    return out.copy_(result)


def _world(group: Any) -> Any:
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    if group is None:
        raise ValueError(
            "Default process group has not been initialized, please make sure to call init_process_group."
        )
    return group


def all_gather_dim(input: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:  # noqa: A002 -- the wheel's
    """Concatenate every rank's ``input`` along ``dim``."""
    from torch.distributed import _functional_collectives as funcol

    group = _world(group)
    return funcol.all_gather_tensor(input, dim % input.dim(), group)


def reduce_scatter_dim(
    input: torch.Tensor,  # noqa: A002 -- the wheel's name
    dim: int,
    group: Any = None,
    reduce_op: str = "sum",
) -> torch.Tensor:
    """Reduce ``input`` over the ranks and keep this rank's slice of ``dim``."""
    from torch.distributed import _functional_collectives as funcol

    group = _world(group)
    return funcol.reduce_scatter_tensor(input, reduce_op, dim % input.dim(), group)


def optimization_barrier(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The identity (an XLA scheduling barrier on a chip)."""
    return list(inputs)


def _pool(dims: int) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    pool = {1: torch.nn.functional.max_pool1d, 2: torch.nn.functional.max_pool2d, 3: torch.nn.functional.max_pool3d}[
        dims
    ]

    def forward(input, kernel_size, stride, padding, dilation, ceil_mode):  # noqa: A002 -- the wheel's names
        return pool(input, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode)

    def backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode):  # noqa: A002
        with torch.enable_grad():
            x = input.detach().requires_grad_()
            y = pool(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode)
            (grad,) = torch.autograd.grad(y, x, grad_output)
        return grad

    forward.__name__, backward.__name__ = f"max_pool{dims}d", f"max_pool{dims}d_backward"
    return forward, backward


max_pool1d, max_pool1d_backward = _pool(1)
max_pool2d, max_pool2d_backward = _pool(2)
max_pool3d, max_pool3d_backward = _pool(3)


# ---- torch.tpu.compiler ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def custom_compiler_options(options: dict[str, str]) -> Iterator[None]:
    """XLA compiler options for the ops materialized in the block (nothing to compile on the simulator)."""
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise TypeError(f"custom_compiler_options: expected a dict of str to str, got {options!r}")
    yield


# ---- the table ---------------------------------------------------------------------------------------------------

_HERE = sys.modules[__name__]
# public module -> name -> (the wheel's target, the simulator's object or None: needs a chip)
EXPORTS: dict[str, dict[str, tuple[str, Any]]] = {
    "torch.tpu.distributed": {
        "set_tpu_launch_env": ("distributed.distributed:set_tpu_launch_env", set_tpu_launch_env),
        "spmd_safe": ("distributed.spmd_util:spmd_safe", spmd_safe),
        "topology_aware_mesh": ("distributed._distributed_module:topology_aware_mesh", topology_aware_mesh),
        "window_num_stripes": ("distributed._distributed_module:DistributedModuleProperties", "property"),
        "window_stripe_chunk_mb": ("distributed._distributed_module:DistributedModuleProperties", "property"),
    },
    "torch.tpu.ops": {
        "align_jagged_to_multiple": ("ops.jagged:align_jagged_to_multiple", None),
        "all_gather_dim": ("ops.collectives:all_gather_dim", all_gather_dim),
        "max_pool1d": ("ops.ops:max_pool1d", max_pool1d),
        "max_pool1d_backward": ("ops.ops:max_pool1d_backward", max_pool1d_backward),
        "max_pool2d": ("ops.ops:max_pool2d", max_pool2d),
        "max_pool2d_backward": ("ops.ops:max_pool2d_backward", max_pool2d_backward),
        "max_pool3d": ("ops.ops:max_pool3d", max_pool3d),
        "max_pool3d_backward": ("ops.ops:max_pool3d_backward", max_pool3d_backward),
        "optimization_barrier": ("ops.ops:optimization_barrier", optimization_barrier),
        "ragged_all_to_all": ("ops.ops:ragged_all_to_all", None),
        "ragged_dot": ("ops.ops:ragged_dot", ragged_dot),
        "ragged_dot_weight_grad": ("ops.ops:ragged_dot_weight_grad", None),
        "recv": ("ops.ops:recv", None),
        "reduce_scatter_dim": ("ops.collectives:reduce_scatter_dim", reduce_scatter_dim),
        "send": ("ops.ops:send", None),
        **{
            name: (f"ops.ops:{name}", None)
            for name in (
                "sparse_dense_matmul", "sparse_dense_matmul_activation_unstack",
                "sparse_dense_matmul_grad_with_adagrad", "sparse_dense_matmul_grad_with_adam",
                "sparse_dense_matmul_grad_with_sgd", "sparse_dense_matmul_gradient_stack", "sparse_gather",
                "sparse_gather_backward", "sparse_iota", "sparse_map_row",
            )  # fmt: skip
        },
        "splash_sdpa": ("ops.splash_attention:splash_sdpa", None),
        "strip_jagged_padding": ("ops.jagged:strip_jagged_padding", None),
    },
    "torch.tpu.optimizers": {
        name: (f"optimizers.{mod}:{name}", None)
        for name, mod in (
            ("AdamW", "adamw"), ("Muon", "muon"), ("Optimizer", "optim"), ("Sgd", "sgd"),
            ("SingleTraceTrainer", "single_trace_trainer"),
        )  # fmt: skip
    },
    "torch.tpu.compiler": {
        "custom_compiler_options": ("compiler_options:custom_compiler_options", custom_compiler_options),
    },
    "torch.tpu.pallas": {
        "get_pallas_mesh": ("pallas.mesh:get_pallas_mesh", None),
        "jax_op": ("pallas.pallas:jax_op", None),
    },
    "torch.tpu.profiler": {
        "TpuProfilerConfig": ("profiler.profiler_config:TpuProfilerConfig", None),
    },
}

_MODULES: dict[str, types.ModuleType] = {}


def _build(name: str) -> types.ModuleType:
    module = (_DistributedModule if name == "torch.tpu.distributed" else types.ModuleType)(
        name, f"torch-tpu 0.2.0's `{name}` on the simulated tpu device (hf_tpu/sim/_public_api.py)."
    )
    names = []
    for attr, (target, obj) in EXPORTS[name].items():
        if obj == "property":
            names.append(attr)
            continue
        if obj is None:
            obj = _needs_chip(f"{name}.{attr}", f"torch_tpu._internal.{target}")
        setattr(module, attr, obj)
        names.append(attr)
    module.__all__ = sorted(names)
    return module


def install(device_module: types.ModuleType) -> None:
    """Attach the submodules to the simulated ``torch.tpu`` and register them in ``sys.modules`` (idempotent)."""
    for name in EXPORTS:
        module = _MODULES.get(name) or _MODULES.setdefault(name, _build(name))
        sys.modules[name] = module
        setattr(device_module, name.rpartition(".")[2], module)
