"""Self-test check of quantized models on the TPU (see :mod:`hf_tpu.selftest`): int8 and int4 weight-only, and a
compressed-tensors w4a16 checkpoint kept packed.

On a TPU VM this is the first run of torchao's int8 and hf_tpu's int4 layout on real chips: a tiny Llama (hidden
128) loaded with ``TorchAoConfig(Int8WeightOnlyConfig())`` and ``TorchAoConfig(Int4WeightOnlyConfig(group_size=128))``
on the device, warmed up, and its greedy tokens compared with the same quantized weights run on the CPU; the same
model saved as a compressed-tensors w4a16 checkpoint, against the CPU decompressing it (the first run of hf_tpu's
shift-and-mask unpacking on a chip). It reports the weight bytes against bf16 and the time per generated token.
What it cannot see: whether XLA keeps the dequantization fused into the matmul (HBM use during generate needs the
chip's own profiler).
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check


@register_check(
    "quantization",
    description="int8/int4 weight-only (torchao configs) and a compressed-tensors w4a16 checkpoint generate on the "
    "device; tokens equal the CPU's",
    quick=False,
    order=75,
)
def _quantization(ctx: CheckContext) -> dict[str, Any]:
    if importlib.util.find_spec("torchao") is None:
        raise SkipCheck("torchao is not installed: pip install 'hf-tpu[quant]'")
    import torch
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from hf_tpu._patch import enabled
    from hf_tpu.numerics import greedy_tie
    from hf_tpu.quantization.sizes import weight_bytes
    from hf_tpu.testing import tiny_model
    from hf_tpu.transformers.warmup import warmup

    configs = {"int8": Int8WeightOnlyConfig(), "int4": Int4WeightOnlyConfig(group_size=128)}
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    new = 8
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_") as path, enabled(
        "device_map", "generation", "quantization"
    ):
        tiny_model(
            "llama", path, hidden_size=128, intermediate_size=512, head_dim=32, num_hidden_layers=1,
            initializer_range=0.3,
        )
        bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        bf16_bytes = weight_bytes(bf16)
        del bf16
        runs = {kind: (path, dict(quantization_config=TorchAoConfig(config))) for kind, config in configs.items()}
        if importlib.util.find_spec("compressed_tensors") is not None:
            from hf_tpu.quantization.ct_checkpoint import save_compressed

            save_compressed(path, f"{path}/ct-w4a16", "w4a16")
            runs["ct_w4a16"] = (f"{path}/ct-w4a16", {})  # the checkpoint carries its quantization_config
        else:
            figures["ct_w4a16"] = "skipped: compressed-tensors is not installed"
        for kind, (source, quantization) in runs.items():
            load = dict(dtype=torch.bfloat16, **quantization)
            model = AutoModelForCausalLM.from_pretrained(source, device_map=ctx.device, **load).eval()
            if kind.startswith("ct_"):  # the CPU decompresses the same checkpoint (compressed-tensors' own path)
                reference = AutoModelForCausalLM.from_pretrained(source, **load).eval()
            else:  # the same quantized weights, moved to the CPU
                reference = AutoModelForCausalLM.from_pretrained(source, device_map=ctx.device, **load).eval()
                reference = reference.to("cpu")
            figures[f"{kind}_weights_vs_bf16"] = round(weight_bytes(model) / bf16_bytes, 3)
            with ctx.measure(figures, f"{kind}_warmup"):
                warmup(model, max_prompt_len=16, batch_sizes=[1], max_new_tokens=new, progress=False)
            t0 = time.perf_counter()
            got = model.generate(ids, max_new_tokens=new, do_sample=False)
            figures[f"{kind}_ms_per_token"] = round(1000 * (time.perf_counter() - t0) / new, 3)
            expected = reference.generate(ids, max_new_tokens=new, do_sample=False)
            got = got.cpu()
            if not torch.equal(got, expected):
                # bfloat16 on both sides, accumulated in another order: the first differing token must be a tie of
                # the CPU's logits there (hf_tpu.numerics.greedy_tie), never a clear choice
                step = int((got[0] != expected[0]).nonzero()[0])
                with torch.no_grad():
                    logits = reference(expected[:, :step]).logits[0, -1]
                tie, margin, allowed = greedy_tie(logits, int(got[0, step]), int(expected[0, step]))
                figures[f"{kind}_bf16_tie"] = {"step": step, "margin": round(margin, 6), "allowed": round(allowed, 6)}
                if not tie:
                    raise CheckFailed(
                        f"{kind}: tokens on the device {got.tolist()}, on the CPU {expected.tolist()}: at position "
                        f"{step} the CPU's logits prefer its token by {margin:.4g}, more than a bfloat16 tie "
                        f"({allowed:.4g})"
                    )
            del model, reference
    return figures
