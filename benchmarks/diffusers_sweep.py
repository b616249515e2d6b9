"""Every diffusers pipeline family on the simulated tpu device vs the CPU (``hf_tpu.benchmarks.diffusers_sweep``).

    PYTHONPATH=. python benchmarks/diffusers_sweep.py [--families sd wan22 ...] [--steps 2]

Same as ``hf-tpu bench diffusers_sweep``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
