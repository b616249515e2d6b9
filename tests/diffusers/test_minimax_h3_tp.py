"""MiniMax-H3 at TP=4 through the launcher: the transformer sharded over 4 simulated chips by diffusers' own
TensorParallelConfig, with the tensor-parallel plan hf_tpu gives it (diffusers 0.42 declares none), makes the video
and audio of the unsharded modular pipeline on one simulated chip (TP=1) and of upstream's run on the CPU, identical
on every rank. The plan is there only while hf_tpu's diffusers integration is enabled."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _reference import without_hf_tpu
from diffusers_helpers import launch_tp_workers

import hf_tpu
from hf_tpu.diffusers.testing import tiny_minimax_h3_pipeline

WORKER = Path(__file__).with_name("_minimax_h3_tp_worker.py")
TP = 4


@pytest.mark.distributed
def test_minimax_h3_tp4_equals_tp1(tmp_path):
    pipe = tiny_minimax_h3_pipeline()  # the workers build the same pipeline from the same seed
    out_dir = launch_tp_workers(WORKER, tmp_path, pipe.transformer, TP)
    with without_hf_tpu():  # upstream code only, on the CPU (the worker's clip() arguments)
        out = pipe(
            prompt="a cat", height=16, width=16, num_frames=124, num_inference_steps=3,
            generator=torch.Generator("cpu").manual_seed(0), output_type="np", output=["videos", "audio"],
        )  # fmt: skip
    cpu = {"video": out["videos"], "audio": out["audio"].cpu().numpy()}
    clips, tp1 = [], np.load(out_dir / "rank0.npz")  # rank 0 made the TP=1 clip
    for rank in range(TP):
        info = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert info["world_size"] == TP and info["device"] == "tpu:0"
        # 4 heads x 16 = 64 rows of to_q, split by rows over the 4 ranks: one head each
        assert info["to_q"] == "DTensor" and info["placements"] == ["S(0)"] and info["local_shape"] == [16, 32]
        assert info["heads"] == 1
        assert info["ff_local_shape"] == [2 * 32 // TP, 32]  # its quarter of each SwiGLU half
        data = np.load(out_dir / f"rank{rank}.npz")
        for name in ("video", "audio"):
            np.testing.assert_allclose(data[name], tp1[f"{name}_tp1"], atol=1e-5)
            np.testing.assert_allclose(data[name], cpu[name], atol=1e-5)  # a bug shared by both runs cannot cancel
        clips.append(data)
    for other in clips[1:]:
        np.testing.assert_array_equal(clips[0]["video"], other["video"])
        np.testing.assert_array_equal(clips[0]["audio"], other["audio"])


def test_minimax_h3_tp_plan_only_while_enabled(monkeypatch):
    from diffusers import MiniMaxH3Transformer3DModel
    import diffusers.hooks
    from diffusers.hooks import tensor_parallel

    from hf_tpu.diffusers import minimax_h3_tp

    upstream_apply = tensor_parallel.apply_tensor_parallel
    was_enabled = hf_tpu.is_enabled("diffusers")
    hf_tpu.disable("diffusers")
    try:
        # diffusers 0.42.1 declares none; when a release does, hf_tpu's stands aside (below) and this module can go
        assert MiniMaxH3Transformer3DModel._tp_plan is None, "diffusers now declares a MiniMax-H3 _tp_plan"
        with hf_tpu.enabled("diffusers"):
            plan = MiniMaxH3Transformer3DModel._tp_plan
            assert plan.keys() == minimax_h3_tp.tp_plan().keys()
            assert plan["transformer_blocks.*.attn.to_q"] == "colwise"
            assert plan["token_refiner.refiner_blocks.*.ff.net.2"] == "rowwise"
            assert tensor_parallel.apply_tensor_parallel is not upstream_apply
            assert diffusers.hooks.apply_tensor_parallel is tensor_parallel.apply_tensor_parallel
        assert MiniMaxH3Transformer3DModel._tp_plan is None
        assert "_tp_plan" not in MiniMaxH3Transformer3DModel.__dict__
        assert tensor_parallel.apply_tensor_parallel is upstream_apply is diffusers.hooks.apply_tensor_parallel
        # a diffusers that declares its own plan keeps it
        own = {"transformer_blocks.*.attn.to_q": "colwise"}
        monkeypatch.setattr(MiniMaxH3Transformer3DModel, "_tp_plan", own, raising=False)
        with hf_tpu.enabled("diffusers"):
            assert MiniMaxH3Transformer3DModel._tp_plan is own
        assert MiniMaxH3Transformer3DModel._tp_plan is own
    finally:
        if was_enabled:
            hf_tpu.enable("diffusers")
