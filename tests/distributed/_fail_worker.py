"""Run by tests/distributed/test_launch.py: rank 1 raises while rank 0 waits in a collective that never completes.

``python _fail_worker.py OUT_DIR``. Rank 1 writes the time it raises to ``OUT_DIR/raised``, so the test can
measure how long the launcher takes to stop everything and exit.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("tpu_dist")
rank = dist.get_rank()
x = torch.ones(2, device="tpu")
dist.all_reduce(x)  # every rank got here: the group works
if rank == 1:
    with open(os.path.join(out_dir, "raised"), "w") as f:
        f.write(str(time.time()))
    raise ValueError("rank 1 exploded on purpose (hf_tpu launcher test)")
dist.all_reduce(x)  # rank 1 never joins: rank 0 blocks here until the launcher stops it
time.sleep(600)
