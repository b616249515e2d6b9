"""Every image-text-to-text architecture of the installed transformers on the simulated TPU (``hf_tpu.benchmarks.vlm_sweep``).

    PYTHONPATH=. python benchmarks/vlm_sweep.py [--archs llava gemma3 ...] [--jobs 2] [--write-docs]

Same as ``hf-tpu bench vlm_sweep``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
