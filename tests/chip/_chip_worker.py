"""One process of the chip tier's compile-cache case: warm up a saved model with a cache directory, generate, compare
with the CPU, print one JSON line.

    python _chip_worker.py real|simulate MODEL_DIR CACHE_DIR

On a chip torch_tpu autoloads at ``import torch`` (the case sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=1``); ``simulate``
enables the simulated device. Greedy tokens are compared at float32 matmul precision ``'highest'``.
"""

from __future__ import annotations

import json
import sys

BATCH, MAX_PROMPT, NEW = 2, 16, 6


def main(mode: str, model_dir: str, cache_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import hf_tpu

    if mode == "simulate":
        import hf_tpu.sim

        hf_tpu.sim.enable()
    torch.zeros(1).to("tpu").cpu()  # opens the device (torch_tpu replaces the precision setting when it does)
    torch.set_float32_matmul_precision("highest")
    hf_tpu.enable("generation")
    cpu = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tpu = AutoModelForCausalLM.from_pretrained(model_dir).eval().to("tpu")
    report = hf_tpu.warmup(tpu, max_prompt_len=MAX_PROMPT, batch_sizes=[BATCH], max_new_tokens=NEW, progress=False,
                           cache_dir=cache_dir)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 96, (BATCH, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    got = tpu.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    want = cpu.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    print(json.dumps({
        "mode": hf_tpu.runtime.detect().mode, "graphs": len(report.graphs), "new_compiles": report.new_compiles,
        "from_cache": report.from_cache, "problems": report.cache_problems,
        "differing_tokens": int((got != want).sum()) if got.shape == want.shape else int(want.numel()),
    }))  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:4])
