"""The ``hf-tpu`` command line: one module per subcommand, dispatched by :mod:`hf_tpu.cli.main`.

Example:
    $ hf-tpu env --json
    $ python -m hf_tpu.cli --simulate env
"""

from hf_tpu.cli.main import main

__all__ = ["main"]
