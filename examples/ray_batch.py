"""Batch inference over a Ray cluster: a dataset of prompts through HfTpuGenerate, one actor per TPU VM.

Here the cluster is local: 2 simulated TPU VMs on this host (hf_tpu.ray.local), each actor on the simulated ``tpu``
device, all sharing one compile-cache directory. On a real cluster, drop ``simulated_cluster`` and call
``ray.init()`` (see docs/ray.md for a v6e pod). Needs ``pip install 'hf-tpu[ray]'``.

    HF_TPU_SIMULATE=1 python examples/ray_batch.py                 # 1,000 prompts over 2 simulated VMs
    HF_TPU_SIMULATE=1 python examples/ray_batch.py --prompts 256 --check-cpu   # each row against CPU greedy
    HF_TPU_SIMULATE=1 python examples/ray_batch.py --prompts 64 --nodes 1
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# --check-cpu compares greedy tokens with the CPU's: the simulated actors multiply float32 exactly (at 'medium', a
# TPU's default and the simulator's, one bfloat16 pass can flip a near-tie; on a TPU set the precision in the actors)
os.environ.setdefault("HF_TPU_SIM_MATMUL_PRECISION", "highest")

import ray

from hf_tpu.assets import default_model_path
from hf_tpu.ray import HfTpuGenerate
from hf_tpu.ray.local import cpu_greedy_rows, heldout_prompts, simulated_cluster

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompts", type=int, default=1000)
parser.add_argument("--nodes", type=int, default=2, help="simulated TPU VMs, one actor each")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=16)
parser.add_argument("--cache-dir", default=None, help="compile-cache directory (default: a new temporary one)")
parser.add_argument("--check-cpu", action="store_true", help="compare every row with the CPU's greedy generate")
args = parser.parse_args()

work = tempfile.TemporaryDirectory(prefix="hf-tpu-ray-")  # the cache and the actors' start reports; removed at the end
cache_dir = args.cache_dir or str(Path(work.name) / "compile-cache")
reports = Path(work.name) / "start-reports"

with simulated_cluster(nodes=args.nodes):
    # Start the job once every actor is up, so that rows/s below measures generation, not start-up.
    ray.data.DataContext.get_current().wait_for_min_actors_s = 1800
    prompts = heldout_prompts(args.prompts)
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    out = ds.map_batches(
        HfTpuGenerate,
        fn_constructor_kwargs={"model": str(default_model_path()), "batch_size": args.batch_size,
                               "max_new_tokens": args.max_new_tokens, "max_prompt_len": 16,
                               "cache_dir": cache_dir, "start_reports": str(reports)},
        batch_size=args.batch_size, num_cpus=0, resources={"TPU": 1},
        compute=ray.data.ActorPoolStrategy(size=args.nodes),
    )  # fmt: skip
    start = time.perf_counter()
    rows, first = [], None
    for row in out.iter_rows():
        first = first or time.perf_counter()
        rows.append(row)
    end = time.perf_counter()

starts = sorted((json.loads(p.read_text()) for p in reports.glob("*.json")), key=lambda r: r["lock_wait_s"])
work.cleanup()
errors = [r for r in rows if r["error"] is not None]
print(f"{len(rows)} rows back of {len(prompts)} prompts, {len(errors)} with an error, "
      f"{len({r['id'] for r in rows})} distinct ids")
print(f"job: {end - start:.1f} s with actor start; {len(rows) / (end - first):.1f} rows/s from the first row to the "
      "last")
for i, s in enumerate(starts):
    print(f"actor {i + 1} (node {str(s['node_id'])[:8]}): load {s['load_s']:.1f} s, warm-up {s['warmup_s']:.1f} s "
          f"(waited {s['lock_wait_s']:.1f} s for the cache lock), {s['new_compiles']} graphs compiled, "
          f"{s['from_cache']} from the compile cache")
if args.check_cpu:
    expected = cpu_greedy_rows(str(default_model_path()), prompts, args.max_new_tokens)
    same = sum(list(r["generated_token_ids"]) == expected[r["id"]] for r in rows)
    print(f"{same} of {len(prompts)} rows equal the CPU's greedy generate, token for token")
for r in sorted(rows, key=lambda r: r["id"])[:3]:
    print(f"  {r['prompt']!r} -> {r['generated_text']!r}")
