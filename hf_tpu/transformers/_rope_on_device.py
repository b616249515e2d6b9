"""Rotary embeddings that rebuild their frequencies on the host at every forward answer from the device instead.

PhiMoE's rotary embedding (transformers 5.24, ``PhimoeRotaryEmbedding.forward``) calls ``self.rope_init_fn(config)``
on every forward: the frequencies are computed on the CPU and copied to the device, one host->device copy per decode
step on top of the loop's one (issue #20's sweep: 2 copies per step). Called with the config alone, that function
returns what it returned in ``__init__``, which the module keeps as its ``original_inv_freq`` buffer (moved to the
device with the model). The patched ``__init__`` gives each new module a ``rope_init_fn`` that returns that buffer for
such a call (and upstream's function for any other call, or while the buffer is not float32, as after a
``model.to(torch.bfloat16)``: upstream's forward computes in float32). Tokens are unchanged; models built before
:func:`hf_tpu.enable` keep upstream's behaviour.
"""

from __future__ import annotations

import functools
from typing import Any

from hf_tpu._patch import original, patch

__all__ = ["apply"]


class _FromBuffer:
    """``rope_init_fn(config)`` answered from ``module.original_inv_freq`` (the same values, already on the device)."""

    def __init__(self, module: Any, upstream: Any) -> None:
        self.module = module  # holds the buffer as the module moves between devices and dtypes
        self.upstream = upstream

    def __call__(self, config: Any, *args: Any, **kwargs: Any):
        import torch

        buffer = self.module.original_inv_freq
        if args or kwargs or config is not self.module.config or buffer.dtype != torch.float32:
            return self.upstream(config, *args, **kwargs)
        return buffer, self.module.attention_scaling


def apply(feature: str) -> None:
    try:
        from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding
    except ImportError:  # pragma: no cover - a transformers without PhiMoE
        return
    upstream = original(PhimoeRotaryEmbedding, "__init__")

    @functools.wraps(upstream)
    def __init__(self, config, *args, **kwargs):
        upstream(self, config, *args, **kwargs)
        self.rope_init_fn = _FromBuffer(self, self.rope_init_fn)

    patch(PhimoeRotaryEmbedding, "__init__", __init__, feature=feature, package="transformers", versions=">=5.0,<6")
