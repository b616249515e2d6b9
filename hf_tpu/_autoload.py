"""torch's device-backend autoload entry point (``[project.entry-points."torch.backends"]`` in pyproject.toml).

torch calls every ``torch.backends`` entry point at the end of ``import torch`` (unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); torch-tpu loads itself that way. With ``HF_TPU_SIMULATE=1`` in the environment
this one does what ``hf-tpu launch`` does in each rank before the user's script: import hf_tpu (which enables the
simulated ``tpu`` device) and register the simulated ``tpu_dist`` process-group backend. So a script that never
imports hf_tpu, such as a torchrun worker started by torch_tpu's own launch recipe
(``torch.tpu.distributed.set_tpu_launch_env()`` then ``torch.distributed.run.main()``), runs on its simulated chip.
Without ``HF_TPU_SIMULATE`` it does nothing: a TPU host is torch-tpu's, and ``import hf_tpu`` stays explicit.
"""

from __future__ import annotations

import os

__all__ = ["load"]


def load() -> None:
    from hf_tpu import _env

    if not _env.SIMULATE.get():
        return
    from hf_tpu.distributed import _bootstrap

    _bootstrap._prepare()
    import warnings

    from hf_tpu._launch_env import slice_mismatch

    mismatch = slice_mismatch(os.environ)
    if mismatch:  # said by every rank of the host: each is started in the mismatched slice
        warnings.warn(f"hf_tpu.sim: {mismatch}", UserWarning, stacklevel=2)
