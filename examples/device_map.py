"""device_map on a TPU: whole model on the chip, a split with CPU offload under a memory cap, and a loud failure.

Runs on a TPU VM (torch-tpu installed) or anywhere on the simulated TPU:

    HF_TPU_SIMULATE=1 python examples/device_map.py

A tiny Llama is built from a config and saved to a temporary folder (nothing is downloaded).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM

import hf_tpu
from hf_tpu import runtime
from hf_tpu.device_map import DeviceMapFitError, format_bytes, tpu_memory
from hf_tpu.testing import tiny_model


def main() -> None:
    info = runtime.require_tpu("examples/device_map.py")
    print(f"TPU: {info.mode}, {info.device_count} device(s), {format_bytes(tpu_memory(0).total)} HBM on tpu:0")
    hf_tpu.enable()

    path = tempfile.mkdtemp(prefix="hf_tpu_device_map_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # the tiny checkpoint is removed at exit
    sizes = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}
    tiny_model("llama", path, tie_word_embeddings=True, **sizes)
    ids = torch.tensor([[1, 17, 42, 99, 7]])

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # no device_map: on the CPU
    with torch.no_grad():
        expected = reference(ids).logits

    # 1. The whole model on the TPU.
    model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", dtype=torch.float32)
    print(
        "device_map='tpu':",
        {str(p.device) for p in model.parameters()},
        "| tied:",
        model.lm_head.weight is model.model.embed_tokens.weight,
    )
    with torch.no_grad():
        print("  max |logits - cpu| =", (model(ids.to("tpu")).logits.cpu() - expected).abs().max().item())
    del model

    # 2. "auto" under a memory cap: the layers that do not fit are offloaded to the CPU and streamed in.
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={"tpu": "600KiB", "cpu": "1GiB"}, dtype=torch.float32
    )
    print("device_map='auto' with max_memory={'tpu': '600KiB'}:", model.hf_device_map)
    with torch.no_grad():
        print("  max |logits - cpu| =", (model(ids.to("tpu")).logits.cpu() - expected).abs().max().item())
    del model

    # 3. A placement that cannot fit fails before any weight is read, with the sizes.
    try:
        AutoModelForCausalLM.from_pretrained(
            path, device_map="auto", max_memory={"tpu": "600KiB", "cpu": "200KiB"}, dtype=torch.float32
        )
    except DeviceMapFitError as exc:
        print("refused:", exc)


if __name__ == "__main__":
    main()
