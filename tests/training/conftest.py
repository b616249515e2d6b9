"""Tiny causal LMs for the training tests: built from a config, saved to ``tmp_path``, loaded back on each device.

``hf_tpu.enable("training")`` is on for the whole session (one test turns it off to show the upstream gap).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_tpu
import hf_tpu.sim

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import tiny_config


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("train-models") / "llama"
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return path


@pytest.fixture
def load(model_dir):
    """``load(device)``: a fresh copy of the tiny model on ``device`` (through ``from_pretrained``)."""
    from transformers import AutoModelForCausalLM

    def _load(device: str = "cpu"):
        return AutoModelForCausalLM.from_pretrained(model_dir).to(device)

    return _load


@pytest.fixture(scope="module", autouse=True)
def _training_enabled():
    # Per module, and undone after it: a later test in the same worker must not inherit one CPU thread or the
    # training integration (dynamo's global-state guard of a graph saved to the compile cache records num_threads).
    hf_tpu.sim.enable()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with hf_tpu.enabled("training"):
            yield
    finally:
        torch.set_num_threads(threads)
