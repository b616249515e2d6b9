"""``python -m hf_tpu.launch [--simulate] [torchrun args] script.py [script args]``: see
:mod:`hf_tpu.distributed.launch`."""

from __future__ import annotations

import sys

from hf_tpu.distributed.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
