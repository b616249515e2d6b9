"""hf-tpu serve under a Poisson trace vs the same requests one at a time (``hf_tpu.benchmarks.serve``).

    python benchmarks/serve.py                   # 32 requests at 16/s, then one at a time
    python benchmarks/serve.py --requests 16     # quicker
    python benchmarks/serve.py --soak            # 2,000 mixed requests at concurrency 32: lost, 5xx, memory, compiles

Same as ``hf-tpu bench serve``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
