"""``hf-tpu serve`` with a test hook: SIGUSR1 kills the continuous-batching worker on purpose.

Run as ``python tests/serving/_killable_serve.py serve --simulate ...`` (the arguments of ``hf-tpu``). After SIGUSR1,
the next iteration of the generation loop raises, as a bug in a step would: upstream's loop records the fatal error
and its thread ends; the server must then answer ``/health`` with 503 and exit non-zero (``hf-tpu serve``: status 3).
"""

from __future__ import annotations

import signal
import sys

from transformers.generation.continuous_batching import continuous_api

_KILLED: list[int] = []
_prepare = continuous_api.ContinuousBatchProcessor.prepare_next_batch


def _prepare_next_batch(self):
    if _KILLED:
        raise RuntimeError("the worker was killed on purpose by the test hook (SIGUSR1)")
    return _prepare(self)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, lambda *_: _KILLED.append(1))
    continuous_api.ContinuousBatchProcessor.prepare_next_batch = _prepare_next_batch
    from hf_tpu.cli.main import main

    sys.exit(main(sys.argv[1:]))
