"""One rank of the FSDP2 tests, started by ``hf-tpu launch --simulate --nproc_per_node=N``.

``python _fsdp_worker.py OUT_DIR MODEL_DIR STEPS MODE``, MODE one of:

- ``trainer``: ``transformers.Trainer`` with ``fsdp="full_shard", fsdp_config={"fsdp_version": 2}`` on the model
  loaded on the host (accelerate wraps it with ``fully_shard`` over a ``tpu`` mesh);
- ``accelerate``: a plain loop with ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``.

It writes ``OUT_DIR/rank{RANK}.json``: the losses of every step, the counters after the first step, the memory record
and what the parameters became (DTensor, local shape, device).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)
out_dir, model_dir, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
result: dict = {"rank": rank, "world_size": world}
try:
    from _fsdp_data import FSDP, run_trainer
    from transformers import AutoModelForCausalLM

    import hf_tpu

    hf_tpu.enable()
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # on the host: fully_shard moves each unit's shard
    if mode == "trainer":
        trainer, run = run_trainer(model, steps, world, os.path.join(out_dir, "run"), **FSDP)
        result.update(run)
        result["distributed_type"] = str(trainer.accelerator.distributed_type)
        model = trainer.model
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    weight = next(p for n, p in model.named_parameters() if "layers.0" in n and p.ndim == 2)
    result["param_type"] = type(weight).__name__
    result["local_shape"] = list(weight.to_local().shape) if hasattr(weight, "to_local") else list(weight.shape)
    result["global_shape"] = list(weight.shape)
    result["device"] = str(weight.device)
    dist.destroy_process_group()
except Exception:  # noqa: BLE001 - reported to the test through the result file
    result["error"] = traceback.format_exc()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
