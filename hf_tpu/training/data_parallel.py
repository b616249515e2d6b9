"""Data-parallel training on TPU: one process per chip (``hf-tpu launch``), gradients averaged over ``tpu_dist``.

Collectives run over the ``tpu_dist`` process group (torch_tpu's backend on a TPU VM, hf_tpu's stand-in on the
simulator). Each rank takes an equal slice of every global batch and the gradients are averaged in one flat
all-reduce per step, so with fixed-shape, equally filled slices the averaged loss and gradients are those of one chip
trained on the whole batch.

Example (``hf-tpu launch --nproc_per_node=4 train.py``):
    >>> from hf_tpu.training import data_parallel as dp
    >>> rank, world = dp.init()                                         # doctest: +SKIP
    >>> model = dp.wrap(AutoModelForCausalLM.from_pretrained(path).to("tpu"))   # doctest: +SKIP
    >>> for batch in loader:                                            # doctest: +SKIP
    ...     local = {k: v.to("tpu") for k, v in dp.shard_batch(batch, rank, world).items()}
    ...     model(**local).loss.backward(); dp.all_reduce_gradients(model); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = ["all_reduce_gradients", "all_reduce_mean", "init", "shard_batch", "wrap"]


def init(backend: str = "tpu_dist") -> tuple[int, int]:
    """Join the process group of this launch (once) and return ``(rank, world_size)``.

    Raises:
        hf_tpu.training.TPUTrainingError: the process was not started by a launcher (no ``RANK``/``WORLD_SIZE``).

    Example:
        >>> rank, world = init()   # doctest: +SKIP
    """
    import torch.distributed as dist

    from hf_tpu.runtime import require_tpu
    from hf_tpu.training.checks import TPUTrainingError

    require_tpu("data-parallel training")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise TPUTrainingError(
                "data-parallel training needs one process per TPU chip, but this process was not started by a "
                "launcher (RANK/WORLD_SIZE are not set). Run it with `hf-tpu launch --nproc_per_node=N script.py` "
                "(add --simulate without a TPU)."
            )
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def wrap(model: Any) -> Any:
    """Check that ``model`` can train data-parallel on the TPU and give every rank rank 0's weights; returns it.

    Call :func:`all_reduce_gradients` after each ``backward()``: one flat all-reduce per step. (torch's
    ``DistributedDataParallel`` over ``tpu_dist`` works too, and all-reduces bucket by bucket inside ``backward``.)

    Example:
        >>> model = wrap(model.to("tpu"))   # doctest: +SKIP
    """
    import torch.distributed as dist

    from hf_tpu.training.checks import TPUTrainingError, check_trainable

    if not dist.is_initialized():
        raise TPUTrainingError("call hf_tpu.training.data_parallel.init() (or init_process_group) before wrap()")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"tpu"}:
        raise TPUTrainingError(
            f"data-parallel training on TPU needs every parameter on the tpu device, found {sorted(devices)}: "
            "call model.to('tpu') before wrap()"
        )
    check_trainable(model)
    _coalesced(list(model.parameters()), lambda flat: dist.broadcast(flat, src=0), write_back=True)
    return model


def all_reduce_gradients(model: Any) -> None:
    """Average the gradients of ``model``'s parameters over all ranks, in one collective (call after
    ``backward()``, before clipping and ``optimizer.step()``).

    Example:
        >>> loss.backward(); all_reduce_gradients(model); optimizer.step()   # doctest: +SKIP
    """
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    world = dist.get_world_size()

    def reduce(flat):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world)

    _coalesced(grads, reduce, write_back=True)


def _coalesced(tensors: list, fn: Any, *, write_back: bool) -> None:
    """Run ``fn`` on one flat buffer per dtype holding ``tensors``, then copy the result back into them."""
    import torch

    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            fn(flat)
            if write_back:
                offset = 0
                for t in group:
                    n = t.numel()
                    t.detach().copy_(flat[offset : offset + n].view_as(t))
                    offset += n


def shard_batch(batch: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's equal slice of the rows of every tensor in ``batch`` (rows ``rank::world_size`` would reorder;
    this takes a contiguous block).

    Raises:
        ValueError: the batch does not divide evenly (uneven slices would change the averaged loss and the shapes).

    Example:
        >>> import torch
        >>> shard_batch({"input_ids": torch.arange(8).view(4, 2)}, 1, 2)["input_ids"].tolist()
        [[4, 5], [6, 7]]
    """
    out = {}
    for key, value in batch.items():
        rows = value.shape[0]
        if rows % world_size:
            raise InvalidArgumentError(
                f"a global batch of {rows} rows ({key!r}) does not split evenly over {world_size} ranks; use a "
                f"global batch size divisible by {world_size} (e.g. BucketingCollator(batch_size=...))"
            )
        per = rows // world_size
        out[key] = value[rank * per : (rank + 1) * per]
    return out


def all_reduce_mean(tensor: Any) -> Any:
    """The mean of ``tensor`` over all ranks (a new tensor; e.g. to log the global loss).

    Example:
        >>> global_loss = all_reduce_mean(loss.detach())   # doctest: +SKIP
    """
    import torch.distributed as dist

    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()
