"""Each fast-path architecture's decode program compiled for a real TPU by libtpu, no TPU needed (``hf_tpu.benchmarks.arch_compile``).

    PYTHONPATH=. python benchmarks/arch_compile.py [--archs llama qwen3_moe ...] [--resume] [--write-docs]

Same as ``hf-tpu bench arch_compile``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
