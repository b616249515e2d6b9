"""Self-test check of generation on the TPU (see :mod:`hf_tpu.selftest`): bucketed, compiled ``generate``.

On a TPU VM this is the first run of hf_tpu's decoding loop on real chips: it warms up a tiny Llama, generates for a
batch of two prompts of different lengths, compares the tokens with upstream ``generate`` on CPU, and reports the
warm-up time, the compiles after warm-up (expected: 0), torch_tpu's own cache requests and misses during warm-up and
generate (``*_tpu_cache_requests``/``*_tpu_cache_misses``, from ``torch.tpu._get_cache_stats()``: a miss after
warm-up is a recompile, eager ops included) and the time per decode step.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, register_check


@register_check(
    "generation",
    description="warm-up + bucketed generate of a tiny Llama on the tpu device; tokens equal CPU generate",
    quick=False,
    order=70,
)
def _generation(ctx: CheckContext) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tpu._patch import enabled
    from hf_tpu.testing import tiny_model
    from hf_tpu.transformers.warmup import warmup

    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for row, n in enumerate((5, 11)):
        ids[row, 11 - n :] = torch.randint(3, 128, (n,), generator=g)
        mask[row, 11 - n :] = 1
    new = 8
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_") as path:
        tiny_model("llama", path, max_position_embeddings=128)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
        model = ctx.to_device(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        # greedy tokens against the CPU's: float32 products ('medium', a TPU's default, flips near-ties)
        with enabled("generation"), ctx.exact_float32():
            with ctx.measure(figures, "warmup"):
                report = warmup(model, max_prompt_len=16, batch_sizes=[2], max_new_tokens=new, progress=False)
            figures["warmup_graphs"] = len(report.graphs)
            with ctx.measure(figures, "generate"):
                got = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
            if not torch.equal(got.cpu(), expected):
                raise CheckFailed(f"generate on the tpu device gave {got.tolist()}, CPU gave {expected.tolist()}")
            if ctx.simulated and figures["generate_compiles"]:
                raise CheckFailed(f"{figures['generate_compiles']} compile(s) after warm-up (expected none)")
            if ctx.simulated and figures.get("generate_tpu_cache_misses"):  # on a chip: reported, a recompile each
                misses = figures["generate_tpu_cache_misses"]
                raise CheckFailed(f"{misses} torch_tpu cache miss(es) (recompiles) after warm-up (expected none)")
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=2 * new, do_sample=False, eos_token_id=None)
            figures["ms_per_token"] = round(1000 * (time.perf_counter() - t0) / (2 * new), 3)
    return figures
