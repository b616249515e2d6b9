"""Self-test check of device_map on the TPU (see :mod:`hf_tpu.selftest`): placement, offload, ties, the fit check.

On a TPU VM this is the first run of the device_map integration on real chips: it loads a tiny Llama with
``device_map="tpu"`` and with ``"auto"`` under a TPU memory cap (CPU offload), compares the logits with the CPU, and
checks that an impossible placement is refused before loading.
"""

from __future__ import annotations

import tempfile
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, register_check


@register_check("device_map", description="device_map='tpu'/'auto' place a tiny Llama; outputs match CPU", order=60)
def _device_map(ctx: CheckContext) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tpu._patch import enabled
    from hf_tpu.device_map.devices import tpu_memory
    from hf_tpu.device_map.preflight import DeviceMapFitError, placement_bytes
    from hf_tpu.testing import tiny_model

    figures: dict[str, Any] = {"hbm_free_mib": round(tpu_memory(0).free / 1024**2, 1)}
    ids = torch.tensor([[1, 17, 42, 99, 7]])
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_") as path:
        tiny_model("llama", path, tie_word_embeddings=True)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            expected = reference(ids).logits
        with enabled("device_map"):
            with ctx.measure(figures, "load_tpu"):
                model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", dtype=torch.float32)
            devices = {str(p.device) for p in model.parameters()}
            if devices != {"tpu:0"}:
                raise CheckFailed(f"device_map='tpu' left parameters on {devices}")
            if model.lm_head.weight is not model.model.embed_tokens.weight:
                raise CheckFailed("the tied LM head and embedding are separate tensors after device_map='tpu'")
            with ctx.measure(figures, "forward_tpu"), torch.no_grad():
                ctx.compare(model(ids.to(ctx.device)).logits, expected, figures, layers=4, what="the logits")
            del model

            cap = 60 * 1024
            with ctx.measure(figures, "load_auto_offload"):
                model = AutoModelForCausalLM.from_pretrained(
                    path, device_map="auto", max_memory={"tpu": cap, "cpu": "1GiB"}, dtype=torch.float32
                )
            plan = set(model.hf_device_map.values())
            if plan != {"tpu:0", "cpu"}:
                raise CheckFailed(f"device_map='auto' with a 60 KiB TPU cap planned {model.hf_device_map}")
            figures["auto_tpu_kib"] = round(placement_bytes(model, model.hf_device_map)["tpu:0"] / 1024, 1)
            with ctx.measure(figures, "forward_offload"), torch.no_grad():
                ctx.compare(model(ids.to(ctx.device)).logits, expected, figures, layers=4, what="the logits")
            del model

            try:
                AutoModelForCausalLM.from_pretrained(
                    path, device_map="auto", max_memory={"tpu": cap, "cpu": cap}, dtype=torch.float32
                )
            except DeviceMapFitError:
                figures["fit_check"] = "refused"
            else:
                raise CheckFailed("a model that needs disk offload without offload_folder was not refused")
    return figures
