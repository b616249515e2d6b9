"""The bucketed static form of each of upstream's cache layer kinds, as a registry keyed by upstream's layer class.

hf_tpu's loop runs one compiled prefill graph per (prompt bucket, cache bucket) and one decode graph per cache
bucket, so a cache layer may change only tensors inside a graph, never the Python state dynamo guards on (an int
that grows per step would compile a new graph per step). Upstream's ``StaticCache`` (transformers 5.24) builds its
layers from ``config.layer_types`` with ``STATIC_LAYER_TYPE_MAPPING``; :data:`BUCKETED_LAYERS` maps each of those
classes to its bucketed form:

* full attention (``StaticLayer``): upstream's own class, ``cache bucket`` slots written at a device-side counter;
* sliding window (``StaticSlidingWindowLayer``, chunked attention too): upstream's layer tracks the window with a
  Python int (a new graph per step until the window fills). The bucketed layer keeps one slot per cache position, as
  a full-attention layer does, and reports ``(cache bucket, 0)`` as its mask sizes; the window itself is the
  ``sliding_window`` overlay of upstream's sliding mask, which compares absolute cache indices, so the same tokens
  are attended as in upstream's ring (a cache bucket never holds more slots than the full-attention layers);
* linear attention / SSM (``LinearAttentionLayer``: conv and recurrent states of a fixed size): upstream flips
  ``has_previous_state`` inside the forward; here the loop sets it on the host (:func:`set_decoding`): off for the
  prefill graph, on for the decode graph. The left padding of a bucketed prompt leaves the states as the unpadded
  prompt would: upstream's recurrent mask zeroes padded inputs (the loop hands the prefill the prompt's own mask)
  and a zero input on a zero state leaves it zero;
* hybrid layers (``LinearAttentionAndStaticFullAttentionLayer``, ``...SlidingWindowAttentionLayer``): both of the
  above in one layer;
* ``DummyLayer`` (shared-KV or attention-free layers): holds nothing, kept as is.

Each layer is allocated ahead of the first graph with the shapes the model's own attention writes
(:mod:`hf_tpu.transformers._cache_probe`), so multi-query, multi-latent and unequal encoder/decoder attention get
the cache they fill. A model whose layers are all of these kinds needs no change here.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


def _static_update(self, key_states, value_states, *args, **kwargs):
    import torch

    kv_length = key_states.shape[-2]
    cache_position = torch.arange(kv_length, device=self.device) + self.cumulative_length
    self.cumulative_length.add_(kv_length)
    self.keys.index_copy_(2, cache_position, key_states)
    self.values.index_copy_(2, cache_position, value_states)
    return self.keys, self.values


def _full_mask_sizes(self, query_length: int) -> tuple[int, int]:
    return self.max_cache_len, 0


def _tensor_seq_length(self):
    return self.cumulative_length if self.is_initialized else 0


def _reset_counter(self) -> None:
    if self.is_initialized:
        self.keys.zero_()
        self.values.zero_()
        self.cumulative_length.zero_()


def _ring_update(self, key_states, value_states):
    """The ring of a sliding-window layer, oldest slot first: the prefill keeps the prompt's last ``window`` states
    (right-aligned, zeros before them) and attends to the prompt's own states; a decode step shifts the ring by one,
    writes the new state last and attends to the ring."""
    import torch

    window = self.max_cache_len
    length = key_states.shape[-2]
    self.cumulative_length.add_(length)
    if self.decoding:
        self.keys.copy_(torch.cat([self.keys[:, :, length:], key_states], dim=-2))
        self.values.copy_(torch.cat([self.values[:, :, length:], value_states], dim=-2))
        return self.keys, self.values
    if length >= window:
        self.keys.copy_(key_states[:, :, -window:])
        self.values.copy_(value_states[:, :, -window:])
    else:
        self.keys.copy_(torch.nn.functional.pad(key_states, (0, 0, window - length, 0)))
        self.values.copy_(torch.nn.functional.pad(value_states, (0, 0, window - length, 0)))
    return key_states, value_states


def _host_conv_update(self, conv_states, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs):
    """``update_conv_state`` without upstream's in-graph flip of ``has_previous_state`` (the loop sets it)."""
    import torch

    kernel = self.conv_kernel_size[state_idx]
    if not self.has_previous_state[state_idx]:
        full = conv_states
        if full.shape[-1] < kernel:
            full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
    else:
        full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
    self.conv_states[state_idx].copy_(full[..., -kernel:])
    return full


def _bucketed_classes() -> dict[type, type]:
    from transformers import cache_utils as cu

    class BucketedSlidingWindowLayer(cu.StaticSlidingWindowLayer):
        """A sliding-window layer of a bucketed cache: a ring of ``sliding_window`` slots when the cache bucket is
        longer than the window, else one slot per cache position (the sliding mask applies the window)."""

        def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
            self.ring = max_cache_len > sliding_window
            cu.StaticLayer.__init__(self, max_cache_len=sliding_window if self.ring else max_cache_len)
            self.sliding_window = sliding_window
            self.bucket_len = max_cache_len
            self.decoding = False
            self.cumulative_length_int = 0
            self._is_croppable = False

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.ring:
                return _static_update(self, key_states, value_states)
            return _ring_update(self, key_states, value_states)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            if not self.ring:
                return self.max_cache_len, 0
            # prefill: the prompt's own keys; decode: the ring, read through the mask columns decode_mask appends
            return (self.max_cache_len, self.bucket_len) if self.decoding else (query_length, 0)

        def get_seq_length(self):
            if self.ring and self.decoding:
                return self.bucket_len + self.max_cache_len - 1  # every ring slot is causal and inside the window
            return _tensor_seq_length(self)

        def reset(self) -> None:
            _reset_counter(self)
            self.decoding = False

    class BucketedLinearAttentionLayer(cu.LinearAttentionLayer):
        """Conv and recurrent states of a fixed size; ``has_previous_state`` is set by the loop, not the graph."""

        update_conv_state = _host_conv_update

    class BucketedHybridLayer(cu.LinearAttentionAndStaticFullAttentionLayer):
        update_conv_state = _host_conv_update

    class BucketedHybridSlidingLayer(cu.LinearAttentionAndStaticSlidingWindowAttentionLayer):
        def __init__(self, max_cache_len: int, sliding_window: int, number_of_states: int = 1, **kwargs):
            cu.StaticLayer.__init__(self, max_cache_len=max_cache_len)
            cu.LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
            self.sliding_window = sliding_window
            self.cumulative_length_int = 0
            self._is_croppable = False

        update_conv_state = _host_conv_update
        update = _static_update
        get_mask_sizes = _full_mask_sizes
        get_seq_length = _tensor_seq_length

        def reset(self) -> None:
            cu.LinearAttentionLayer.reset(self)
            _reset_counter(self)

    return {
        cu.StaticLayer: cu.StaticLayer,
        cu.StaticSlidingWindowLayer: BucketedSlidingWindowLayer,
        cu.LinearAttentionLayer: BucketedLinearAttentionLayer,
        cu.LinearAttentionAndStaticFullAttentionLayer: BucketedHybridLayer,
        cu.LinearAttentionAndStaticSlidingWindowAttentionLayer: BucketedHybridSlidingLayer,
        cu.DummyLayer: cu.DummyLayer,
    }


_REGISTRY: dict[type, type] | None = None


def bucketed_layers() -> dict[type, type]:
    """Upstream static layer class -> its bucketed form (built on first use: ``import hf_tpu`` stays light)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _bucketed_classes()
    return _REGISTRY


def layer_plan(config) -> list[tuple[type, dict[str, Any]]]:
    """``(upstream static layer class, its constructor kwargs)`` per decoder layer, as ``StaticCache`` builds them."""
    from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    layer_types, per_layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [(STATIC_LAYER_TYPE_MAPPING[t], kw) for t, kw in zip(layer_types, per_layer_kwargs)]


def unknown_layers(config) -> list[str]:
    """Names of the upstream layer classes in this config's static cache that have no bucketed form."""
    registry = bucketed_layers()
    return sorted({cls.__name__ for cls, _ in layer_plan(config) if cls not in registry})


def build_layers(config, cache_len: int, shapes: list[dict], batch: int, dtype, device) -> list:
    """The bucketed layers of a ``cache_len`` cache, allocated with the probed ``shapes`` (one dict per layer)."""
    import torch

    registry = bucketed_layers()
    layers = []
    for (cls, kwargs), shape in zip(layer_plan(config), shapes):
        layer = registry[cls](max_cache_len=cache_len, **kwargs)
        kv = shape.get("kv")
        if kv is not None:
            heads, k_dim, v_dim, kv_dtype = kv
            kv_dtype = dtype if kv_dtype is None else kv_dtype
            keys = torch.zeros((batch, heads, 0, k_dim), dtype=kv_dtype, device=device)
            values = torch.zeros((batch, heads, 0, v_dim), dtype=kv_dtype, device=device)
            layer.lazy_initialization(keys, values)
        for idx, (state_shape, state_dtype) in shape.get("conv", {}).items():
            state = torch.zeros((batch, *state_shape), dtype=dtype if state_dtype is None else state_dtype)
            layer.lazy_initialization(conv_states=state.to(device), state_idx=idx)
        for idx, (state_shape, state_dtype) in shape.get("recurrent", {}).items():
            state = torch.zeros((batch, *state_shape), dtype=dtype if state_dtype is None else state_dtype)
            layer.lazy_initialization(recurrent_states=state.to(device), state_idx=idx)
        layers.append(layer)
    return layers


def set_decoding(cache, decoding: bool) -> None:
    """Tell the layers of ``cache`` whether the next graph decodes (continues from their states) or prefills."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    self_cache = getattr(cache, "self_attention_cache", cache)
    for layer in self_cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for idx in layer.has_previous_state:
                layer.has_previous_state[idx] = decoding
        if getattr(layer, "ring", False):
            layer.decoding = decoding


def decode_mask(cache, mask):
    """The 2D mask a decode step hands the model: ``mask`` (one column per cache position), followed, when the cache
    has sliding-window rings, by one column per ring slot saying whether the position it holds is a real token.

    The ring layers report ``(window, cache length)`` as their mask sizes, so upstream's sliding mask reads exactly
    these columns; the full-attention layers read the first ``cache length`` ones as before. Runs inside the decode
    graph (the ring's position is its device-side counter): no copy per step."""
    import torch

    ring = next((la for la in getattr(cache, "layers", ()) if getattr(la, "ring", False)), None)
    if ring is None:
        return mask
    window = ring.max_cache_len
    # the ring holds positions counter - window + 1 ... counter (the token this step writes)
    positions = ring.cumulative_length + 1 - window + torch.arange(window, device=mask.device)
    real = mask.index_select(1, positions.clamp(min=0)) & (positions >= 0)
    return torch.cat([mask, real], dim=1)
