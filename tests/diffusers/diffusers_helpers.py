"""Helpers shared by the diffusers tests: load a saved tiny pipeline, run it at a size with a seeded CPU generator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

PROMPT = "a photo of a squirrel eating a burger"


def load(model_dirs, kind: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dirs[kind])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, size: int | tuple[int, int] = 32, seed: int = 0, **kwargs) -> np.ndarray:
    height, width = (size, size) if isinstance(size, int) else size
    kwargs.setdefault("prompt", PROMPT)
    kwargs.setdefault("num_inference_steps", 2)
    return pipe(
        height=height,
        width=width,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        **kwargs,
    ).images


def launch_tp_workers(worker: Path, tmp_path: Path, transformer, tp: int) -> Path:
    """Save ``transformer`` under ``tmp_path``, run ``worker`` on ``tp`` simulated chips through hf_tpu's launcher
    (``worker OUT_DIR TP TRANSFORMER_DIR``), check it exited cleanly with no rank left running, and return OUT_DIR."""
    from _timeouts import SAFETY_TIMEOUT_S

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from _launch_util import launch, processes_mentioning

    transformer.save_pretrained(tmp_path / "transformer")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, log, _ = launch(
        ["--simulate", f"--nproc_per_node={tp}", str(worker), str(out_dir), str(tp), str(tmp_path / "transformer")],
        timeout=SAFETY_TIMEOUT_S,
    )
    assert code == 0, log[-4000:]
    assert not processes_mentioning(str(out_dir)), "ranks left running after the launcher exited"
    return out_dir
