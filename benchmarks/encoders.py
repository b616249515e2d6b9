"""Encoder inference on the simulated tpu: eager vs torch.compile vs bucketed (``hf_tpu.benchmarks.encoders``).

    PYTHONPATH=. python benchmarks/encoders.py [--texts 256] [--batch 16] [--hidden 64] [--layers 2] [--longest 120]

Same as ``hf-tpu bench encoders``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
