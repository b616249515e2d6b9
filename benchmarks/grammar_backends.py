"""Grammar libraries for structured output, llguidance against xgrammar (``hf_tpu.benchmarks.grammar_backends``).

    PYTHONPATH=.:DIR python benchmarks/grammar_backends.py     # DIR: xgrammar installed with --target
    python benchmarks/grammar_backends.py --quick

Same as ``hf-tpu bench grammar_backends``; the benchmark lives in the package so that it ships with it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tpu.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main([Path(__file__).stem, *sys.argv[1:]]))
