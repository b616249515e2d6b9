"""FSDP2 on TPU processes: what of accelerate's FSDP plugin runs on the ``tpu`` mesh, and what is refused.

Sharded training is PyTorch's own ``fully_shard`` (FSDP2) over a ``DeviceMesh`` of ``tpu`` devices and the ``tpu_dist``
process group, wrapped the way accelerate wraps it (``fsdp2_prepare_model``: one FSDP unit per
``_no_split_modules`` layer, the embeddings and the head in their own units, bf16 parameters through a
``MixedPrecisionPolicy``). hf_tpu adds no sharding code: the ``training`` integration lets accelerate choose its FSDP
mode for launched TPU ranks (:mod:`hf_tpu.training._integration`), and :func:`check_fsdp_plugin` refuses the
settings that have no path on a TPU, with the fix, before anything is wrapped.

What the torch-tpu 0.2.0 wheel has for this (read from its sources): the ``tpu_dist`` backend (C++
``ProcessGroupTpu``: ``_allgather_base``, ``_reduce_scatter_base``, their ``_coalesced`` forms, ``allreduce``; ``AVG``
as a sum and a divide, ``PREMUL_SUM`` refused), ``torch.tpu.Stream``/``current_stream``/``stream``, which FSDP2 calls
through ``getattr(torch, "tpu")``, and ``torch.tpu.distributed.topology_aware_mesh`` (a rank layout for
``DeviceMesh("tpu", mesh=...)``). It has no FSDP code of its own.

Example (``hf-tpu launch --nproc_per_node=4 train.py``):
    >>> import hf_tpu; hf_tpu.enable()
    >>> args = TrainingArguments(..., fsdp="full_shard", fsdp_config={"fsdp_version": 2}, bf16=True)  # doctest: +SKIP
    >>> Trainer(model=model, args=args, ...).train()                                                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from hf_tpu.training.checks import TPUTrainingError

__all__ = ["check_fsdp_plugin", "local_state_bytes", "move_to_tpu"]


def check_fsdp_plugin(plugin: Any) -> None:
    """Raise :class:`~hf_tpu.training.TPUTrainingError` if accelerate's ``FullyShardedDataParallelPlugin`` asks for
    something that has no path on TPU processes; returns quietly otherwise.

    Refused, each with the fix: FSDP1 (``fsdp_version=1``: torch's ``FullyShardedDataParallel`` flat parameters, and the
    options only it has), CPU offload of parameters (``cpu_offload=True`` / ``CPUOffloadPolicy``: the optimizer step
    would run on the host and every step would copy the whole model both ways) and offload of activation checkpoints
    (``activation_checkpointing_offload``: a device-to-host copy per layer per step).

    Example:
        >>> from accelerate.utils import FullyShardedDataParallelPlugin          # doctest: +SKIP
        >>> check_fsdp_plugin(FullyShardedDataParallelPlugin(fsdp_version=2))    # doctest: +SKIP
    """
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise TPUTrainingError(
            f"FSDP version {version} was asked for on TPU processes; hf_tpu shards with FSDP2 (PyTorch's "
            "fully_shard over a tpu DeviceMesh) only. Use fsdp_config={'fsdp_version': 2} (Trainer) or "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (Accelerator); FSDP1-only options (sharding_strategy "
            "hybrid_shard/no_shard, backward/forward prefetch, use_orig_params, sync_module_states) have no FSDP2 "
            "equivalent: drop them."
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        raise TPUTrainingError(
            "FSDP CPU offload (fsdp_config={'cpu_offload': True} / CPUOffloadPolicy) was asked for on TPU "
            "processes: the sharded parameters and the optimizer step would live on the host and every step would "
            "copy the model to the chips and the gradients back, which hf_tpu does not do silently. Shard over more "
            "chips (hf-tpu launch --nproc_per_node=N, each chip then holds 1/N of parameters, gradients and "
            "optimizer state), use bf16=True, or train a LoRA adapter."
        )
    if getattr(plugin, "activation_checkpointing_offload", False):
        raise TPUTrainingError(
            "activation_checkpointing_offload=True copies every checkpointed activation to the host and back in each "
            "step; on TPU processes keep the checkpoints on the chips: set activation_checkpointing=True without "
            "the offload."
        )


def move_to_tpu(tensors: Any, device: Any) -> None:
    """Move each CPU parameter or buffer in ``tensors`` to the ``tpu`` ``device`` in place, keeping its identity
    (modules, tied weights and optimizers that hold it see the moved tensor).

    ``fully_shard`` moves a module's states with ``tensor.data = tensor.to(device)``, which torch refuses between a
    CPU tensor and a PrivateUse1 one ("incompatible tensor type": ``TensorImpl::has_compatible_shallow_copy_type``
    knows only the built-in dense backends, and torch-tpu 0.2.0 registers no ``_has_compatible_shallow_copy_type``
    kernel, checked in its dispatch table), so a model loaded on the host could not be sharded onto the chips. Here
    such a tensor is swapped with its moved copy (``torch.utils.swap_tensors``, what ``fully_shard`` already does for
    tensor subclasses); tensors already on the device, on ``meta`` or DTensors are left for upstream.
    """
    import torch
    from torch.distributed.tensor import DTensor

    for tensor in tensors:
        if tensor.device == device or tensor.device.type != "cpu" or isinstance(tensor, DTensor):
            continue
        with torch.no_grad():
            moved = tensor.to(device)
            if torch._has_compatible_shallow_copy_type(tensor, moved):
                tensor.data = moved
                continue
            if isinstance(tensor, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, moved)


def local_state_bytes(model: Any, optimizer: Any | None = None) -> dict[str, int]:
    """Device bytes this rank holds for ``model``'s parameters, their gradients and ``optimizer``'s state (the local
    shards of DTensors, the whole tensor otherwise): ``{"params", "grads", "optimizer", "total"}``.

    Example:
        >>> local_state_bytes(model, optimizer)["total"]   # doctest: +SKIP
    """

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(t: Any) -> int:
        t = local(t)
        return t.numel() * t.element_size() if getattr(t, "device", None) is not None and t.device.type != "cpu" else 0

    params = list(model.parameters())
    out = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(nbytes(v) for v in state.values() if hasattr(v, "numel"))
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
