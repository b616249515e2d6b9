"""Ray Data batch inference over 1 and 2 simulated TPU VMs (``hf_tpu.benchmarks.ray_batch``).

    python benchmarks/ray_batch.py                   # 128 prompts on 1, then 2 simulated VMs
    python benchmarks/ray_batch.py --prompts 32      # quicker

Same as ``hf-tpu bench ray_batch``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
