"""Run by ``hf-tpu launch --simulate --nproc_per_node=4`` from tests/distributed: tensor parallelism over one
dimension of a 2-D mesh.

``python _tp_mesh_worker.py OUT_DIR MODEL_DIR``. Each rank builds the ``(dp_shard=2, tp=2)`` mesh a FSDP x TP
training script builds, loads the model with ``from_pretrained(..., tp_plan="auto", device_mesh=mesh["tp"])``, runs
a forward, and writes what it saw (mesh, shard shapes, plan fixes, logits) to ``OUT_DIR/rank{RANK}.json``; it also
records the errors for a ``tp_size`` that disagrees with the mesh, a 2-D mesh without a ``tp`` dimension, and
``DistributedConfig(tp_size=2)`` alone on 4 ranks.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import hf_tpu

torch.set_num_threads(1)
hf_tpu.enable()

from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from hf_tpu.distributed.tp_plan import TensorParallelConfigError

out_dir, path = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
result: dict = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "errors": {}}


def error_of(fn) -> str:
    try:
        fn()
    except TensorParallelConfigError as err:
        return str(err)
    return "no error"


try:
    dist.init_process_group("tpu_dist")
    mesh = torch.distributed.init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh["tp"])
    gate = model.model.layers[0].mlp.gate_proj.weight
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 23, 77, 3, 41]]).to("tpu")).logits
    result.update(
        model_mesh=str(model._device_mesh),
        tp_ranks=mesh["tp"].mesh.tolist(),
        weight_mesh_ranks=gate.device_mesh.mesh.tolist(),
        gate_local_shape=list(gate.to_local().shape),
        gate_shape=list(gate.shape),
        tp_size=model.config.distributed_config.tp_size,
        fixes=[f.reason for f in getattr(model, "_hf_tpu_tp_fixes", [])],
        logits=logits.cpu().tolist(),
        logits_device=str(logits.device),
    )
    result["errors"]["tp_size_mismatch"] = error_of(
        lambda: AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", tp_size=4, device_mesh=mesh["tp"])
    )
    flat = torch.distributed.init_device_mesh("tpu", (2, 2), mesh_dim_names=("a", "b"))
    result["errors"]["no_tp_dim"] = error_of(
        lambda: AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=flat)
    )
    result["errors"]["config_alone"] = error_of(
        lambda: AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
    )
except Exception:  # noqa: BLE001 (any failure is reported to the test)
    result["error"] = traceback.format_exc()
finally:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
