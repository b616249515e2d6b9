"""Accelerate's own entry points on the simulated TPU: init_empty_weights, load_checkpoint_and_dispatch, dispatch_model."""

from __future__ import annotations

import pytest
import torch
from devmap_helpers import cpu_logits, tiny_llama_config


def _empty(tied: bool):
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(tiny_llama_config(tied))
    model.tie_weights()
    return model


def _logits(model, input_ids, device="tpu"):
    with torch.no_grad():
        return model(input_ids.to(device)).logits.cpu()


@pytest.mark.parametrize("max_memory", [None, {"tpu": "60KiB", "cpu": "1GiB"}])
def test_load_checkpoint_and_dispatch_auto(device_map_on, untied_path, input_ids, max_memory):
    from accelerate import load_checkpoint_and_dispatch

    model = _empty(tied=False)
    model = load_checkpoint_and_dispatch(
        model,
        str(untied_path / "model.safetensors"),
        device_map="auto",
        max_memory=max_memory,
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    expected = {"tpu:0"} if max_memory is None else {"tpu:0", "cpu"}
    assert set(model.hf_device_map.values()) == expected
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


def test_load_checkpoint_and_dispatch_with_integer_ids(device_map_on, untied_path, input_ids):
    from accelerate import load_checkpoint_and_dispatch

    model = load_checkpoint_and_dispatch(
        _empty(tied=False),
        str(untied_path / "model.safetensors"),
        device_map={"model": 0, "lm_head": "cpu"},
    )
    assert model.hf_device_map == {"model": "tpu:0", "lm_head": "cpu"}
    assert model.model.embed_tokens.weight.device.type == "tpu"
    torch.testing.assert_close(_logits(model, input_ids), cpu_logits(untied_path, input_ids))


class _TiedToy(torch.nn.Module):
    """A plain nn.Module (no transformers) whose output layer shares the embedding matrix."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_dispatch_model_on_one_tpu_keeps_ties(device_map_on):
    from accelerate import dispatch_model

    torch.manual_seed(0)
    model = _TiedToy()
    ids = torch.tensor([[1, 2, 3, 15]])
    with torch.no_grad():
        expected = model(ids)
    dispatch_model(model, device_map={"": 0})
    assert {p.device for p in model.parameters()} == {torch.device("tpu:0")}
    assert model.head.weight is model.emb.weight
    assert model.hf_device_map == {"": "tpu:0"}
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to("tpu")).cpu(), expected)


def test_init_on_device_creates_parameters_on_the_tpu(device_map_on):
    from accelerate import init_on_device

    with init_on_device(torch.device("tpu")):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "tpu"


def test_upstream_auto_places_on_the_cpu_with_a_tpu_device_present(sim, untied_path):
    """The README's "upstream" column (issue 36 asked whether it is right): with a ``tpu`` device registered
    (the simulator, as ``HF_TPU_SIMULATE=1`` gives) and hf_tpu's device_map integration off, upstream's
    ``device_map="auto"`` places the whole model on the CPU under accelerate 1.15: its ``get_max_memory`` asks npu,
    mlu, sdaa, musa, xpu, hpu and cuda for devices, never a PrivateUse1 device such as ``tpu``, so its budget is
    ``{"cpu": ...}``. accelerate 1.16 asks ``torch.accelerator`` (one device for a TPU process, its free memory from
    ``get_memory_info``) and places it on ``tpu:0`` itself. With the integration on, the same call lands on
    ``tpu:0`` either way."""
    import accelerate
    from accelerate.utils import get_max_memory
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    import hf_tpu

    asks_torch_accelerator = Version(Version(accelerate.__version__).base_version) >= Version("1.16")
    was_on = hf_tpu.is_enabled("device_map")
    hf_tpu.disable("device_map")
    try:
        assert set(get_max_memory()) == ({0, "cpu"} if asks_torch_accelerator else {"cpu"})
        upstream = AutoModelForCausalLM.from_pretrained(untied_path, device_map="auto")
    finally:
        if was_on:
            hf_tpu.enable("device_map")
    assert {str(p.device) for p in upstream.parameters()} == ({"tpu:0"} if asks_torch_accelerator else {"cpu"})
    with hf_tpu.enabled("device_map"):
        ours = AutoModelForCausalLM.from_pretrained(untied_path, device_map="auto")
    assert {str(p.device) for p in ours.parameters()} == {"tpu:0"}
