"""decode-attention-tpu: one-token (decode) attention over a static cache for TPU, as a Hugging Face Hub kernel.

A decode step attends one new token per row to a static (or bucketed) cache, keys and values
``(batch, kv_heads, slots, head_dim)``, whose rows are filled to lengths of their own. The Pallas kernel reads only
the blocks of each row's filled slots::

    from kernels import get_kernel

    kernel = get_kernel("<org>/decode-attention-tpu", version=1)
    out = kernel.decode_attention(query, key, value, lengths)        # lengths (batch,) or a bool (batch, slots) mask

On TorchTPU's device it runs the Pallas kernel; elsewhere (CPU, hf_tpu's simulated device) :func:`reference`, the
same attention in torch ops.

It raises built-in exceptions (``ValueError``, ``RuntimeError``, ``NotImplementedError``, ``ImportError``): it is a
package of its own, loaded by ``kernels`` from the Hub, and imports nothing of hf_tpu.
"""

from __future__ import annotations

from ._ops import IMPLEMENTATIONS, OP_NAMESPACE, decode_attention, decode_attention_op, reference, torch_tpu_op

__all__ = [
    "IMPLEMENTATIONS",
    "OP_NAMESPACE",
    "decode_attention",
    "decode_attention_op",
    "reference",
    "torch_tpu_op",
]

__version__ = "1.0.0"
