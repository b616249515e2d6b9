"""``hf-tpu diffuse`` on the simulated device: the PNG equals the CPU pipeline's image; bad input exits 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers_helpers import PROMPT, load
from PIL import Image

from hf_tpu.cli.main import main


@pytest.mark.parametrize("kind", ["sd3"])
def test_diffuse_writes_the_cpu_image(sim, model_dirs, tmp_path, capsys, kind):
    torch._dynamo.reset()
    out = tmp_path / "image.png"
    argv = ["diffuse", model_dirs[kind], "--prompt", PROMPT, "--out", str(out), "--steps", "2"]
    argv += ["--height", "32", "--width", "48", "--seed", "3", "--dtype", "float32", "--json", "--simulate"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["device"] == "tpu:0" and summary["compiled"] is True and summary["graphs_compiled"] == 1
    assert (summary["height"], summary["width"]) == (32, 48)

    pipe = load(model_dirs, kind)
    ref = pipe(PROMPT, height=32, width=48, num_inference_steps=2, generator=torch.Generator().manual_seed(3))
    got = np.asarray(Image.open(out), dtype=np.int16)
    assert got.shape == (32, 48, 3)
    assert np.abs(got - np.asarray(ref.images[0], dtype=np.int16)).max() <= 1


def test_diffuse_bad_size(sim, model_dirs, tmp_path, capsys):
    out = tmp_path / "image.png"
    argv = ["diffuse", model_dirs["sd"], "--prompt", "x", "--out", str(out), "--height", "36", "--simulate"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    # issue 36: one order for sizes, the one of the success line ("wrote ...: 128x36 (width x height)")
    assert "cannot make a 128x36 (width x height) image: height=36 is not a multiple of 8" in err
    assert "nearest valid sizes (width x height): 128x32, 128x40" in err
    assert not out.exists()


def test_diffuse_not_a_pipeline_dir(sim, tmp_path, capsys):
    argv = ["diffuse", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "i.png"), "--simulate"]
    assert main(argv) == 2
    assert "no model_index.json" in capsys.readouterr().err


def test_diffuse_without_a_model_runs_the_tiny_pipeline(sim, tmp_path, capsys):
    """A fresh install has no pipeline on disk: the default is hf_tpu's tiny SD3, and its PNG is the CPU image."""
    from hf_tpu.diffusers.testing import tiny_sd3_pipeline

    torch._dynamo.reset()
    out = tmp_path / "img.png"
    assert main(["diffuse", "--simulate", "--prompt", "a lighthouse", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["pipeline"] == "StableDiffusion3Pipeline" and summary["device"] == "tpu:0"
    assert (summary["height"], summary["width"], summary["steps"], summary["seed"]) == (32, 32, 4, 0)
    assert "no MODEL_DIR given: using hf_tpu's tiny SD3 pipeline" in captured.err
    assert "[transformers]" not in captured.err  # the demo's own tokenizer/processor warnings are quiet

    ref = tiny_sd3_pipeline(seed=0)("a lighthouse", height=32, width=32, num_inference_steps=4,
                                    generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    got = np.asarray(Image.open(out), dtype=np.int16)
    assert got.shape == (32, 32, 3)
    assert np.abs(got - np.asarray(ref, dtype=np.int16)).max() <= 1


def test_diffuse_model_flag_is_the_positional(sim, tmp_path, capsys):
    """``--model DIR`` (the spelling of examples/diffusers_sd3.py) is MODEL_DIR; two different ones are refused."""
    argv = ["diffuse", "--model", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "i.png"), "--simulate"]
    assert main(argv) == 2
    assert f"{str(tmp_path)!r} is not a saved diffusers pipeline (no model_index.json" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "other")]) == 2
    assert "two models given" in capsys.readouterr().err
