"""Self-test check of the bucketed encoder forward (see :mod:`hf_tpu.selftest`).

On a TPU VM this is the first run of hf_tpu's encoder graphs on real chips: it warms up a tiny BERT for two length
buckets, runs batches of three lengths through it, compares ``last_hidden_state`` and ``pooler_output`` with the same
model on the CPU, and reports the warm-up time, the compiles after warm-up (expected: 0) and the time per batch.
"""

from __future__ import annotations

import tempfile
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, register_check


@register_check(
    "encoders",
    description="warm-up + bucketed forward of a tiny BERT on the tpu device; outputs equal CPU",
    quick=False,
    order=74,
)
def _encoders(ctx: CheckContext) -> dict[str, Any]:
    import torch
    from transformers import AutoModel

    from hf_tpu._patch import enabled
    from hf_tpu.encoders.warmup import warmup
    from hf_tpu.testing import tiny_encoder

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(5, 96, (2, n), generator=g) for n in (5, 11, 29)]
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_") as path, enabled("encoders"), torch.no_grad():
        tiny_encoder("bert", path)
        reference = AutoModel.from_pretrained(path).eval()
        model = ctx.to_device(AutoModel.from_pretrained(path).eval())
        with ctx.measure(figures, "warmup"):
            report = warmup(model, max_length=32, batch_sizes=[2], progress=False)
        figures["warmup_graphs"] = len(report.graphs)
        with ctx.measure(figures, "forward"):
            outputs = [model(ids.to(ctx.device)) for ids in batches]
            outputs = [(out.last_hidden_state.cpu(), out.pooler_output.cpu()) for out in outputs]  # the device's work
        for ids, (hidden, pooled) in zip(batches, outputs, strict=True):
            want = reference(ids)
            ctx.compare(hidden, want.last_hidden_state, figures, layers=4, what="the last hidden state")
            ctx.compare(pooled, want.pooler_output, figures, layers=5, what="the pooler output")
        if ctx.simulated and figures["forward_compiles"]:
            raise CheckFailed(f"{figures['forward_compiles']} compile(s) after warm-up (expected none)")
    return figures
