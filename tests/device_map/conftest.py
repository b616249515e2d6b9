"""Tiny models saved to disk for the device_map tests, the simulated TPU, and the integration switched on."""

from __future__ import annotations

import pytest
import torch
from devmap_helpers import save_tiny_llama

import hf_tpu


@pytest.fixture(scope="session")
def tied_path(tmp_path_factory):
    """A tiny Llama whose LM head is tied to the input embedding, saved as safetensors."""
    return save_tiny_llama(tmp_path_factory.mktemp("tied_llama"), tied=True)


@pytest.fixture(scope="session")
def untied_path(tmp_path_factory):
    """A tiny Llama with its own LM head."""
    return save_tiny_llama(tmp_path_factory.mktemp("untied_llama"), tied=False)


@pytest.fixture
def sim():
    """The simulated TPU with its default HBM; tests that shrink HBM get it back afterwards."""
    import hf_tpu.sim

    hf_tpu.sim.enable()
    yield hf_tpu.sim
    hf_tpu.sim.enable()


@pytest.fixture
def device_map_on(sim):
    """The device_map integration applied for one test, reverted after it."""
    with hf_tpu.enabled("device_map"):
        yield


@pytest.fixture
def input_ids():
    return torch.tensor([[1, 5, 9, 14, 33, 60, 7]])
