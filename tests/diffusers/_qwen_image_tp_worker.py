"""One rank of the Qwen-Image 2.1 tensor-parallel check, started by ``hf-tpu launch --simulate`` from
test_qwen_image_tp.

``python _qwen_image_tp_worker.py OUT_DIR TP_SIZE TRANSFORMER_DIR [--compile]``. Each rank builds the tiny
pipeline's other components (``tiny_qwen_image_pipeline()``, the same seed as the test), loads the transformer from
TRANSFORMER_DIR sharded through diffusers' own ``TensorParallelConfig(tp_degree=TP_SIZE)`` and makes an image on its
own ``tpu:0``; rank 0 also makes the same image with the whole pipeline on that chip (TP=1: one run is enough,
the test checks every rank's sharded image against it). With ``--compile`` it then compiles
the pipeline (``compile_pipeline(strict=True)``: one graph per step, no break) and makes it twice more, counting
compiles (about 40 s more for 4 ranks on a 2-core host, so the test runs without it). It writes the images and
what it saw to ``OUT_DIR/rank{RANK}.npz`` / ``.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel, TensorParallelConfig

import hf_tpu
import hf_tpu.sim
from hf_tpu.diffusers import compile_pipeline
from hf_tpu.diffusers.testing import tiny_qwen_image_pipeline

torch.set_num_threads(1)

out_dir, tp_size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
compile_too = "--compile" in sys.argv[4:]
rank = int(os.environ["RANK"])
torch.distributed.init_process_group("tpu_dist")  # diffusers does not start the process group itself


def image(pipe) -> np.ndarray:
    return pipe(
        "a red fox",
        height=32,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    ).images


images, compiles = {}, []
with hf_tpu.enabled("diffusers"):
    if rank == 0:
        images["tp1"] = image(tiny_qwen_image_pipeline().to("tpu"))
    transformer = QwenImage21Transformer2DModel.from_pretrained(
        path, parallel_config=TensorParallelConfig(tp_degree=tp_size)
    )
    components = {**tiny_qwen_image_pipeline().components, "transformer": transformer}
    pipe = QwenImage21Pipeline(**components).to("tpu")
    pipe.set_progress_bar_config(disable=True)
    images["sharded"] = image(pipe)
    if compile_too:
        compile_pipeline(pipe, strict=True)
        for name in ("compiled", "again"):
            with hf_tpu.sim.stats() as stats:
                images[name] = image(pipe)
            compiles.append(stats.compiles)

q = pipe.transformer.transformer_blocks[0].attn.to_q.weight
info = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "to_q": type(q).__name__,
    "placements": [str(p) for p in getattr(q, "placements", [])],
    "local_shape": list(q.to_local().shape) if hasattr(q, "to_local") else list(q.shape),
    "device": str(q.device),
    "compiles": compiles,
}
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **images)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(info, f)
torch.distributed.destroy_process_group()
import gc  # noqa: E402

gc.freeze()  # done: the exit does not walk this rank's objects (~1 CPU-s; see tests/distributed/_tp_worker.py)
