"""from_pretrained(device_map=...) on the simulated TPU: placement of every parameter and outputs equal to CPU."""

from __future__ import annotations

import pytest
import torch
from devmap_helpers import cpu_logits

from hf_tpu.device_map import DeviceMapFitError, placement_bytes


def _load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


def _devices(model) -> set[str]:
    return {str(t.device) for t in [*model.parameters(), *model.buffers()]}


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids.to(model.device)).logits.cpu()


@pytest.mark.parametrize("device_map", ["tpu", "tpu:0", 0, "torch.device", "auto", "balanced", "sequential"])
def test_model_that_fits_lands_whole_on_the_tpu(device_map_on, untied_path, input_ids, device_map):
    if device_map == "torch.device":
        device_map = torch.device("tpu")
    model = _load(untied_path, device_map=device_map)
    assert _devices(model) == {"tpu:0"}
    assert getattr(model, "hf_device_map", {"": "tpu:0"}) == {"": "tpu:0"}
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


def test_max_memory_in_tpu_terms_splits_with_cpu_offload(device_map_on, untied_path, input_ids):
    model = _load(untied_path, device_map="auto", max_memory={"tpu": "60KiB", "cpu": "1GiB"})
    assert set(model.hf_device_map.values()) == {"tpu:0", "cpu"}
    placed = placement_bytes(model, model.hf_device_map)
    assert 0 < placed["tpu:0"] <= 60 * 1024
    for name, param in model.named_parameters():
        assert param.device.type in ("tpu", "meta"), name  # cpu-offloaded weights wait on meta, moved in by hooks
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


def test_small_hbm_splits_auto_with_cpu_and_outputs_match(device_map_on, sim, untied_path, input_ids):
    sim.enable(hbm=sim.memory_allocated() + 80 * 1024)
    model = _load(untied_path, device_map="auto")
    assert set(model.hf_device_map.values()) == {"tpu:0", "cpu"}
    assert placement_bytes(model, model.hf_device_map)["tpu:0"] <= 80 * 1024
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


def test_disk_offload_with_offload_folder(device_map_on, untied_path, input_ids, tmp_path):
    model = _load(untied_path, device_map="auto", max_memory={"tpu": "50KiB", "cpu": "80KiB"}, offload_folder=tmp_path)
    assert set(model.hf_device_map.values()) == {"tpu:0", "cpu", "disk"}
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


def test_explicit_dict_with_tpu_cpu_and_disk(device_map_on, untied_path, input_ids, tmp_path):
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": "tpu:0",
        "model.layers.1": "cpu",
        "model.norm": "tpu",
        "model.rotary_emb": "tpu:0",
        "lm_head": "disk",
    }
    model = _load(untied_path, device_map=device_map, offload_folder=tmp_path)
    assert model.hf_device_map == {
        "model.embed_tokens": "tpu:0",
        "model.layers.0": "tpu:0",
        "model.layers.1": "cpu",
        "model.norm": "tpu:0",
        "model.rotary_emb": "tpu:0",
        "lm_head": "disk",
    }
    assert model.model.embed_tokens.weight.device.type == "tpu"
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if from_pretrained opens the checkpoint's tensors."""
    import transformers.modeling_utils as tf_modeling

    def refuse(*args, **kwargs):
        raise AssertionError("a weight file was opened before the device map was checked")

    monkeypatch.setattr(tf_modeling, "safe_open", refuse)


def test_auto_that_would_need_disk_without_offload_folder_fails_first(device_map_on, untied_path, no_weight_reads):
    with pytest.raises(DeviceMapFitError) as info:
        _load(untied_path, device_map="auto", max_memory={"tpu": "50KiB", "cpu": "80KiB"})
    message = str(info.value)
    assert "offload_folder" in message and "KiB" in message and "Nothing was loaded" in message
    assert "tpu:0: 50.00 KiB" in message and "cpu: 80.00 KiB" in message


def test_disk_limit_in_max_memory_is_honoured(device_map_on, untied_path, no_weight_reads):
    with pytest.raises(DeviceMapFitError, match=r"fits nowhere.*exceeds the disk limit 1.00 KiB"):
        _load(untied_path, device_map="auto", max_memory={"tpu": "50KiB", "cpu": "80KiB", "disk": "1KiB"})


def test_tpu_map_larger_than_hbm_fails_before_reading_weights(device_map_on, sim, untied_path, no_weight_reads):
    sim.enable(hbm=sim.memory_allocated() + 32 * 1024)
    with pytest.raises(DeviceMapFitError) as info:
        _load(untied_path, device_map="tpu")
    message = str(info.value)
    assert "device_map='tpu' puts" in message and "on tpu:0" in message
    assert "32.00 KiB free" in message and "device_map='auto'" in message


def test_tpu_index_this_process_does_not_have(device_map_on, untied_path, no_weight_reads):
    with pytest.raises(ValueError, match=r"'tpu:1'.*sees 1 TPU device"):
        _load(untied_path, device_map="tpu:1")


def test_tied_weights_stay_tied(device_map_on, tied_path, input_ids):
    model = _load(tied_path, device_map="tpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "tpu"
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(tied_path, input_ids))

    on_cpu = _load(tied_path)
    moved = on_cpu.to("tpu")
    assert moved.lm_head.weight is moved.model.embed_tokens.weight
    assert moved.lm_head.weight.device.type == "tpu"


def test_model_to_tpu_reties_even_when_torch_replaces_parameters(device_map_on, tied_path, input_ids):
    # With this flag torch builds a new Parameter per module on every move, which unties on any device; it is the
    # path a PrivateUse1 device takes by default (no shallow copy between CPU and tpu tensors).
    model = _load(tied_path)
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to("tpu")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(tied_path, input_ids))


def test_auto_split_keeps_tied_weights_on_one_device(device_map_on, tied_path, input_ids):
    from hf_tpu.device_map.preflight import _device_for

    model = _load(tied_path, device_map="auto", max_memory={"tpu": "60KiB", "cpu": "1GiB"})
    plan = model.hf_device_map
    assert set(plan.values()) == {"tpu:0", "cpu"}
    assert _device_for("lm_head.weight", plan) == _device_for("model.embed_tokens.weight", plan) == "tpu:0"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(tied_path, input_ids))


def test_auto_that_places_nothing_on_the_tpu_says_so(device_map_on, sim, untied_path, input_ids):
    sim.enable(hbm=sim.memory_allocated() + 1024)
    with pytest.warns(UserWarning, match=r"placed nothing on the TPU: tpu:0 has 1.00 KiB free"):
        model = _load(untied_path, device_map="auto")
    assert _devices(model) == {"cpu"}
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))
