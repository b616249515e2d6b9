"""Run by tests/distributed/test_multihost.py: one rank of a 2 (data parallel) x 2 (tensor parallel) job.

``python _multihost_worker.py OUT_DIR [once|hang]``. Ranks (0, 1) and (2, 3) each split a linear layer's output
columns (tensor parallel, all_gather in the pair); ranks (0, 2) and (1, 3) see different rows of the batch (data
parallel, all_reduce of the column sums). Each rank writes its launch environment and result to
``OUT_DIR/rank<RANK>.json``. With ``hang`` every rank then writes ``OUT_DIR/ready<RANK>`` and keeps running
collectives, so that the test can kill one host and watch the other end.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "once"
dist.init_process_group("tpu_dist")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, world
tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
dp, tp = rank // 2, rank % 2

g = torch.Generator().manual_seed(0)
weight = torch.randn(8, 6, generator=g)
batch = torch.randn(8, 8, generator=g)
x = batch[dp * 4 : (dp + 1) * 4].to("tpu")
y_local = x @ weight[:, tp * 3 : (tp + 1) * 3].to("tpu")
parts = [torch.empty_like(y_local) for _ in range(2)]
dist.all_gather(parts, y_local, group=tp_groups[dp])
y = torch.cat(parts, dim=1)
col_sums = y.sum(0)
dist.all_reduce(col_sums, group=dp_groups[tp])
keys = ("TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "NNODES", "NODE_RANK", "MASTER_ADDR")
result = {
    "rank": rank,
    "device": str(col_sums.device),
    "env": {k: os.environ.get(k) for k in keys},
    "y": y.cpu().tolist(),
    "col_sums": col_sums.cpu().tolist(),
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
if mode == "hang":
    with open(os.path.join(out_dir, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while True:  # a collective every step: when a host dies, the others' next collective fails
        dist.all_reduce(torch.ones(1, device="tpu"))
        time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()
import gc  # noqa: E402

gc.freeze()  # done: the exit does not walk this rank's objects (~1 CPU-s; see tests/distributed/_tp_worker.py)
