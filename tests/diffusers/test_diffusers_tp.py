"""Diffusers' TensorParallelConfig on the launcher: a Flux pipeline with its transformer sharded over 2 simulated
chips makes the same image as the unsharded one, and as the pipeline on the CPU without hf_tpu (upstream does the
sharding; hf_tpu provides the launcher, the simulated device and the tpu_dist collectives)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _reference import without_hf_tpu
from _timeouts import SAFETY_TIMEOUT_S

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _launch_util import launch, processes_mentioning

from hf_tpu.diffusers.testing import tiny_flux_pipeline

WORKER = Path(__file__).with_name("_flux_tp_worker.py")


@pytest.mark.distributed
def test_flux_tp2_image_equals_tp1(tmp_path):
    path = tiny_flux_pipeline(tmp_path / "flux")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, log, _ = launch(
        ["--simulate", "--nproc_per_node=2", str(WORKER), str(out_dir), "2", path], timeout=SAFETY_TIMEOUT_S
    )
    assert code == 0, log[-4000:]
    assert not processes_mentioning(str(out_dir)), "ranks left running after the launcher exited"
    with without_hf_tpu():  # the same image on the CPU, upstream code only (the worker's image() arguments)
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        cpu = pipe(
            "a photo of a squirrel", height=32, width=32, num_inference_steps=2, max_sequence_length=32,
            generator=torch.Generator("cpu").manual_seed(0), output_type="np",
        ).images  # fmt: skip
    images = []
    for rank in (0, 1):
        info = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert info["world_size"] == 2 and info["device"] == "tpu:0"
        # 2 heads x 16 = 32 rows of to_q, split by rows over the 2 ranks
        assert info["to_q"] == "DTensor" and info["placements"] == ["S(0)"] and info["local_shape"] == [16, 32]
        data = np.load(out_dir / f"rank{rank}.npz")
        np.testing.assert_allclose(data["sharded"], data["reference"], atol=1e-5)
        np.testing.assert_allclose(data["sharded"], cpu, atol=1e-5)  # a bug shared by both ranks' runs cannot cancel
        images.append(data["sharded"])
    np.testing.assert_array_equal(images[0], images[1])
