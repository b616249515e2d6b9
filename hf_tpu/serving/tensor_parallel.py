"""``hf-tpu serve --tp N``: one process per chip through hf_tpu's launcher; rank 0 serves HTTP, every rank steps.

transformers 5.24's continuous-batching manager is tensor-parallel aware: on a model loaded with
``DistributedConfig(tp_size=N)`` its TP driver (rank 0) owns the request queue and, at every loop iteration,
broadcasts new requests and cancellations to the other ranks (a CPU ``gloo`` group), so all ranks schedule and
step the same batches; the forward's collectives run on the ``tpu_dist`` group. hf_tpu uses that unchanged:

* :func:`launch` (``hf-tpu serve --tp N``) starts ``N`` ranks with :mod:`hf_tpu.distributed.launch` (torch_tpu's
  launch environment, or the simulated one with ``--simulate``), each running the ``hf-tpu serve`` command
  (:data:`RANK_COMMAND`) with the same serve arguments;
* rank 0 runs :func:`hf_tpu.serving.server.run_server` with the model loaded sharded (:func:`load_sharded`);
* every other rank (:func:`follow`) loads the same shards, creates the manager with the same settings, warms up
  the same step shapes (their forwards meet in the same collectives), starts it, and waits until rank 0 stops it.

Outputs equal TP=1: the sharded forward equals the unsharded one (tests/distributed), the scheduler's decisions
are the driver's. The step graphs are compiled per rank and not served from the persistent compile cache under
TP (see :mod:`hf_tpu.serving._step_graphs`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from hf_tpu import _env

__all__ = ["TP_ENV", "follow", "launch", "load_sharded", "valid_tp_sizes"]

#: The tensor-parallel size the launcher hands each rank.
TP_ENV = _env.SERVE_TP.name

#: What each rank runs, after these the serve arguments and ``--tp N``: the ``hf-tpu serve`` command
#: (``python -m hf_tpu.cli``), which with :data:`TP_ENV` set follows rank 0 or, on rank 0, serves HTTP. A command
#: line for the new processes, not an import: this room imports nothing from the CLI above it.
RANK_COMMAND = ("-m", "hf_tpu.cli", "serve")


def valid_tp_sizes(*, simulate: bool) -> tuple[int, ...]:
    """The ranks per host torch_tpu can lay out: on a chip, its generation's counts; simulated, any generation's
    (the launcher simulates one that has the count); ``()`` when neither (the launcher then says why it cannot
    start)."""
    from hf_tpu import _torch_tpu, runtime

    info = runtime.detect()
    if info.mode == "real" and info.generation:
        try:
            return _torch_tpu.valid_counts(info.generation)
        except KeyError:
            return ()
    if simulate or info.mode == "simulated":
        return tuple(sorted({n for g in _torch_tpu.generations() for n in _torch_tpu.valid_counts(g)}))
    return ()


def launch(serve_argv: Sequence[str], tp: int, *, simulate: bool) -> int:
    """Start ``tp`` ranks of ``hf-tpu serve`` (``serve_argv``: its arguments without ``--tp``); returns the launcher's
    exit status once every rank has ended."""
    from hf_tpu.distributed import launch as launcher

    os.environ[TP_ENV] = str(tp)
    argv = [*(["--simulate"] if simulate else []), f"--nproc_per_node={tp}", f"--master_port={launcher.free_port()}"]
    return launcher.main([*argv, *RANK_COMMAND, *serve_argv, "--tp", str(tp)])


def load_sharded(model: str, tp: int, *, dtype="auto", attn_implementation=None):
    """The causal LM at ``model`` sharded over the ``tp`` ranks of this launch (``DistributedConfig(tp_size=tp)``)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kwargs = {"dtype": dtype, "distributed_config": DistributedConfig(tp_size=tp)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(model, **kwargs).eval()


def follow(model_path: str, tp: int, *, warmup: bool = True, dtype="auto", attn_implementation=None) -> None:
    """A rank other than 0: step every batch the driver schedules, until the driver stops the manager."""
    from hf_tpu.serving import _runner

    model = load_sharded(model_path, tp, dtype=dtype, attn_implementation=attn_implementation)
    cb = model.init_continuous_batching(generation_config=copy.deepcopy(model.generation_config))
    if warmup:
        cb.warmup()
    else:
        cb.batch_processor = cb._create_batch_processor()
    cb.start()
    rank = os.environ.get("RANK", "?")
    _runner.logger.info("hf_tpu serve: rank %s of %d follows rank 0's batches", rank, tp)
    cb._generation_thread.join()
    cb.stop(block=True)
