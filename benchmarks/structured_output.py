"""Continuous batching with and without a JSON schema, tokens/s (``hf_tpu.benchmarks.structured_output``).

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --quick

Same as ``hf-tpu bench structured_output``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
