"""One rank of the FSDP2 tests, started by ``hf-tpu launch --simulate --nproc_per_node=N``.

``python _fsdp_worker.py OUT_DIR MODEL_DIR STEPS MODE [MODEL_DIR STEPS MODE ...]``: one job per triple, run in order
in this one process, so that one launch serves several tests (a rank's start, with ``import hf_tpu``,
``hf_tpu.enable()``, torch, transformers and accelerate, costs more CPU than a tiny model's few steps). MODE is one of:

- ``trainer``: ``transformers.Trainer`` with ``fsdp="full_shard", fsdp_config={"fsdp_version": 2}`` on the model
  loaded on the host (accelerate wraps it with ``fully_shard`` over a ``tpu`` mesh);
- ``accelerate``: a plain loop with ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``;
- ``bf16``: the Trainer with ``bf16=True`` and FSDP's activation checkpointing; records the dtype of a layer's
  weight inside its forward (FSDP's all-gathered parameter) and of the sharded parameter the optimizer updates;
- ``offload``: the Trainer with ``fsdp_config={"cpu_offload": True}``, which hf_tpu refuses (the error is the result);
- ``save``: the Trainer with ``state_dict_type="SHARDED_STATE_DICT"``, a ``torch.distributed.checkpoint`` checkpoint
  every ``STEPS // 2`` steps in its folder's ``run``; the trained weights (each DTensor's ``full_tensor()``) go to
  its ``weights.pt``;
- ``resume``: the same run resumed from ``OUT_DIR/save-MODEL/run/checkpoint-{STEPS // 2}`` (the ``save`` job of an
  earlier launch into the same OUT_DIR, on however many ranks that one had), then exported with
  ``accelerator.get_state_dict`` + ``save_pretrained`` to its folder's ``export``.

Each job writes, in its folder ``OUT_DIR/MODE-MODEL`` (MODEL: the model folder's name), ``rank{RANK}.json``: the
losses of every step, the counters after the first step, the memory record and what the parameters became (DTensor,
local shape, device). A job starts as in a fresh process: on an empty device (a job that finds bytes an earlier one
left fails: its memory figures would not be its own), with the peak-memory counter reset and accelerate's state
dropped (each job's Trainer or Accelerator sets its own mixed precision and plugin); the process group the first job
made serves the later ones. A job that checks that nothing compiles after its first step goes first in its launch
(the simulator remembers the shape signatures a process has seen: an earlier job's could hide a new one). A failed
job ends the rank's jobs (the later ones are reported as not run): its peers then fail at their next collective.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)
out_root, jobs = sys.argv[1], sys.argv[2:]
if not jobs or len(jobs) % 3:
    raise SystemExit("usage: _fsdp_worker.py OUT_DIR MODEL_DIR STEPS MODE [MODEL_DIR STEPS MODE ...]")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run_job(out_dir: str, model_dir: str, steps: int, mode: str, result: dict) -> None:
    """Run one job, filling ``result``; what it put on the device is freed with its locals when it returns."""
    from _fsdp_data import FSDP, accelerate_loop, run_trainer
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    AcceleratorState._reset_state(True)
    left = torch.accelerator.memory_allocated()
    if left:
        raise RuntimeError(f"an earlier job of this launch left {left} bytes on the device")
    torch.accelerator.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # on the host: fully_shard moves each unit's shard
    if mode == "trainer":
        trainer, run = run_trainer(model, steps, world, os.path.join(out_dir, "run"), **FSDP)
        result.update(run)
        result["distributed_type"] = str(trainer.accelerator.distributed_type)
        model = trainer.model
    elif mode == "bf16":
        seen: list = []
        layer = model.model.layers[0].mlp.down_proj
        layer.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
        ac = {**FSDP, "fsdp_config": {**FSDP["fsdp_config"], "activation_checkpointing": True}}
        trainer, run = run_trainer(model, steps, world, os.path.join(out_dir, "run"), bf16=True, **ac)
        result.update(run)
        result["gathered_dtypes"] = sorted(set(seen))
        result["sharded_dtype"] = str(layer.weight.dtype)
        result["checkpointed"] = type(trainer.model.model.layers[0]).__name__
        model = trainer.model
    elif mode == "offload":
        offload = {**FSDP, "fsdp_config": {**FSDP["fsdp_config"], "cpu_offload": True}}
        try:
            run_trainer(model, steps, world, os.path.join(out_dir, "run"), **offload)
        except Exception as e:  # noqa: BLE001 - the refusal is what the test checks
            result["refused"] = f"{type(e).__name__}: {e}"
        return
    elif mode == "accelerate":
        result["memory"] = {}
        result["losses"] = accelerate_loop(model, steps, memory=result["memory"])
    elif mode in ("save", "resume"):
        sharded = {**FSDP, "fsdp_config": {**FSDP["fsdp_config"], "state_dict_type": "SHARDED_STATE_DICT"}}
        ckpt = os.path.join(out_root, f"save-{os.path.basename(model_dir)}", "run", f"checkpoint-{steps // 2}")
        trainer, run = run_trainer(
            model, steps, world, os.path.join(out_dir, "run"), save_strategy="steps", save_steps=steps // 2,
            resume_from_checkpoint=ckpt if mode == "resume" else None, **sharded,
        )  # fmt: skip
        result.update(run)
        model = trainer.model
        weights = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}  # a gather per parameter
        if mode == "resume":
            export = os.path.join(out_dir, "export")
            state_dict = trainer.accelerator.get_state_dict(model)  # gathered to rank 0's host, piece by piece
            if trainer.accelerator.is_main_process:
                trainer.accelerator.unwrap_model(model).save_pretrained(export, state_dict=state_dict)
        if rank == 0:
            torch.save(weights, os.path.join(out_dir, "weights.pt"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    weight = next(p for n, p in model.named_parameters() if "layers.0" in n and p.ndim == 2)
    result["param_type"] = type(weight).__name__
    result["local_shape"] = list(weight.to_local().shape) if hasattr(weight, "to_local") else list(weight.shape)
    result["global_shape"] = list(weight.shape)
    result["device"] = str(weight.device)


failed = None
for i in range(0, len(jobs), 3):
    model_dir, steps, mode = jobs[i], int(jobs[i + 1]), jobs[i + 2]
    out_dir = os.path.join(out_root, f"{mode}-{os.path.basename(model_dir)}")
    os.makedirs(out_dir, exist_ok=True)
    result: dict = {"rank": rank, "world_size": world}
    if failed:
        result["error"] = f"not run: the job {failed!r} of this launch failed before it"
    else:
        try:
            if i == 0:
                import hf_tpu

                hf_tpu.enable()
            run_job(out_dir, model_dir, steps, mode, result)
        except Exception:  # noqa: BLE001 - reported to the test through the result file
            result["error"] = traceback.format_exc()
            failed = mode
        gc.collect()  # the job's model, optimizer and trainer (reference cycles) leave the device before the next
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
if dist.is_initialized():
    dist.destroy_process_group()
gc.freeze()  # done: the exit does not walk this rank's objects (~1 CPU-s; see tests/distributed/_tp_worker.py)
