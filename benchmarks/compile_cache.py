"""The persistent compile cache and the ladders (``hf_tpu.benchmarks.compile_cache``).

    python benchmarks/compile_cache.py                   # warm-up up to 512: cold vs from the cache; ladders
    python benchmarks/compile_cache.py --max-prompt 64   # quicker

Same as ``hf-tpu bench compile_cache``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
