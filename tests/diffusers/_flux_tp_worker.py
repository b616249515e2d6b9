"""One rank of the diffusers tensor-parallel check, started by ``hf-tpu launch --simulate`` from test_diffusers_tp.

``python _flux_tp_worker.py OUT_DIR TP_SIZE PIPELINE_DIR``. Each rank makes the same image twice on its own
``tpu:0``: with the whole pipeline on the device (TP=1), and with the Flux transformer loaded sharded through
diffusers' own ``TensorParallelConfig(tp_degree=TP_SIZE)``. It writes both images and what it saw of the shards
to ``OUT_DIR/rank{RANK}.npz`` / ``.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel, TensorParallelConfig

import hf_tpu

torch.set_num_threads(1)

out_dir, tp_size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
# diffusers (unlike transformers) does not start the process group itself.
torch.distributed.init_process_group("tpu_dist")


def image(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        "a photo of a squirrel",
        height=32,
        width=32,
        num_inference_steps=2,
        max_sequence_length=32,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    ).images


with hf_tpu.enabled("diffusers"):
    reference = image(FluxPipeline.from_pretrained(path).to("tpu"))
    transformer = FluxTransformer2DModel.from_pretrained(
        path, subfolder="transformer", parallel_config=TensorParallelConfig(tp_degree=tp_size)
    )
    pipe = FluxPipeline.from_pretrained(path, transformer=transformer).to("tpu")
    sharded = image(pipe)

q = pipe.transformer.transformer_blocks[0].attn.to_q.weight
info = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "to_q": type(q).__name__,
    "placements": [str(p) for p in getattr(q, "placements", [])],
    "local_shape": list(q.to_local().shape) if hasattr(q, "to_local") else list(q.shape),
    "device": str(q.device),
}
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), reference=reference, sharded=sharded)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(info, f)
torch.distributed.destroy_process_group()
import gc  # noqa: E402

gc.freeze()  # done: the exit does not walk this rank's objects (~1 CPU-s; see tests/distributed/_tp_worker.py)
