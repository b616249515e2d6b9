"""``generate`` on the simulated TPU, upstream transformers against hf_tpu (``hf_tpu.benchmarks.generate``).

    python benchmarks/generate.py                                # 16 lengths in [1, 512], 8 new tokens
    python benchmarks/generate.py --lengths 6 --max-prompt 128   # quicker

Same as ``hf-tpu bench generate``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
