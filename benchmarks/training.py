"""Training steps on the simulated tpu: eager vs compiled, bucketed vs pad-to-longest (``hf_tpu.benchmarks.training``).

    PYTHONPATH=. python benchmarks/training.py [--steps 12] [--warmup 2] [--hidden 64] [--layers 2] [--batch 4]

Same as ``hf-tpu bench training``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
