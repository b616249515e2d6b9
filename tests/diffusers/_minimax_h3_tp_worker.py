"""One rank of the MiniMax-H3 tensor-parallel check, started by ``hf-tpu launch --simulate`` from
test_minimax_h3_tp.

``python _minimax_h3_tp_worker.py OUT_DIR TP_SIZE TRANSFORMER_DIR [--compile]``. Each rank builds the tiny
modular pipeline (``tiny_minimax_h3_pipeline()``, the same seed as the test); rank 0 makes a clip (video and audio)
with the whole pipeline on its own ``tpu:0`` (TP=1). Every rank then loads the transformer from TRANSFORMER_DIR
sharded through diffusers' own ``TensorParallelConfig(tp_degree=TP_SIZE)`` (the plan hf_tpu gives MiniMax-H3,
hf_tpu/diffusers/minimax_h3_tp.py), puts it in the pipeline and makes the same clip. With ``--compile`` it then
compiles the pipeline (``compile_pipeline(strict=True)``) and makes the clip twice more, counting compiles (about
25 s more for 4 ranks on a 2-core host, so the test runs without it). It writes the clips and what it saw to
``OUT_DIR/rank{RANK}.npz`` / ``.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from diffusers import MiniMaxH3Transformer3DModel, TensorParallelConfig

import hf_tpu
import hf_tpu.sim
from hf_tpu.diffusers import compile_pipeline
from hf_tpu.diffusers.testing import tiny_minimax_h3_pipeline

torch.set_num_threads(1)

out_dir, tp_size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
compile_too = "--compile" in sys.argv[4:]
rank = int(os.environ["RANK"])
torch.distributed.init_process_group("tpu_dist")  # diffusers does not start the process group itself


def clip(pipe) -> tuple[np.ndarray, np.ndarray]:
    out = pipe(
        prompt="a cat",
        height=16,
        width=16,
        num_frames=124,
        num_inference_steps=3,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        output=["videos", "audio"],
    )
    return out["videos"], out["audio"].cpu().numpy()


results, compiles = {}, []
with hf_tpu.enabled("diffusers"):
    pipe = tiny_minimax_h3_pipeline().to("tpu")
    if rank == 0:  # one TP=1 run is enough: the test checks every rank's sharded clip is the same
        results["video_tp1"], results["audio_tp1"] = clip(pipe)
    transformer = MiniMaxH3Transformer3DModel.from_pretrained(
        path, parallel_config=TensorParallelConfig(tp_degree=tp_size)
    )
    pipe.update_components(transformer=transformer)
    pipe.to("tpu")
    results["video"], results["audio"] = clip(pipe)
    if compile_too:
        compile_pipeline(pipe, strict=True)  # one graph per step kind, no break
        for name in ("compiled", "again"):
            with hf_tpu.sim.stats() as stats:
                results[f"video_{name}"], results[f"audio_{name}"] = clip(pipe)
            compiles.append(stats.compiles)

attn = pipe.transformer.transformer_blocks[0].attn
q, up = attn.to_q.weight, pipe.transformer.transformer_blocks[0].ff.net[0].proj.weight
info = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "to_q": type(q).__name__,
    "placements": [str(p) for p in getattr(q, "placements", [])],
    "local_shape": list(q.to_local().shape) if hasattr(q, "to_local") else list(q.shape),
    "ff_local_shape": list(up.to_local().shape) if hasattr(up, "to_local") else list(up.shape),
    "heads": attn.heads,
    "device": str(q.device),
    "compiles": compiles,
}
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(info, f)
torch.distributed.destroy_process_group()
import gc  # noqa: E402

gc.freeze()  # done: the exit does not walk this rank's objects (~1 CPU-s; see tests/distributed/_tp_worker.py)
