"""Run by ``hf-tpu launch --simulate`` from tests/distributed: one rank of a tensor-parallel check.

``python _tp_worker.py OUT_DIR TP_SIZE MODEL_DIR...``. Each rank loads every model sharded with
``DistributedConfig(tp_size=TP_SIZE)`` on its own simulated ``tpu:0``, runs a forward and a greedy static-cache
generation, compares them with the TP=1 model's (computed once by the test on the simulated device, read from
``tp1_reference.pt`` in the models' folder), and writes what it saw to
``OUT_DIR/rank{RANK}.json``; the test asserts on those files. Extra checks named in ``HF_TPU_TP_CHECKS``
(comma-separated) exercise collectives, user plan overrides, the errors for impossible requests and (``mesh2d``, on
4 ranks) tensor parallelism over one dimension of a 2-D mesh: the ``(dp_shard=2, tp=2)`` mesh a FSDP x TP training
script builds, the first model loaded with ``from_pretrained(..., tp_plan="auto", device_mesh=mesh["tp"])``, and the
errors for a ``tp_size`` that disagrees with the mesh, a 2-D mesh without a ``tp`` dimension and
``DistributedConfig(tp_size=2)`` alone on 4 ranks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import hf_tpu

torch.set_num_threads(1)
hf_tpu.enable()  # every integration, as a user would: the plan checks and the generation path together

from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from hf_tpu.distributed.tp_plan import TensorParallelConfigError, set_kv_heads_strategy

# The imports' objects (some 430,000: torch, transformers, hf_tpu) live until the rank exits. Frozen, the collector's
# full passes during the compiles below no longer walk them each time (about 0.5 CPU-s a rank); see also the end.
gc.freeze()

out_dir, tp_size, model_dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
checks = [c for c in os.environ.get("HF_TPU_TP_CHECKS", "").split(",") if c]
rank = int(os.environ["RANK"])
result: dict = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "hbm": torch.tpu.get_device_properties().total_memory,
    "models": {},
    "checks": {},
}
ids = torch.tensor([[1, 5, 9, 23, 77, 3, 41]])


gen_kwargs = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
# model dir -> the TP=1 model's logits, greedy tokens and input embedding on a simulated tpu device, computed once by
# the test (tests/distributed/test_tensor_parallel.py: _tpu_reference) and saved next to the models
references: dict[str, dict] = torch.load(os.path.join(os.path.dirname(model_dirs[0]), "tp1_reference.pt"))


def reference(path: str) -> tuple:
    found = references[path]
    return found["logits"], found["tokens"], found["embedding"]


def run_model(path: str, **load_kwargs) -> dict:
    ref_logits, ref_tokens, ref_embedding = reference(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=tp_size, **load_kwargs)
    )
    x = ids.to("tpu")
    with torch.no_grad():
        logits = model(x).logits
    tokens = model.generate(x, **gen_kwargs)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    full_emb = emb.full_tensor() if hasattr(emb, "full_tensor") else emb
    placements = {
        name: [str(p) for p in param.placements]
        for name, param in model.named_parameters()
        if hasattr(param, "placements") and ".1." not in name  # one layer is enough
    }
    return {
        "model": os.path.basename(path),
        "logits": logits.cpu().tolist(),  # compared in the test with the model on the CPU without hf_tpu
        "logits_device": str(logits.device),
        "tokens_device": str(tokens.device),
        "max_abs_diff": (logits.cpu() - ref_logits).abs().max().item(),
        "tokens": tokens.cpu().tolist(),
        "ref_tokens": ref_tokens.tolist(),
        "tied": head is emb,
        "embedding_equal_ref": torch.equal(full_emb.cpu(), ref_embedding),
        "fixes": [f.kind for f in getattr(model, "_hf_tpu_tp_fixes", [])],
        "placements": placements,
    }


def mesh2d(path: str) -> dict:
    """The first model over the ``tp`` dimension of a ``(dp_shard=2, tp=2)`` mesh of the 4 ranks, and the errors of
    three requests that do not fit that mesh."""
    mesh = torch.distributed.init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh["tp"])
    gate = model.model.layers[0].mlp.gate_proj.weight
    with torch.no_grad():
        logits = model(ids.to("tpu")).logits
    flat = torch.distributed.init_device_mesh("tpu", (2, 2), mesh_dim_names=("a", "b"))
    return {
        "tp_ranks": mesh["tp"].mesh.tolist(),
        "weight_mesh_ranks": gate.device_mesh.mesh.tolist(),
        "gate_local_shape": list(gate.to_local().shape),
        "gate_shape": list(gate.shape),
        "tp_size": model.config.distributed_config.tp_size,
        "fixes": [f.reason for f in getattr(model, "_hf_tpu_tp_fixes", [])],
        "logits": logits.cpu().tolist(),
        "logits_device": str(logits.device),
        "errors": {
            "tp_size_mismatch": expect_error(
                lambda: AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", tp_size=4, device_mesh=mesh["tp"])
            ),
            "no_tp_dim": expect_error(
                lambda: AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=flat)
            ),
            "config_alone": expect_error(
                lambda: AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
            ),
        },
    }


def expect_error(fn) -> str:
    try:
        fn()
    except TensorParallelConfigError as err:
        return str(err)
    return "no error"


try:
    for path in model_dirs:
        result["models"][os.path.basename(path)] = run_model(path)
    if "collectives" in checks:  # the group transformers initialised
        x = torch.full((4,), float(rank + 1), device="tpu")
        dist.all_reduce(x)
        gathered = torch.empty(2 * dist.get_world_size(), device="tpu")
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device="tpu"))
        with hf_tpu.sim.stats() as s:
            y = torch.ones(3, device="tpu")
            dist.all_reduce(y)
        result["checks"]["collectives"] = {
            "all_reduce": x.cpu().tolist(),
            "all_gather": gathered.cpu().tolist(),
            "device": str(x.device),
            "copies": [s.h2d_copies, s.d2h_copies],
            "backend": dist.get_backend(),
        }
    if "repeat" in checks:  # the other strategy for KV heads that do not divide
        previous = set_kv_heads_strategy("repeat")
        result["checks"]["repeat"] = {os.path.basename(p): run_model(p) for p in model_dirs}
        set_kv_heads_strategy(previous)
    if "override" in checks:
        # A user rule merged over the model's plan and honoured: shard the input embedding on the hidden dim.
        path = model_dirs[0]
        result["checks"]["override"] = run_model(path, tp_plan={"model.embed_tokens": "embedding_colwise"})
    if "bad_override" in checks:
        path = model_dirs[0]
        result["checks"]["bad_override"] = expect_error(
            lambda: AutoModelForCausalLM.from_pretrained(
                path,
                distributed_config=DistributedConfig(
                    tp_size=tp_size, tp_plan={"model.layers.*.self_attn.k_proj": "colwise"}
                ),
            )
        )
    if "too_big" in checks:
        path = model_dirs[0]
        result["checks"]["too_big"] = expect_error(
            lambda: AutoModelForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(tp_size=2 * tp_size)
            )
        )
    if "mesh2d" in checks:  # after the models above: the process group is the one transformers initialised
        result["checks"]["mesh2d"] = mesh2d(model_dirs[0])
except Exception:  # noqa: BLE001 (any failure is reported to the test)
    result["error"] = traceback.format_exc()
finally:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    # The rank is done: frozen, what it built (models, compiled graphs) is not walked by the collections of the
    # interpreter's exit, about 1 CPU-s a rank of garbage collection whose memory the OS reclaims anyway. The exit
    # itself stays a script's usual one (atexit handlers, module teardown, the exit status the test checks).
    gc.freeze()
