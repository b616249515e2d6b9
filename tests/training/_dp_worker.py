"""One rank of the data-parallel training test, started by ``hf-tpu launch --simulate --nproc_per_node=N``.

``python _dp_worker.py OUT_DIR MODEL_DIR STEPS [MODES]``. Every rank loads the same model on its own ``tpu:0``, takes
its slice of each global batch and averages the gradients over the ``tpu_dist`` process group: with
``hf_tpu.training.data_parallel`` (``hf_tpu``, the default), inside ``backward`` with torch's
``DistributedDataParallel`` (``ddp``), or through ``transformers.Trainer`` with ``hf_tpu.enable()`` (``trainer``:
the Trainer initialises the process group and shards the batches itself). MODES ``hf_tpu,ddp`` runs both in one
launch, each with its own freshly loaded model over the one process group; ``trainer`` is always a launch of its own
(the Trainer must find no process group). It writes, per mode, the all-reduced loss of every step and a checksum of
its weights to ``OUT_DIR/rank{RANK}.json`` (``{"world_size": N, "modes": {MODE: {...}}}``); the test compares them
with one chip trained on the whole batch.
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
modes = (sys.argv[4] if len(sys.argv) > 4 else "hf_tpu").split(",")
rank = int(os.environ["RANK"])
result: dict = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "modes": {}}
try:
    from _dp_data import GLOBAL_BATCH, global_batches, train, trainer_losses
    from transformers import AutoModelForCausalLM

    import hf_tpu
    from hf_tpu.training import data_parallel as dp

    if "trainer" in modes and modes != ["trainer"]:
        raise ValueError("the Trainer initialises the process group: its mode runs in a launch of its own")
    for mode in modes:
        res = result["modes"][mode] = {}
        if mode == "trainer":  # the Trainer initialises the process group and shards the batches
            hf_tpu.enable()
            model = AutoModelForCausalLM.from_pretrained(model_dir).to("tpu")
            res["losses"] = trainer_losses(model, steps, result["world_size"], os.path.join(out_dir, "run"))
            res["local_rows"] = GLOBAL_BATCH // dist.get_world_size()
            res["backend"] = str(dist.get_backend())
        else:
            rank, world = dp.init()
            local = [dp.shard_batch(b, rank, world) for b in global_batches(steps)]
            res["local_rows"] = int(local[0]["input_ids"].shape[0])
            if mode == "ddp":
                model = AutoModelForCausalLM.from_pretrained(model_dir).to("tpu")
                model = torch.nn.parallel.DistributedDataParallel(model)
                res["losses"] = train(model, local, reduce=dp.all_reduce_mean)  # DDP averages the gradients itself
            else:
                model = dp.wrap(AutoModelForCausalLM.from_pretrained(model_dir).to("tpu"))
                res["losses"] = train(model, local, reduce=dp.all_reduce_mean, sync=dp.all_reduce_gradients)
        res["checksum"] = float(sum(p.detach().double().sum().cpu() for p in model.parameters()))
        res["device"] = str(next(model.parameters()).device)
    dist.destroy_process_group()
except Exception:  # noqa: BLE001 - reported to the test through the result file
    result["error"] = traceback.format_exc()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
import gc  # noqa: E402

gc.freeze()  # done: the exit does not walk this rank's objects (~1 CPU-s; see tests/distributed/_tp_worker.py)
