"""How big the paged KV cache of continuous batching is on a TPU (:func:`kv_cache_plan`).

Upstream sizes the paged cache from the free memory of a CUDA/XPU/MPS device and, for any other device, from the
host's RAM: on a TPU it reserved 8.7 GiB of the chip for a 200k-parameter model. hf_tpu sizes it from the model
and the chip instead:

* one token of cache costs ``2 * layers * kv_heads * head_dim * bytes per element`` (keys and values);
* the cache holds what ``slots`` requests of the model's full length need (``max_position_embeddings``, at most
  :data:`MAX_LEN_CAP` tokens), never more;
* and at most :data:`HBM_FRACTION` of the chip's free HBM (after the weights are on it), or ``kv_cache_gib`` when
  given (the ``--kv-cache-gib`` flag of ``hf-tpu serve``, or the ``HF_TPU_KV_CACHE_GIB`` environment variable);
* rounded up to whole pages, and at least one request of the model's full length.

Example:
    >>> plan = kv_cache_plan(layers=4, kv_heads=2, head_dim=32, itemsize=4, max_len=256, slots=32, page_size=256,
    ...                      free_hbm=16 * 2**30)
    >>> plan.num_blocks, plan.tokens, plan.bytes // 2**20
    (32, 8192, 16)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_tpu import _env
from hf_tpu.errors import InvalidArgumentError

__all__ = [
    "HBM_FRACTION", "KV_CACHE_GIB_ENV", "MAX_LEN_CAP", "KVCachePlan", "kv_cache_plan", "model_max_len", "plan_for_model",
]  # fmt: skip

#: Largest share of the chip's free HBM the cache may take.
HBM_FRACTION = 0.5
#: Environment variable capping the cache, in GiB.
KV_CACHE_GIB_ENV = _env.KV_CACHE_GIB.name
#: Longest request length the default sizing plans for (models with longer contexts still fit one such request).
MAX_LEN_CAP = 8192
#: Requests the default cache holds at full length.
DEFAULT_SLOTS = 32


def model_max_len(model) -> int:
    """The longest sequence ``model`` takes: its text config's position limit, or :data:`MAX_LEN_CAP` when it names
    none."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return MAX_LEN_CAP


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    page_size: int
    bytes_per_token: int
    why: str

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def kv_cache_plan(
    *, layers: int, kv_heads: int, head_dim: int, itemsize: int, max_len: int, slots: int, page_size: int,
    free_hbm: int, cap_bytes: int | None = None,
) -> KVCachePlan:  # fmt: skip
    """The cache for ``slots`` requests of ``max_len`` tokens, within ``HBM_FRACTION * free_hbm`` and ``cap_bytes``."""
    per_token = 2 * layers * kv_heads * head_dim * itemsize
    max_len = min(max_len, MAX_LEN_CAP)
    want = slots * max_len
    budget = int(HBM_FRACTION * free_hbm)
    why = f"{slots} requests of {max_len} tokens"
    if cap_bytes is not None and cap_bytes < budget:
        budget, limit = cap_bytes, f"the {cap_bytes / 2**30:.3g} GiB cap"
    else:
        limit = f"{HBM_FRACTION:.0%} of the chip's free HBM ({free_hbm / 2**30:.3g} GiB)"
    if want * per_token > budget:
        want = budget // per_token
        why = f"{limit}"
    if want < max_len:
        raise InvalidArgumentError(
            f"the KV cache cannot hold one request of {max_len} tokens ({max_len * per_token / 2**20:.1f} MiB) within "
            f"{limit}: raise the cap ({KV_CACHE_GIB_ENV} / --kv-cache-gib), or serve on a chip with more HBM."
        )
    return KVCachePlan(math.ceil(want / page_size), page_size, per_token, why)


def _cap_bytes(kv_cache_gib: float | None) -> int | None:
    if kv_cache_gib is None:
        kv_cache_gib = _env.KV_CACHE_GIB.get()  # (text that is not a number raises, naming the variable)
        if kv_cache_gib is None:
            return None
    if kv_cache_gib <= 0:
        raise InvalidArgumentError(f"the KV cache cap must be a positive number of GiB, got {kv_cache_gib}")
    return int(kv_cache_gib * 2**30)


def plan_for_model(model, page_size: int, slots: int | None = None, kv_cache_gib: float | None = None) -> KVCachePlan:
    """:func:`kv_cache_plan` for a model on a ``tpu`` device (its config, dtype and the chip's free HBM)."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    from hf_tpu.device_map.devices import tpu_memory

    config = model.config.get_text_config()
    max_len = None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            max_len = value
            break
    memory = tpu_memory(model.device.index or 0)
    return kv_cache_plan(
        layers=config.num_hidden_layers, kv_heads=find_num_key_value_heads(config), head_dim=find_head_dim(config),
        itemsize=model.dtype.itemsize, max_len=max_len or MAX_LEN_CAP, slots=slots or DEFAULT_SLOTS,
        page_size=page_size, free_hbm=memory.free, cap_bytes=_cap_bytes(kv_cache_gib),
    )  # fmt: skip
