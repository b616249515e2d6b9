"""Self-test check of serving on the TPU (see :mod:`hf_tpu.selftest`): continuous batching, the engine of
``hf-tpu serve``.

On a TPU VM this is the first run of transformers' continuous batching on real chips with hf_tpu's step ladder: a
tiny Llama's ``generate_batch`` over prompts of mixed lengths (one longer than a step: a chunked prefill), warmed up,
each request's tokens compared with CPU greedy ``generate``; then a second batch of other lengths, which must
compile nothing (on the simulator). It reports the warm-up and step shapes, and the time per generated token. The
HTTP server itself is not started (``hf-tpu bench serve`` and tests/serving do that); the check is skipped when the
``serve`` extras it needs are missing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
import time
from typing import Any

from hf_tpu.selftest import CheckContext, CheckFailed, SkipCheck, register_check

_EXTRAS = ("fastapi", "uvicorn", "openai", "prometheus_client")
# One query rung (16 tokens), KV rungs 0/32/256: 3 step shapes.
_SETTINGS = {"max_batch_tokens": 16, "q_min": 16, "slots": 2, "page_size": 32, "kv_factor": 8, "compile_cache": False}


@register_check(
    "serving",
    description="continuous batching (generate_batch, hf-tpu serve's engine) of a tiny Llama; tokens equal CPU",
    quick=False,
    order=72,
)
def _serving(ctx: CheckContext) -> dict[str, Any]:
    missing = [name for name in _EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise SkipCheck(f"the serve extras are not installed ({', '.join(missing)}): pip install 'hf-tpu[serve]'")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from hf_tpu._patch import enabled
    from hf_tpu.serving._runner import SETTINGS, compiled_shapes, configure
    from hf_tpu.testing import tiny_model

    new = 6
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    first = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 20, 11)]
    second = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 3)]
    figures: dict[str, Any] = {}
    saved = dataclasses.asdict(SETTINGS)
    configure(**_SETTINGS)
    try:
        # greedy tokens against the CPU's: float32 products ('medium', a TPU's default, flips near-ties)
        with tempfile.TemporaryDirectory(prefix="hf_tpu_selftest_") as path, enabled("serving"), ctx.exact_float32():
            tiny_model("llama", path, max_position_embeddings=128)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model = ctx.to_device(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
            try:
                with ctx.measure(figures, "warmup_and_first"):
                    out = model.generate_batch(first, generation_config=config, progress_bar=False,
                                               persistent_manager=True)  # fmt: skip
                results = list(out.values())
                figures["step_shapes"] = len(compiled_shapes(model))  # before the manager goes
                t0 = time.perf_counter()
                with ctx.measure(figures, "second"):
                    out = model.generate_batch(second, generation_config=config, progress_bar=False, warmup=False)
                figures["ms_per_token"] = round(1000 * (time.perf_counter() - t0) / (new * len(second)), 3)
                results += list(out.values())
            finally:
                model.destroy_cached_continuous_batching_manager()
            results.sort(key=lambda r: int(r.request_id.rsplit("_", 1)[1]))
            for prompt, result in zip(first + second, results, strict=True):
                ids = torch.tensor([prompt])
                expected = reference.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                                              pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
                if result.generated_tokens != expected:
                    raise CheckFailed(
                        f"continuous batching on the device gave {result.generated_tokens} for a prompt of "
                        f"{len(prompt)} tokens, CPU generate gave {expected}"
                    )
            if ctx.simulated and figures["second_compiles"]:
                raise CheckFailed(f"{figures['second_compiles']} compile(s) after warm-up (expected none)")
    finally:
        configure(**saved)
    return figures
