"""Sampling per decode step, host path against device path (``hf_tpu.benchmarks.sampling``).

    python benchmarks/sampling.py                 # batches 1, 16, 64
    python benchmarks/sampling.py --quick         # batches 1, 16

Same as ``hf-tpu bench sampling``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
