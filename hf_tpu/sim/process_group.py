"""The ``tpu_dist`` process-group backend of the simulated device: collectives over the CPU buffers, gloo underneath.

The simulator's side of ``torch.distributed``, as torch_tpu's own ``tpu_dist`` is the chip's. Code outside the
simulator (``hf-tpu launch``'s ranks, the tensor-parallel plan) reaches it through
:func:`hf_tpu.runtime.simulated_distributed` (:class:`hf_tpu.sim.DistributedSide`), never by importing the
simulator.

On a real TPU, torch_tpu registers ``tpu_dist`` for the ``tpu`` device. On the simulator every rank is its own
process with its own simulated ``tpu:0`` whose tensors keep their data in CPU memory; this backend runs each
collective with gloo on CPU views of those buffers (:func:`hf_tpu.sim.host_view`), so results land in place,
with no host<->device copy counted, and ``torch.distributed``, DeviceMesh, DTensor and transformers' tensor
parallel code run unchanged. Collectives are synchronous (the returned work is already complete).

Example:
    >>> from hf_tpu.sim import process_group
    >>> process_group.register()        # done by `hf-tpu launch --simulate` in every rank   # doctest: +SKIP
    >>> torch.distributed.init_process_group("tpu_dist")                                      # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    _create_work_from_future,
)

__all__ = ["BACKEND_NAME", "SimulatedTPUProcessGroup", "is_registered", "register"]

BACKEND_NAME = "tpu_dist"
_LOCK = threading.Lock()


def _host_view_default(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    from hf_tpu.sim._tensors import host_view

    return host_view(t)


class _Staged:
    """CPU views of the given tensors; a non-contiguous view is staged through a contiguous copy and copied back."""

    def __init__(self, to_host: Callable[[torch.Tensor], torch.Tensor]):
        self._to_host = to_host
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, t: torch.Tensor, *, output: bool = False) -> torch.Tensor:
        view = self._to_host(t)
        if view.is_contiguous():
            return view
        staged = view.contiguous()
        if output:
            self._copy_back.append((view, staged))
        return staged

    def finish(self) -> None:
        for view, staged in self._copy_back:
            view.copy_(staged)


def _done(result: Any = None):
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class SimulatedTPUProcessGroup(dist.ProcessGroup):
    """A process group for the simulated ``tpu`` device: each collective runs on gloo over CPU views, in place."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: timedelta,
        group_name: str = "",
        to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._name = group_name
        self._to_host = to_host or _host_view_default
        self._gloo = ProcessGroupGloo(PrefixStore("hf_tpu_sim_gloo", store), rank, size, timeout)

    # -- identity -------------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._name

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"SimulatedTPUProcessGroup(rank={self._rank}, size={self._size}, name={self._name!r})"

    # -- helpers --------------------------------------------------------------------------------------------------
    def _run(self, fn: Callable[[_Staged], Any], result: Any = None):
        """Run ``fn`` on staged CPU views; the returned work's future holds ``result``: the output tensors, as
        c10d's own backends return them (DistributedDataParallel's reducer reads its gradients back from there)."""
        stage = _Staged(self._to_host)
        work = fn(stage)
        if work is not None:
            work.wait()
        stage.finish()
        return _done(result)

    @staticmethod
    def _avg(opts) -> tuple[Any, bool]:
        """gloo has no AVG: run SUM and divide afterwards (torch_tpu's ``tpu_dist`` runs AVG as a sum too). PREMUL_SUM
        is refused with the chip's own message: torch-tpu 0.2.0's ``ProcessGroupTpu`` has no pre-multiplied sum
        (FSDP2 asks for one after ``set_gradient_divide_factor`` with a factor other than the world size)."""
        if opts.reduceOp == ReduceOp.PREMUL_SUM:
            raise RuntimeError(
                "BuildReduceBody: 'premul_sum' reduction is not supported (torch_tpu's tpu_dist has no PREMUL_SUM; "
                "with FSDP2 leave the gradient divide factor at the world size, or scale the loss instead)"
            )
        if opts.reduceOp == ReduceOp.AVG:
            new = type(opts)()
            for attr in ("rootRank", "rootTensor", "timeout"):
                if hasattr(opts, attr):
                    setattr(new, attr, getattr(opts, attr))
            new.reduceOp = ReduceOp.SUM
            return new, True
        return opts, False

    # -- collectives ----------------------------------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor], opts=None):
        if isinstance(opts, ReduceOp) or (opts is not None and not hasattr(opts, "reduceOp")):
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        opts, average = self._avg(opts or AllreduceOptions())

        def go(stage: _Staged):
            views = [stage(t, output=True) for t in tensors]
            self._gloo.allreduce(views, opts).wait()
            if average:
                for v in views:
                    v.div_(self._size)

        return self._run(go, list(tensors))

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts=None):
        for t in tensors:
            o = AllreduceOptions()
            o.reduceOp = (opts or AllreduceCoalescedOptions()).reduceOp
            self.allreduce([t], o)
        return _done(list(tensors))

    def broadcast(self, tensors: Sequence[torch.Tensor], opts=None):
        opts = opts or BroadcastOptions()
        return self._run(lambda s: self._gloo.broadcast([s(t, output=True) for t in tensors], opts), list(tensors))

    def reduce(self, tensors: Sequence[torch.Tensor], opts=None):
        opts, average = self._avg(opts or ReduceOptions())

        def go(stage: _Staged):
            views = [stage(t, output=True) for t in tensors]
            self._gloo.reduce(views, opts).wait()
            if average and self._rank == opts.rootRank:
                for v in views:
                    v.div_(self._size)

        return self._run(go, list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or AllgatherOptions()
        return self._run(
            lambda s: self._gloo.allgather(
                [[s(t, output=True) for t in outs] for outs in output_tensors], [s(t) for t in input_tensors], opts
            ),
            [list(outs) for outs in output_tensors],
        )

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        opts = opts or AllgatherOptions()
        return self._run(
            lambda s: self._gloo._allgather_base(s(output_tensor, output=True), s(input_tensor), opts), [output_tensor]
        )

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts=None):
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            self.all_gather_single(out, inp, opts)
        return _done(list(output_tensors))

    def all_gather_single_coalesced(self, output_tensors, input_tensors, opts=None):
        return self.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        for outs, inp in zip(output_lists, input_list, strict=True):
            self.allgather([outs], [inp], opts)
        return _done([list(outs) for outs in output_lists])

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts, average = self._avg(opts or ReduceScatterOptions())

        def go(stage: _Staged):
            outs = [stage(t, output=True) for t in output_tensors]
            self._gloo.reduce_scatter(outs, [[stage(t) for t in lst] for lst in input_lists], opts).wait()
            if average:
                for v in outs:
                    v.div_(self._size)

        return self._run(go, list(output_tensors))

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        opts, average = self._avg(opts or ReduceScatterOptions())

        def go(stage: _Staged):
            out = stage(output_tensor, output=True)
            self._gloo._reduce_scatter_base(out, stage(input_tensor), opts).wait()
            if average:
                out.div_(self._size)

        return self._run(go, [output_tensor])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts=None):
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            self.reduce_scatter_single(out, inp, opts)
        return _done(list(output_tensors))

    def reduce_scatter_single_coalesced(self, output_tensors, input_tensors, opts=None):
        return self.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or AllToAllOptions()
        return self._run(
            lambda s: self._gloo.alltoall(
                [s(t, output=True) for t in output_tensors], [s(t) for t in input_tensors], opts
            ),
            list(output_tensors),
        )

    def all_to_all_single(self, output_tensor, input_tensor, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or AllToAllOptions()
        return self._run(
            lambda s: self._gloo.alltoall_base(
                s(output_tensor, output=True),
                s(input_tensor),
                list(output_split_sizes or []),
                list(input_split_sizes or []),
                opts,
            ),
            [output_tensor],
        )

    alltoall_base = all_to_all_single

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        return self._run(
            lambda s: self._gloo.gather(
                [[s(t, output=True) for t in outs] for outs in output_tensors], [s(t) for t in input_tensors], opts
            ),
            [list(outs) for outs in output_tensors],
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or ScatterOptions()
        return self._run(
            lambda s: self._gloo.scatter(
                [s(t, output=True) for t in output_tensors], [[s(t) for t in lst] for lst in input_tensors], opts
            ),
            list(output_tensors),
        )

    def send(self, tensors, dst: int, tag: int = 0):
        return self._run(lambda s: self._gloo.send([s(t) for t in tensors], dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return self._run(lambda s: self._gloo.recv([s(t, output=True) for t in tensors], src, tag), list(tensors))

    def barrier(self, opts=None):
        return self._run(lambda s: self._gloo.barrier(opts or BarrierOptions()))


def _create(dist_opts, backend_options=None) -> SimulatedTPUProcessGroup:
    return SimulatedTPUProcessGroup(
        dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout, dist_opts.group_id
    )


def is_registered(name: str = BACKEND_NAME) -> bool:
    """Whether a process-group backend of this name is registered with ``torch.distributed`` (by anyone).

    Args:
        name: the backend's name; ``"tpu_dist"`` (:data:`BACKEND_NAME`) by default.

    Returns:
        True when ``torch.distributed`` knows the backend.
    """
    return name.upper() in dist.Backend._plugins


def register(name: str = BACKEND_NAME, devices: Sequence[str] = ("tpu",)) -> None:
    """Register the simulated ``tpu_dist`` backend for ``devices`` (idempotent). Call it before
    ``init_process_group``; ``hf-tpu launch --simulate`` does it in every rank.

    Never call it in a process that uses real torch_tpu: there ``tpu_dist`` is torch_tpu's own backend.

    Args:
        name: the backend's name; ``"tpu_dist"`` (:data:`BACKEND_NAME`) by default.
        devices: the device types it serves (each but ``"cpu"`` gets it as its default backend); ``("tpu",)``.

    Raises:
        RuntimeError: another library (torch_tpu) registered a backend of that name already.
    """
    with _LOCK:
        if is_registered(name):
            plugin = dist.Backend._plugins[name.upper()]
            if plugin.creator_fn is _create:
                return
            raise RuntimeError(
                f"the {name!r} process-group backend is already registered by another library "
                f"({getattr(plugin.creator_fn, '__module__', plugin.creator_fn)}); the simulated one is only for "
                "processes without real TPU chips (torch_tpu's own backend is in use here)."
            )
        dist.Backend.register_backend(name, _create, extended_api=True, devices=list(devices))
        for device in devices:
            if device != "cpu":
                dist.Backend.default_device_backend_map[device] = name

