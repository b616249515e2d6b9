"""MoE experts layer: the ragged-dot kernel vs the eager loop vs grouped_mm (``hf_tpu.benchmarks.moe``).

    PYTHONPATH=. python benchmarks/moe.py [--experts 64 --top-k 8 --batches 1 8 64 ...]

Same as ``hf-tpu bench moe``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
