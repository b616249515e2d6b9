"""Qwen-Image 2.1 at TP=4 through the launcher: the transformer sharded over 4 simulated chips by diffusers' own
TensorParallelConfig (its _tp_plan) makes the image of the unsharded pipeline on one simulated chip (TP=1) and of
upstream's run on the CPU, identical on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _reference import without_hf_tpu
from diffusers_helpers import launch_tp_workers

from hf_tpu.diffusers.testing import tiny_qwen_image_pipeline

WORKER = Path(__file__).with_name("_qwen_image_tp_worker.py")
TP = 4


@pytest.mark.distributed
def test_qwen_image_21_tp4_equals_tp1(tmp_path):
    pipe = tiny_qwen_image_pipeline()  # the workers build the same pipeline from the same seed
    out_dir = launch_tp_workers(WORKER, tmp_path, pipe.transformer, TP)
    with without_hf_tpu():  # upstream code only, on the CPU (the worker's image() arguments)
        cpu = pipe(
            "a red fox", height=32, width=64, num_inference_steps=2,
            generator=torch.Generator("cpu").manual_seed(0), output_type="np",
        ).images  # fmt: skip
    images = []
    tp1 = np.load(out_dir / "rank0.npz")["tp1"]  # the unsharded pipeline on one chip: rank 0 makes it
    for rank in range(TP):
        info = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert info["world_size"] == TP and info["device"] == "tpu:0"
        # 4 heads x 16 = 64 rows of to_q, split by rows over the 4 ranks
        assert info["to_q"] == "DTensor" and info["placements"] == ["S(0)"] and info["local_shape"] == [16, 64]
        data = np.load(out_dir / f"rank{rank}.npz")
        np.testing.assert_allclose(data["sharded"], tp1, atol=1e-5)
        np.testing.assert_allclose(data["sharded"], cpu, atol=1e-5)  # a bug shared by both runs cannot cancel
        images.append(data["sharded"])
    for other in images[1:]:
        np.testing.assert_array_equal(images[0], other)
