"""Tiny SD3 and SD pipelines saved once per session and loaded back through ``from_pretrained`` by each test."""

from __future__ import annotations

import pytest
from diffusers_helpers import load, run

from hf_tpu.diffusers.testing import tiny_sd3_pipeline, tiny_sd_pipeline


@pytest.fixture(scope="session")
def sim():
    import hf_tpu.sim

    hf_tpu.sim.enable()
    return hf_tpu.sim


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {"sd3": tiny_sd3_pipeline(root / "sd3"), "sd": tiny_sd_pipeline(root / "sd")}


@pytest.fixture
def load_pipe(model_dirs):
    return lambda kind: load(model_dirs, kind)


@pytest.fixture
def images():
    return run
