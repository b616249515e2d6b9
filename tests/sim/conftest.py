"""Every test here runs with the simulated device enabled (default v6e limits restored after each test)."""

import pytest

import hf_tpu.sim


@pytest.fixture(autouse=True)
def _sim_enabled():
    hf_tpu.sim.enable()
    yield
    hf_tpu.sim.enable()
