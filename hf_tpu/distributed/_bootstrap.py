"""Worker entry point used by ``hf-tpu launch``: ``python -m hf_tpu.distributed._bootstrap --script S [args]``.

It imports hf_tpu first (with ``HF_TPU_SIMULATE=1`` that registers this rank's own simulated ``tpu:0``; the
simulator's side of ``torch.distributed``, reached through :func:`hf_tpu.runtime.simulated_distributed`, then sets
the generation asked for and registers the simulated ``tpu_dist`` process-group backend), then runs the user's script or module as ``__main__`` with the
arguments it was given. An exception is recorded for torchrun (``TORCHELASTIC_ERROR_FILE``), so the launcher
can show which rank failed and its traceback.

A command line without ``--script`` or ``--module`` ends it with ``SystemExit`` and the usage line.
"""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["main"]


def _prepare() -> None:
    # hf_tpu's __init__ has run already (this module is part of the package): with HF_TPU_SIMULATE=1 it enabled the
    # simulated device here.
    from hf_tpu import _env

    if _env.SIMULATE.get():
        from hf_tpu import runtime

        # The launcher passes on the generation / HBM it was asked to simulate (hf-tpu --sim-generation ...).
        side = runtime.simulated_distributed()
        if side is not None:
            side.prepare_rank()


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("--script", "--module"):
        raise SystemExit("usage: python -m hf_tpu.distributed._bootstrap (--script PATH | --module NAME) [args...]")
    kind, target, rest = argv[0], argv[1], argv[2:]

    @record
    def run() -> None:
        _prepare()
        if kind == "--module":
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *rest]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")

    run()


if __name__ == "__main__":
    main()
