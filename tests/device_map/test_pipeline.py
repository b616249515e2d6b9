"""pipeline(device="tpu") and pipeline(device_map="auto") run on the simulated TPU and match the CPU pipeline."""

from __future__ import annotations

import pytest
import torch

import hf_tpu

PROMPT = "w1 w7 w20 w3"


def _cpu_text(path):
    from transformers import pipeline

    was_on = hf_tpu.is_enabled("device_map")
    hf_tpu.disable("device_map")
    try:
        pipe = pipeline("text-generation", model=str(path), device="cpu", dtype=torch.float32)
        return pipe(PROMPT, max_new_tokens=3, do_sample=False)[0]["generated_text"]
    finally:
        if was_on:
            hf_tpu.enable("device_map")


@pytest.mark.parametrize("how", [{"device": "tpu"}, {"device": 0}, {"device_map": "auto"}, {"device_map": "tpu"}])
def test_text_generation_pipeline_on_tpu(device_map_on, tied_path, how):
    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(tied_path), dtype=torch.float32, **how)
    assert pipe.device == torch.device("tpu:0")
    assert {p.device.type for p in pipe.model.parameters()} == {"tpu"}
    assert pipe.model.lm_head.weight is pipe.model.model.embed_tokens.weight
    text = pipe(PROMPT, max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert text == _cpu_text(tied_path)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
