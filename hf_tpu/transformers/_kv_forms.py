"""The KV cache's write forms as kernel forms (:mod:`hf_tpu.kernels.forms`): where a decode step's new K/V rows are
written (``kv_write``: in the graph or after it) and how rows left by a graph are written (``kv_rows_writer``).

Their code is the static cache's (:mod:`hf_tpu.transformers._cache.static`); this module declares the two choices
for the registry: each is its ``HF_TPU_*`` variable's value, with no measured table.
"""

from __future__ import annotations

from hf_tpu import _env
from hf_tpu.kernels.forms import KernelForm

__all__ = ["KERNEL_FORM"]

KERNEL_FORM = (
    KernelForm(
        "kv_write", _env.KV_WRITE.choices, "where a decode step's new K/V rows are written", override=_env.KV_WRITE,
        unmeasured="a rule, not a table: auto writes after the graph once a layer's K and V hold 32 MiB",
    ),
    KernelForm(
        "kv_rows_writer", _env.KV_ROWS_WRITER.choices, "how the rows a decode graph left are written",
        override=_env.KV_ROWS_WRITER, unmeasured="a rule, not a table: auto takes jax where it can run",
    ),
)  # fmt: skip
