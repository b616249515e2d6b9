"""The planner on the simulated TPU: enumeration, max_memory, map normalisation (no weights involved)."""

from __future__ import annotations

import pytest
import torch
from devmap_helpers import tiny_llama_config

from hf_tpu.device_map import (
    get_max_memory,
    normalize_device,
    normalize_device_map,
    normalize_max_memory,
    placement_bytes,
    tpu_memory,
)


def test_free_memory_is_total_minus_live_bytes(sim):
    sim.enable(hbm=8 * 1024**2)
    before = tpu_memory(0)
    assert before.total == 8 * 1024**2 == torch.tpu.get_device_properties().total_memory
    x = torch.zeros(1024, 256, device="tpu")  # 1 MiB
    after = tpu_memory(0)
    assert after.used - before.used == x.numel() * 4
    assert after.free == after.total - after.used == before.free - 1024**2
    del x


def test_get_max_memory_lists_the_tpu_first_with_its_free_hbm(device_map_on, sim):
    sim.enable(hbm=64 * 1024**2)
    import accelerate.utils
    import transformers.integrations.accelerate as tf_acc

    mm = accelerate.utils.get_max_memory()
    assert list(mm) == [0, "cpu"]
    assert mm[0] == tpu_memory(0).free == 64 * 1024**2 - sim.memory_allocated()
    assert list(tf_acc.get_max_memory()) == [0, "cpu"]


def test_max_memory_keys_users_write_on_tpu(sim):
    expected = {0: 2 * 1024**3, "cpu": 8 * 1024**3}
    assert normalize_max_memory({"tpu": "2GiB", "cpu": "8GiB"}) == expected
    assert normalize_max_memory({"cpu": "8GiB", "tpu:0": "2GiB"}) == expected
    assert normalize_max_memory({torch.device("tpu", 0): 2 * 1024**3, "cpu": "8GiB"}) == expected
    assert get_max_memory({0: "2GiB", "cpu": "8GiB", "disk": "100GiB"}) == {**expected, "disk": 100 * 1024**3}
    with pytest.raises(ValueError, match=r"tpu:3.*sees 1 TPU device"):
        normalize_max_memory({"tpu:3": "1GiB"})
    with pytest.raises(ValueError, match=r"not devices.*'tpu'"):
        normalize_max_memory({"gpu": "1GiB"})


def test_device_map_values_become_tpu_strings(sim):
    assert normalize_device(0) == "tpu:0"
    assert normalize_device("tpu") == normalize_device(torch.device("tpu")) == "tpu:0"
    assert normalize_device(torch.device("cpu")) == "cpu"
    assert normalize_device_map({"a": 0, "b": "cpu", "c": "disk", "d": torch.device("tpu:0")}) == {
        "a": "tpu:0",
        "b": "cpu",
        "c": "disk",
        "d": "tpu:0",
    }
    with pytest.raises(ValueError, match=r"'tpu:1'.*one chip, seen as tpu:0"):
        normalize_device("tpu:1")


def _empty_model(tied: bool):
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        return LlamaForCausalLM(tiny_llama_config(tied))


def test_accelerate_infer_auto_device_map_plans_tpu_then_cpu(device_map_on):
    from accelerate import infer_auto_device_map

    model = _empty_model(tied=False)
    assert all(p.device.type == "meta" for p in model.parameters())
    sizes = placement_bytes(model, {"": "x"})["x"]
    whole = infer_auto_device_map(model, max_memory={"tpu": sizes * 2, "cpu": sizes * 2})
    assert set(whole.values()) == {"tpu:0"}
    split = infer_auto_device_map(
        model, max_memory={"tpu": sizes // 2, "cpu": sizes * 2}, no_split_module_classes=["LlamaDecoderLayer"]
    )
    assert set(split.values()) == {"tpu:0", "cpu"}
    on_tpu = placement_bytes(model, split)["tpu:0"]
    assert 0 < on_tpu <= sizes // 2


def test_without_hf_tpu_the_planner_ignores_the_tpu(sim):
    from accelerate import infer_auto_device_map

    model = _empty_model(tied=False)
    plan = infer_auto_device_map(model, max_memory={"cpu": "1GiB"})
    assert set(plan.values()) == {"cpu"}


def test_auto_keeps_a_tenth_of_the_tpu_for_activations(device_map_on, sim):
    import transformers.integrations.accelerate as tf_acc

    sim.enable(hbm=sim.memory_allocated() + 10 * 1024**2)
    budget = tf_acc.get_balanced_memory(_empty_model(tied=False), max_memory=None)
    assert budget[0] == pytest.approx(0.9 * tpu_memory(0).free)


def test_real_mode_reads_free_hbm_through_torch_accelerator(monkeypatch):
    """The real-torch_tpu branch against 0.2.0's surface: the total from torch.tpu.get_device_properties (public),
    what is in use from torch.accelerator.get_memory_info (torch_tpu's TpuAllocator::getMemoryInfo), else
    torch.accelerator.memory_allocated; torch.tpu has no memory_allocated in 0.2.0."""
    import types

    from hf_tpu import runtime
    from hf_tpu.device_map import devices

    GiB = 1024**3
    info = runtime.RuntimeInfo("real", 1, 4, 16 * GiB, "v5e", "0.2.0", None, "test")
    monkeypatch.setattr(runtime, "detect", lambda: info)
    props = types.SimpleNamespace(total_memory=16 * GiB, name="TPU v5e")
    monkeypatch.setattr(
        torch, "tpu", types.SimpleNamespace(get_device_properties=lambda index=None: props), raising=False
    )
    asked = []

    def get_memory_info(index=None, /):
        asked.append(index)
        return 11 * GiB, 15 * GiB  # another process (or the runtime) holds 5 GiB of the chip

    monkeypatch.setattr(torch.accelerator, "get_memory_info", get_memory_info)
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda index=None, /: 1 * GiB)
    assert devices.tpu_memory(0) == devices.TPUMemory(0, 16 * GiB, 5 * GiB) and asked == [0]
    assert devices.tpu_memory(0).free == 11 * GiB

    def unsupported(index=None, /):
        raise RuntimeError("PrivateUse1 does not support getMemoryInfo")

    monkeypatch.setattr(torch.accelerator, "get_memory_info", unsupported)
    assert devices.tpu_memory(0).used == 1 * GiB  # this process's own allocations

    monkeypatch.setattr(torch.accelerator, "memory_allocated", unsupported)
    with pytest.warns(RuntimeWarning, match=r"cannot read how much HBM is in use on tpu:0.*max_memory"):
        assert devices.tpu_memory(0).used == 0
    with pytest.raises(ValueError, match="one chip"):
        devices.tpu_memory(1)


def test_fit_check_is_skipped_for_sharded_loading(device_map_on, sim):
    """Under tensor parallelism each process holds a slice: the whole-model HBM check must not refuse it."""
    import transformers.modeling_utils as tf_modeling

    from hf_tpu.device_map import DeviceMapFitError
    from hf_tpu.device_map._integration import _LOAD

    sim.enable(hbm=sim.memory_allocated() + 1024)
    model = _empty_model(tied=False)
    with pytest.raises(DeviceMapFitError, match="on tpu:0"):
        tf_modeling._get_device_map(model, {"": "tpu:0"}, None, None)
    token = _LOAD.set({"distributed": True})
    try:
        assert tf_modeling._get_device_map(model, {"": "tpu:0"}, None, None) == {"": "tpu:0"}
    finally:
        _LOAD.reset(token)
