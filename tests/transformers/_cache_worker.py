"""One process of the compile-cache tests: warm up a saved model with a cache directory, generate, compare with CPU.

    python _cache_worker.py MODEL_DIR CACHE_DIR [EXPERTS] [--build-first=MODEL_TYPE] [--batch=B] [--max-prompt-len=N]
        [--buckets=16,32]  ->  prints one JSON line

``EXPERTS``: the model's experts implementation (``ragged_dot_tpu``: hf_tpu's Hub kernel, registered first).
``--build-first``: build a tiny model of another family first, as a process that served other models has (process-wide
state such as transformers' registry of output-capturing classes then differs from a fresh process's).
``--batch``, ``--max-prompt-len``: the warm-up's batch size (default 2; the generated batch's first rows) and longest
prompt (default 20), to match the graphs another process stored; ``--buckets``: the model's bucket ladder (default
hf_tpu's; the ladder is part of the cache's key).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def main(
    model_dir: str,
    cache_dir: str,
    experts: str | None = None,
    build_first: str | None = None,
    batch: str = "2",
    max_prompt_len: str = "20",
    buckets: str | None = None,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import hf_tpu
    import hf_tpu.sim

    if build_first is not None:
        from hf_tpu.testing import tiny_config

        AutoModelForCausalLM.from_config(tiny_config(build_first, vocab_size=96))

    hf_tpu.sim.enable()
    hf_tpu.enable("generation")
    load = {}
    if experts is not None:
        if experts == "ragged_dot_tpu":
            from hf_tpu.kernels import use_ragged_dot_experts

            use_ragged_dot_experts()
        load["experts_implementation"] = experts
    cpu = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
    tpu = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval().to("tpu")
    start = time.perf_counter()
    with hf_tpu.sim.stats() as warm:
        report = hf_tpu.warmup(tpu, max_prompt_len=int(max_prompt_len), batch_sizes=[int(batch)], max_new_tokens=6,
                               progress=False, cache_dir=cache_dir,
                               buckets=None if buckets is None else [int(b) for b in buckets.split(",")])  # fmt: skip
    seconds = time.perf_counter() - start
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 96, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids, mask = ids[: int(batch)], mask[: int(batch)]
    with hf_tpu.sim.stats() as gen:
        got = tpu.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    print(json.dumps({
        "warm_compiles": warm.compiles, "warm_hits": warm.compile_cache_hits, "graphs": len(report.graphs),
        "new_compiles": report.new_compiles, "from_cache": report.from_cache, "seconds": seconds,
        "generate_compiles": gen.compiles, "generate_hits": gen.compile_cache_hits,
        "equal": torch.equal(got, expected),
        "problems": report.cache_problems,
    }))  # fmt: skip


if __name__ == "__main__":
    flags = dict(a[2:].replace("-", "_").split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    main(*[a for a in sys.argv[1:] if not a.startswith("--")], **flags)
