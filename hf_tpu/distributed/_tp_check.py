"""One rank of the tensor-parallel self-test: ``hf-tpu launch ... -m hf_tpu.distributed._tp_check OUT MODEL``.

Loads ``MODEL`` twice on this rank's ``tpu:0``, unsharded and with ``DistributedConfig(tp_size=WORLD_SIZE)``
(hf_tpu's plan checks enabled), runs a forward and a greedy static-cache generation with both, and writes the
comparison to ``OUT/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main(out_dir: str, model_dir: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    result: dict = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    dist = None
    try:
        import torch
        import torch.distributed as dist

        from hf_tpu._patch import enable

        enable("tensor_parallel")
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        ids = torch.tensor([[1, 5, 9, 23, 77, 3, 41]])
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, distributed_config=DistributedConfig(tp_size=result["world_size"])
        )
        result["load_s"] = round(time.perf_counter() - t0, 3)
        reference = AutoModelForCausalLM.from_pretrained(model_dir).to(model.device)
        x = ids.to(model.device)
        with torch.no_grad():
            diff = (model(x).logits.float().cpu() - reference(x).logits.float().cpu()).abs().max().item()
        gen = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
        t0 = time.perf_counter()
        tokens = model.generate(x, **gen).cpu()
        result["generate_s"] = round(time.perf_counter() - t0, 3)
        result.update(
            device=str(model.device),
            max_abs_diff=diff,
            tokens_equal=torch.equal(tokens, reference.generate(x, **gen).cpu()),
            fixes=[f.kind for f in getattr(model, "_hf_tpu_tp_fixes", [])],
        )
    except Exception:  # noqa: BLE001 - reported to the self-test
        result["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
