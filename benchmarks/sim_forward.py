"""Tiny-Llama forward on the simulated tpu over the same forward on the CPU (``hf_tpu.benchmarks.sim_forward``).

    PYTHONPATH=. python benchmarks/sim_forward.py [--hidden 128 --seq 64 --layers 2 --batch 2 --iters 30]

Same as ``hf-tpu bench sim_forward``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
