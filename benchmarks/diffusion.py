"""Diffusion on the simulated tpu device: eager vs compile_pipeline (``hf_tpu.benchmarks.diffusion``).

    PYTHONPATH=. python benchmarks/diffusion.py [--pipeline sd3|sd] [--size H W] [--steps 4]

Same as ``hf-tpu bench diffusion``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
