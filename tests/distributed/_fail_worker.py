"""Run by tests/distributed/test_launch.py: rank 1 raises while rank 0 waits in a collective that never completes.

``python _fail_worker.py OUT_DIR [raise|sleep]``. With ``raise`` (default), rank 1 writes ``OUT_DIR/raised``
when it raises, while rank 0 blocks in a collective: only the launcher stopping rank 0 ends the run. With
``sleep``, every rank writes ``OUT_DIR/ready<rank>`` and sleeps, for the test to stop the launcher.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "raise"
dist.init_process_group("tpu_dist")
rank = dist.get_rank()
x = torch.ones(2, device="tpu")
dist.all_reduce(x)  # every rank got here: the group works
if mode == "sleep":
    with open(os.path.join(out_dir, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
if rank == 1:
    with open(os.path.join(out_dir, "raised"), "w") as f:
        f.write(str(time.time()))
    raise ValueError("rank 1 exploded on purpose (hf_tpu launcher test)")
dist.all_reduce(x)  # rank 1 never joins: rank 0 blocks here until the launcher stops it
time.sleep(600)
