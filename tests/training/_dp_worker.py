"""One rank of the data-parallel training test, started by ``hf-tpu launch --simulate --nproc_per_node=N``.

``python _dp_worker.py OUT_DIR MODEL_DIR STEPS [hf_tpu|ddp]``. Every rank loads the same model on its own ``tpu:0``,
takes its slice of each global batch and averages the gradients over the ``tpu_dist`` process group: with
``hf_tpu.training.data_parallel`` (``hf_tpu``, the default) or inside ``backward`` with torch's
``DistributedDataParallel`` (``ddp``). It writes the all-reduced loss of every step and a checksum of its weights to
``OUT_DIR/rank{RANK}.json``; the test compares them with one chip trained on the whole batch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)
out_dir, model_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "hf_tpu"
rank = int(os.environ["RANK"])
result: dict = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"])}
try:
    from _dp_data import global_batches, train
    from transformers import AutoModelForCausalLM

    from hf_tpu.training import data_parallel as dp

    rank, world = dp.init()
    local = [dp.shard_batch(b, rank, world) for b in global_batches(steps)]
    result["local_rows"] = int(local[0]["input_ids"].shape[0])
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(AutoModelForCausalLM.from_pretrained(model_dir).to("tpu"))
        result["losses"] = train(model, local, reduce=dp.all_reduce_mean)  # DDP averages the gradients itself
    else:
        model = dp.wrap(AutoModelForCausalLM.from_pretrained(model_dir).to("tpu"))
        result["losses"] = train(model, local, reduce=dp.all_reduce_mean, sync=dp.all_reduce_gradients)
    result["checksum"] = float(sum(p.detach().double().sum().cpu() for p in model.parameters()))
    result["device"] = str(next(model.parameters()).device)
    dist.destroy_process_group()
except Exception:  # noqa: BLE001 - reported to the test through the result file
    result["error"] = traceback.format_exc()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
