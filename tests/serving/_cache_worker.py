"""One process of the continuous-batching compile-cache test: ``generate_batch`` (warm-up included) on a saved model
with a compile cache.

    python _cache_worker.py MODEL_DIR CACHE_DIR PROMPTS_JSON  ->  prints one JSON line: counters and tokens
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# Two requests per step, pages of 256 tokens: one query rung (32) and KV rungs 0/256/512, 3 step shapes.
SETTINGS = {"max_batch_tokens": 32, "q_min": 32, "slots": 2, "page_size": 256, "kv_factor": 4}
NEW = 4


def run(model_dir: str, cache_dir: str, prompts: list[list[int]]) -> dict:
    """Load the model on the simulated TPU, ``generate_batch`` the prompts greedily with ``cache_dir`` as the compile
    cache (hf_tpu enabled by the caller); the counters of the whole run and the tokens per prompt."""
    import transformers as T

    import hf_tpu.sim
    from hf_tpu import serving
    from hf_tpu.serving import _runner

    serving.configure(**SETTINGS, compile_cache=cache_dir)
    config = T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with hf_tpu.sim.stats() as s:
        tpu = T.AutoModelForCausalLM.from_pretrained(model_dir).eval().to("tpu")
        out = tpu.generate_batch(prompts, generation_config=config, progress_bar=False)
    cache = _runner.compile_cache()
    return {
        "compiles": s.compiles, "hits": s.compile_cache_hits, "problems": list(cache.problems),
        "tokens": [out[f"req_{i}"].generated_tokens for i in range(len(prompts))],
    }  # fmt: skip


def main(model_dir: str, cache_dir: str, prompts: str) -> None:
    import hf_tpu
    import hf_tpu.sim

    hf_tpu.sim.enable()
    hf_tpu.enable("serving")
    print(json.dumps(run(model_dir, cache_dir, json.loads(prompts))))


if __name__ == "__main__":
    main(*sys.argv[1:4])
