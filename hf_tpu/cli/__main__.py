"""``python -m hf_tpu.cli`` runs the ``hf-tpu`` command."""

import sys

from hf_tpu.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
