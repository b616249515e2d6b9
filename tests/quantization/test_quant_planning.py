"""``device_map="auto"`` and the fit check count quantized bytes: on a simulated chip too small for the bf16 model
and large enough for int8, the int8 model lands whole on the chip and the bf16 one is offloaded, sizes named."""

from __future__ import annotations

import gc

import pytest
from conftest import load

import hf_tpu.sim
from hf_tpu.device_map import DeviceMapFitError


@pytest.fixture
def small_chip(loaded):
    """Free HBM below the bf16 model's weight bytes and well above int8's (measured on the tpu in this session):
    loading quantizes one weight at a time on the device, from its bf16 copy, so the chip needs some room above
    the int8 bytes while loading."""
    bf16, int8 = loaded("bf16").weights, loaded("int8").weights
    free = int(0.9 * bf16)
    hf_tpu.sim.enable(hbm=hf_tpu.sim.memory_allocated() + free)
    yield bf16, int8, free
    hf_tpu.sim.enable()


def test_auto_puts_the_whole_int8_model_on_a_chip_too_small_for_bf16(small_chip, checkpoint):
    bf16, int8, free = small_chip
    quant = load("int8", checkpoint, device_map="auto")
    assert getattr(quant.model, "hf_device_map", {"": "tpu:0"}) == {"": "tpu:0"}
    assert {str(p.device) for p in quant.model.parameters()} == {"tpu:0"}
    assert quant.weights == int8 < free

    del quant
    gc.collect()

    unquantized = load("bf16", checkpoint, device_map="auto")
    assert set(unquantized.model.hf_device_map.values()) == {"tpu:0", "cpu"}  # offloaded: bf16 does not fit
    with pytest.raises(DeviceMapFitError, match=r"device_map='tpu' puts .* on tpu:0.* free"):
        load("bf16", checkpoint, device_map="tpu")
