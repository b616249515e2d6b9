"""A fine-grained fp8 checkpoint (fp8 weights, float32 scales per 128x128 block, as DeepSeek-V3 and Qwen3-FP8 ship)
made here with transformers' own fp8 quantizer op, loaded on tpu: the weights stay fp8 in device memory and the
model generates equal to the CPU (where transformers dequantizes the same checkpoint to bf16)."""

from __future__ import annotations

import json
import types

import pytest
import torch
from conftest import make_prompts

import hf_tpu.sim


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from hf_tpu.testing import tiny_model

    path = tmp_path_factory.mktemp("fp8") / "llama"
    # every projection a whole number of 128x128 blocks (4 KV heads of 32)
    tiny_model("llama", path, hidden_size=128, intermediate_size=256, head_dim=32, num_key_value_heads=4,
               initializer_range=0.3)
    config = FineGrainedFP8Config(weight_block_size=[128, 128])
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    state = load_file(path / "model.safetensors")
    bf16_bytes = sum(t.nbytes for t in state.values())
    packed = {}
    for key, value in state.items():
        packed.update(quantize.convert({key: value}) if key.endswith("_proj.weight") else {key: value})
    save_file(packed, path / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((path / "config.json").read_text())
    meta["quantization_config"] = config.to_dict()
    (path / "config.json").write_text(json.dumps(meta))
    return path, bf16_bytes


def test_fine_grained_fp8_stays_fp8_on_tpu_and_generates_equal_to_cpu(fp8_checkpoint):
    from transformers import AutoModelForCausalLM

    path, bf16_bytes = fp8_checkpoint
    cpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert cpu.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # upstream on CPU: dequantized
    before = hf_tpu.sim.memory_allocated()
    tpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="tpu").eval()
    weights = hf_tpu.sim.memory_allocated() - before
    up = tpu.model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.float8_e4m3fn and up.weight.device.type == "tpu"
    assert up.weight_scale_inv.shape == (2, 1)
    assert weights <= 0.6 * bf16_bytes, (weights, bf16_bytes)  # 1 byte per weight, the embeddings in bf16

    ids, _ = make_prompts([10], seed=4)
    with torch.no_grad():
        torch.testing.assert_close(tpu(ids.to("tpu")).logits.cpu(), cpu(ids).logits, rtol=1e-2, atol=1e-2)
    got = tpu.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, cpu.generate(ids, max_new_tokens=6, do_sample=False))
