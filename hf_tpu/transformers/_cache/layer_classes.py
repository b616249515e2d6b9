"""The bucketed layer classes of :mod:`hf_tpu.transformers._cache.static` (defined at module level: the persistent
compile cache saves graphs that refer to them by name). Imported on first use, so ``import hf_tpu`` stays light."""

from __future__ import annotations

from transformers import cache_utils as cu

__all__ = ["BUCKETED_LAYERS"]


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


class BucketedStaticLayer(cu.StaticLayer):
    """A full-attention layer of a bucketed cache: upstream's ``StaticLayer``, whose decode step can leave the cache
    unwritten (``hf_tpu_rows_after``, set by :func:`~hf_tpu.transformers._cache.static.set_decoding`).

    Then a one-token update attends over the cache with the new row selected in at its slot
    (``where(slot == position, row, cache)``, which XLA fuses into the attention's reads) and keeps the row and its
    position in ``hf_tpu_rows``; the loop writes them in place after the graph
    (:func:`~hf_tpu.transformers._cache.writes.write_rows`). A graph that does not write its cache returns no updated
    cache: torch_tpu 0.2.0's ``torch.compile`` donates no buffers, so a cache the graph updates is copied whole every
    step (docs/planning.md, "Measured on a chip")."""

    # (build_layers sets both on each instance too: dynamo guards on the flag alike before and after the loop sets it)
    hf_tpu_rows_after = False
    hf_tpu_rows = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not (self.hf_tpu_rows_after and key_states.shape[-2] == 1):
            return super().update(key_states, value_states, *args, **kwargs)
        import torch

        position = self.cumulative_length + 0  # (this step's slot, before the counter moves on)
        self.cumulative_length.add_(1)
        here = (torch.arange(self.max_cache_len, device=self.device) == position).view(1, 1, -1, 1)
        # (in the cache's dtype, as upstream's index_copy_ stores them)
        key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        # (the slot twice: int64 for index_copy_, int32 for the JAX writer; a cast after the graph would be an eager
        # op of its own every step on torch_tpu)
        self.hf_tpu_rows = (key_states, value_states, position.view(1), position.view(1).to(torch.int32))
        return torch.where(here, key_states, self.keys), torch.where(here, value_states, self.values)

    # (no reset of its own: hf_tpu resets its caches with hf_tpu.transformers._cache.static.reset_cache, which clears
    # both flags too, so a warmed call's reset runs no function of this module)


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

class HostLengthLayer(cu.StaticLayer):
    """A full-attention layer whose ``get_seq_length`` is a host int the loop sets before each graph
    (``hf_tpu_length``), not the device counter: for a model whose own code branches on its cache length, or
    builds a range from it (``torch.arange(length, length + n)``), which a device value cannot be in one graph. The
    decode graph takes the int as a dynamic size (one graph for every length); the counter still places the keys."""

    hf_tpu_length = 0

    def get_seq_length(self):
        import torch

        # the symbol's range: torch-tpu's dynamic compiler sizes the program for its upper bound (2x the first value
        # when it has none)
        torch._check(self.hf_tpu_length >= 0)
        torch._check(self.hf_tpu_length <= self.max_cache_len)
        return self.hf_tpu_length


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


BUCKETED_LAYERS: dict[type, type] = {
    cu.StaticLayer: BucketedStaticLayer,
    cu.StaticSlidingWindowLayer: BucketedSlidingWindowLayer,
    cu.StaticIndexedLayer: cu.StaticIndexedLayer,
    cu.LinearAttentionLayer: BucketedLinearAttentionLayer,
    cu.LinearAttentionAndStaticFullAttentionLayer: BucketedHybridLayer,
    cu.LinearAttentionAndStaticSlidingWindowAttentionLayer: BucketedHybridSlidingLayer,
    cu.DummyLayer: cu.DummyLayer,
}
