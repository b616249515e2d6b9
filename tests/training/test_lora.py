"""LoRA fine-tuning with peft on the simulated tpu: adapters on the device, losses equal to CPU, saved as safetensors
and read back onto a TPU model (the ``peft`` integration: peft 0.22 reads an adapter straight onto ``tpu``, which
safetensors refuses)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import examples

import hf_tpu
from hf_tpu.training import BucketingCollator

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'hf-tpu[test]' or pip install peft)")


@pytest.fixture(scope="module", autouse=True)
def _peft_enabled(_training_enabled):
    with hf_tpu.enabled("peft"):
        yield


def _lora_run(load, device: str, steps: int = 3):
    base = load(device)
    torch.manual_seed(0)  # lora_A's random init: the same on both devices
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    # peft initialises lora_B to zeros; give it values so that the first step already depends on both factors.
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).mul_(0.01).to(p.device))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    collate = BucketingCollator(buckets=(16,), pad_token_id=0, batch_size=4, return_attention_mask=False)
    data = examples(4 * steps)
    losses = []
    for i in range(steps):
        batch = {k: v.to(device) for k, v in collate(data[4 * i : 4 * i + 4]).items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach().cpu()))
    return model, losses


def test_lora_on_tpu_matches_cpu(load, tmp_path):
    tpu_model, tpu_losses = _lora_run(load, "tpu")
    cpu_model, cpu_losses = _lora_run(load, "cpu")
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-5, atol=1e-5)
    lora = {n: p for n, p in tpu_model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n and p.device.type == "tpu" for n, p in lora.items())
    base = dict(tpu_model.named_parameters())["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not base.requires_grad and base.device.type == "tpu"

    tpu_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = peft.PeftModel.from_pretrained(load("tpu"), tmp_path / "adapter")
    ids = torch.tensor([examples(1)[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids.to("tpu")).logits.cpu(), cpu_model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
def test_an_adapter_reads_onto_the_tpu_and_upstream_alone_cannot(load, tmp_path, safe):
    torch.manual_seed(0)
    saved = peft.get_peft_model(load("cpu"), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    saved.save_pretrained(tmp_path, safe_serialization=safe)
    ids = torch.tensor([examples(1)[0]["input_ids"]])
    with torch.no_grad():
        expected = saved(ids).logits

    # torch_device="tpu" asks for the TPU on every peft version (0.22 also picks it itself: torch.accelerator).
    reloaded = peft.PeftModel.from_pretrained(load("tpu"), tmp_path, torch_device="tpu")
    lora = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert lora and all(p.device.type == "tpu" for p in lora.values())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids.to("tpu")).logits.cpu(), expected, rtol=1e-4, atol=1e-4)
    # A CPU read goes to upstream as it was.
    on_cpu = peft.PeftModel.from_pretrained(load("cpu"), tmp_path, torch_device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(on_cpu(ids).logits, expected)

    if safe:
        hf_tpu.disable("peft")
        try:
            with pytest.raises(Exception, match="device tpu is invalid"):
                peft.PeftModel.from_pretrained(load("tpu"), tmp_path, torch_device="tpu")
        finally:
            hf_tpu.enable("peft")
