"""Quantized generate: bf16 vs int8 vs int4 (torchao configs) vs compressed-tensors w8a16/w4a16 checkpoints
(``hf_tpu.benchmarks.quant``).

    PYTHONPATH=. python benchmarks/quant.py [--hidden 256 --layers 8 --new-tokens 16 ...]

Same as ``hf-tpu bench quant``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
