"""A continuous-batching step's inputs prepared on the host and sent to the device in one copy.

Upstream's ``ContinuousBatchingIOs`` (transformers 5.24/5.25) keeps the step's inputs in tensors on the model's device
and prepares them there, step by step: a reset of the used slices (six fills), one host->device tensor per input
(``torch.tensor(..., device=...)`` then a slice copy: input ids, positions, the cumulative lengths, logits indices,
write and read indices), the per-row sampling arguments, and, for SDPA or eager attention, the attention mask built
block by block (a fill and a ``triu_`` per request). On a ``tpu`` device each of these is an eager op that torch_tpu
dispatches one by one (and compiles once per new shape: the host->device tensors have the unpadded lengths), about
26 ops a decode step at one request, 2 more per request (the mask blocks), and 8 host->device copies.

For the IO object of a ``tpu`` manager with hf_tpu's row sampling, :func:`install` moves them to the host:

* the bulk input tensor (input ids, positions, cumulative lengths, logits indices, the sampling rows), the write and
  read indices (held as int32, made int64 in the step graph) and a one-value flag live in one flat int32 tensor on
  the host (:class:`Staging`), with a twin of the same shape on the device; upstream's ``prepare_batch_tensors`` and
  ``_reset_static_tensors`` run unchanged on the host's views (the IO's ``device`` is the CPU for them), and
  ``get_model_kwargs`` first copies the whole flat tensor to the device (:meth:`Staging.push`: one host->device copy
  of one shape), then hands the forward the device twin's views;
* the attention mask is not built on the host nor sent: the step graph computes it from the cumulative lengths it
  already receives (:func:`masks`: the same 0 / dtype-minimum values as upstream's ``build_attention_mask``);
* the step's reset of ``output_ids`` (a device fill) is skipped: the step writes every row it reads back;
* the flag, set by :mod:`~hf_tpu.serving._chunks` for the 2nd..Kth step of a chunk, makes the step graph take its
  input ids from the previous step's tokens (``output_ids``, still on the device) instead of a device copy per step.

What stays per decode step: the one host->device copy, the step graph, and (in a chunk) the copy of the step's tokens
into the chunk's buffer; one device->host copy per chunk.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Staging", "feed_previous", "install", "masks", "model_kwargs", "prepare_in_graph", "reset"]

_STATIC_VIEWS = ("input_ids", "position_ids", "cumulative_seqlens_q", "logits_indices", "carry_over_ids")


class Staging:
    """The host tensor an IO object's step inputs are prepared in, and its device twin (see the module docstring).

    Attributes:
        host, device: the flat int32 tensors (same layout).
        feed: the device twin's flag (nonzero: the step's input ids are the previous step's tokens).
        mask_types: per attention layer type, the sliding window the step graph's mask applies (1: none); None when
            the attention implementation takes no mask.
        mask_dtype: the mask's dtype (the model's).
    """

    def __init__(self, io, mask_types: dict[str, int] | None) -> None:
        bulk = io._bulk_input_tensor
        writes, reads = io.write_index_storage, io.read_index_storage
        sizes = (bulk.numel(), writes.numel(), reads.numel(), 1)
        self.host = torch.zeros(sum(sizes), dtype=torch.int32)
        self.device = torch.zeros(sum(sizes), dtype=torch.int32, device=bulk.device)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._layout = {
            "_bulk_input_tensor": (starts[0], tuple(bulk.shape)),
            "write_index_storage": (starts[1], tuple(writes.shape)),
            "read_index_storage": (starts[2], tuple(reads.shape)),
        }
        self._flag = starts[3]
        self.feed = self.device[self._flag :]
        self.mask_types = mask_types
        self.mask_dtype = io.model_dtype
        self.host_views = self._views(io, self.host)
        self.device_views = self._views(io, self.device)
        self.spare_output = torch.zeros(io.output_ids.shape, dtype=io.output_ids.dtype)  # what the reset zeroes

    def _views(self, io, flat: torch.Tensor) -> dict[str, Any]:
        views: dict[str, Any] = {n: flat[a : a + _numel(s)].view(s) for n, (a, s) in self._layout.items()}
        bulk, old = views["_bulk_input_tensor"], io._bulk_input_tensor
        for name in _STATIC_VIEWS:  # upstream's rows of the bulk tensor, at the same offsets
            t = getattr(io, name)
            views[name] = bulk.as_strided(t.shape, t.stride(), t.storage_offset() - old.storage_offset())
        views["cumulative_seqlens_k"] = {
            k: bulk.as_strided(t.shape, t.stride(), t.storage_offset() - old.storage_offset())
            for k, t in io.cumulative_seqlens_k.items()
        }
        return views

    def push(self) -> None:
        """The one host->device copy of the step's inputs."""
        self.device.copy_(self.host)

    def set_feed(self, value: bool) -> None:
        self.host[self._flag] = int(value)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def install(io) -> None:
    """Stage ``io``'s step inputs on the host (module docstring); called once, after upstream's static tensors."""
    from transformers.generation.continuous_batching.utils import attn_mask_is_needed

    mask_types = None
    if io.attention_mask is not None and attn_mask_is_needed(io.config):
        window = getattr(io.config, "sliding_window", None) or 1
        mask_types = {k: (window if k == "sliding_attention" else 1) for k in io.cumulative_seqlens_k}
    staging = Staging(io, mask_types)
    defaults = torch.empty(io.logits_processors_defaults.shape, dtype=torch.int32)
    defaults.copy_(io.logits_processors_defaults)  # once: the sampling rows' defaults, read on the host from now on
    io.logits_processors_defaults = defaults
    io.__dict__.update(staging.host_views)
    io.carry_over_ids = staging.device_views["carry_over_ids"]  # (an input of the step graph, unused without async)
    io.attention_mask = None  # built in the step graph (masks), never on the host
    io.device = torch.device("cpu")  # where upstream's prepare_batch_tensors makes its tensors: the host views
    io._hf_tpu_staging = staging


def reset(io, full_reset: bool, upstream) -> None:
    """Upstream's ``_reset_static_tensors`` on the host views, without its device fill of ``output_ids`` (each step
    writes every row it reads back) except on a full reset; the input-ids flag goes back to 0."""
    staging = io.__dict__.get("_hf_tpu_staging")
    if staging is None or full_reset:
        upstream(io, full_reset)
    else:
        outputs = io.output_ids
        io.output_ids = staging.spare_output
        try:
            upstream(io, full_reset)
        finally:
            io.output_ids = outputs
    if staging is not None:
        staging.set_feed(False)


def model_kwargs(io, use_padding: bool, upstream) -> dict:
    """The one host->device copy of the step's inputs, then upstream's ``get_model_kwargs`` on the device views."""
    staging = io.__dict__.get("_hf_tpu_staging")
    if staging is None:
        return upstream(io, use_padding)
    staging.push()
    saved = {name: io.__dict__[name] for name in staging.device_views}
    io.__dict__.update(staging.device_views)
    try:
        kwargs = upstream(io, use_padding)
    finally:
        io.__dict__.update(saved)
    if staging.mask_types is not None:
        kwargs["is_causal"] = False  # (upstream's value with a mask; the mask itself is made in the step graph)
    return kwargs


def feed_previous(io) -> bool:
    """Make the step just prepared take its input ids from the previous step's tokens on the device (a chunk's 2nd..Kth
    step); False when ``io`` is not staged (the caller then copies them itself)."""
    staging = io.__dict__.get("_hf_tpu_staging")
    if staging is None:
        return False
    staging.set_feed(True)
    return True


def prepare_in_graph(staging: Staging, batch_data: dict, prev_output_ids) -> None:
    """Inside the step graph: the input ids (the previous step's tokens when the flag is set), the cache indices as
    int64, and the attention masks."""
    ids = batch_data["input_ids"]
    previous = prev_output_ids[:1, : ids.shape[-1]].to(ids.dtype)
    batch_data["input_ids"] = torch.where(staging.feed != 0, previous, ids)
    batch_data["write_index"] = [w.long() for w in batch_data["write_index"]]
    batch_data["read_index"] = [r.long() for r in batch_data["read_index"]]
    if staging.mask_types is not None:
        batch_data["attention_mask"] = masks(staging, batch_data)


def masks(staging: Staging, batch_data: dict):
    """The step's attention mask per layer type (one tensor when there is one type): ``[1, 1, q, k]``, 0 where a query
    token sees a key, the dtype's minimum elsewhere; what upstream's ``build_attention_mask`` writes block by block
    (each request's keys up to its causal diagonal, and within its sliding window), computed from the cumulative
    lengths."""
    q = batch_data["input_ids"].shape[-1]
    reads = batch_data["read_index"]
    k = reads[0].shape[0] if reads and reads[0].shape[0] > 0 else q
    cu_q = batch_data["cu_seq_lens_q"].long()
    device = cu_q.device
    lowest = torch.finfo(staging.mask_dtype).min
    out = {}
    for layer_type, window in staging.mask_types.items():
        cu_k = batch_data["cu_seq_lens_k"][layer_type].long()
        sequences = cu_q.shape[0] - 1
        rows = torch.arange(q, device=device)
        cols = torch.arange(k, device=device)
        row_seq = (rows[:, None] >= cu_q[None, 1:]).sum(-1)  # the sequence of each query token (past the last: all)
        col_seq = (cols[:, None] >= cu_k[None, 1:]).sum(-1)
        r = row_seq.clamp(max=sequences - 1)
        c = col_seq.clamp(max=sequences - 1)
        row_local, col_local = rows - cu_q[r], cols - cu_k[c]
        len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        reach = (len_k - len_q).clamp(min=0)[r]  # keys past the query's own position it may see (its past)
        distance = col_local[None, :] - row_local[:, None]
        seen = (row_seq[:, None] == col_seq[None, :]) & (row_seq[:, None] < sequences) & (distance <= reach[:, None])
        if window > 1:
            seen = seen & (distance > (len_k - len_q - window)[r][:, None])
        zero = torch.zeros((), dtype=staging.mask_dtype, device=device)
        out[layer_type] = torch.where(seen, zero, torch.full((), lowest, dtype=staging.mask_dtype, device=device))[
            None, None
        ]
    return next(iter(out.values())) if len(out) == 1 else out
