"""Distributed tests spawn ranks through ``python -m hf_tpu.launch --simulate``; each has a timeout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
