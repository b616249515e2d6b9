"""Where a decode step's new K/V rows are written into a full-attention static cache on a ``tpu`` device
(``HF_TPU_KV_WRITE``), and how the rows a decode graph left are written after it (``HF_TPU_KV_ROWS_WRITER``).

A graph that writes its cache (upstream's ``index_copy_``) and is not donated its buffers copies every layer's keys
and values each step; for large caches the decode graph reads the cache with the new row selected in and leaves the
row (:func:`kv_rows_after`, read by :func:`~hf_tpu.transformers._cache.static.set_decoding`), and :func:`write_rows`
writes it in place after the graph: on torch_tpu by one JAX program for every layer with the caches donated
(:func:`jax_write_rows`), else one eager ``index_copy_`` per layer. The bucketed layer that leaves its row is
:class:`~hf_tpu.transformers._cache.layer_classes.BucketedStaticLayer`; what runs here runs on the host, outside the
graphs.
"""

from __future__ import annotations

from hf_tpu import _env
from hf_tpu.errors import InvalidArgumentError

__all__: list[str] = []


# HF_TPU_KV_WRITE: where a decode step's new K/V rows are written into a full-attention cache on a ``tpu`` device.
KV_WRITE_ENV = _env.KV_WRITE.name
KV_WRITES = _env.KV_WRITE.choices
# auto: after the graph once each full-attention layer's K and V hold this many bytes: then the copy an undonated
# graph makes of them (~3.2 ms per GB on a v5e) costs more than the layer's two writes after the graph (each a
# program of its own, ~45-60 us to launch). Measured on a v5e (docs/planning.md, runs 12 and 13), hf_tpu's decode
# program with the write in its graph against the rows written after it: the Llama-3.2-1B shape at batch 64 (84 MB
# per layer) 13.78 -> 9.54 ms, the 8-layer Qwen3-30B-A3B shape at batch 64 (84 MB per layer) 18.82 -> 16.01 ms; at
# batch 8 (10.5 MB per layer) a lean step written that way ran 1.46x one that writes in its graph.
KV_ROWS_AFTER_LAYER_BYTES = 32 << 20


def kv_write_mode() -> str:
    """``HF_TPU_KV_WRITE`` (``auto`` when unset): ``graph`` (the graph writes the cache, upstream's ``index_copy_``),
    ``after`` (the rows are written after each decode graph, :func:`write_rows`) or ``auto``: the ``kv_write`` kernel
    form's lookup (:func:`hf_tpu.kernels.forms.choose_form`)."""
    from hf_tpu.kernels.forms import choose_form

    return choose_form("kv_write")


def kv_rows_after(cache) -> bool:
    """Whether the decode steps of ``cache``'s full-attention layers leave their rows to :func:`write_rows`: on a
    ``tpu`` device, per :func:`kv_write_mode` (``auto``: when those layers' keys and values hold
    ``KV_ROWS_AFTER_LAYER_BYTES`` per layer)."""
    from hf_tpu.transformers._cache.layer_classes import BucketedStaticLayer

    layers = [layer for layer in cache.layers if isinstance(layer, BucketedStaticLayer) and layer.is_initialized]
    if not layers or layers[0].keys.device.type != "tpu":
        return False
    mode = kv_write_mode()
    if mode != "auto":
        return mode == "after"
    held = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    return held >= KV_ROWS_AFTER_LAYER_BYTES * len(layers)


#: ``HF_TPU_KV_ROWS_WRITER`` (``auto`` when unset): how :func:`write_rows` writes the rows a decode graph left:
#: ``index_copy`` (one eager in-place ``index_copy_`` per layer's keys and values), ``jax`` (one program for every
#: layer, its caches donated: :func:`_jax_rows_writer`, torch_tpu's device and ``jax`` needed) or ``auto`` (``jax``
#: where it can run, else ``index_copy``). On a v5e with torch_tpu 0.2.0 the 32 eager writes of a batch-64
#: Llama-3.2-1B-shaped cache cost 6.5 ms a step (each a program of its own, run 14); with this writer run 17 measured
#: that batch-64 ``generate`` step 13.09 -> 8.65 ms, the same tokens (docs/chip_v5e_torch_tpu.jsonl).
KV_ROWS_WRITER_ENV = _env.KV_ROWS_WRITER.name
KV_ROWS_WRITERS = _env.KV_ROWS_WRITER.choices
_JAX_WRITER: list = []  # the jax_op, made once per process (registering it twice under one name fails)


def kv_rows_writer(tensor) -> str:
    """The writer :func:`write_rows` uses for a cache held in ``tensor``'s device, per ``HF_TPU_KV_ROWS_WRITER``.

    Raises:
        ValueError (InvalidArgumentError): an unknown value, or ``jax`` where it cannot run (not torch_tpu's
            device, or ``jax`` not installed).
    """
    from hf_tpu.kernels.forms import choose_form

    mode = choose_form("kv_rows_writer")
    if mode == "index_copy":
        return mode
    can = _torch_tpu_tensor(tensor) and _jax_importable()
    if mode == "jax" and not can:
        raise InvalidArgumentError(
            f"{KV_ROWS_WRITER_ENV}=jax writes the KV rows through torch.tpu.pallas.jax_op: it needs torch_tpu's tpu "
            "device (not the simulator's) and jax (pip install 'hf-tpu[tpu]'); unset it or use index_copy."
        )
    return "jax" if can else "index_copy"


def _torch_tpu_tensor(tensor) -> bool:
    import sys

    if tensor.device.type != "tpu":
        return False
    sim = sys.modules.get("hf_tpu.sim")
    return sim is None or not sim.is_sim_tensor(tensor)


_JAX_FOUND: list[bool] = []


def _jax_importable() -> bool:
    if not _JAX_FOUND:  # (write_rows asks every decode step: look it up once)
        import importlib.util

        _JAX_FOUND.append(importlib.util.find_spec("jax") is not None)
    return _JAX_FOUND[0]


def jax_write_rows(caches, rows, slot):
    """Every cache with its row written at ``slot[0]`` on axis 2 (JAX arrays): ``(batch, heads, slots, dim)`` caches,
    ``(batch, heads, 1, dim)`` rows. The program :func:`_jax_rows_writer` registers; with its caches donated, XLA
    writes each in place."""
    import jax

    return [jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), slot[0], axis=2)
            for c, r in zip(caches, rows, strict=True)]  # fmt: skip


def _jax_rows_writer():
    """:func:`jax_write_rows` as a torch op through torch_tpu's JAX bridge (``torch.tpu.pallas.jax_op``), its caches
    donated (``donate_argnums=(0,)``: the bridge's docs say a donated tensor is invalid after the call, and to
    ``set_`` it to the result), made once per process."""
    if not _JAX_WRITER:
        import jax
        import torch

        def write(caches, rows, slot):
            return jax_write_rows(caches, rows, slot)

        # jax_op reads the types from the annotations (evaluated here: this module's annotations are strings)
        write.__annotations__ = {"caches": list[jax.Array], "rows": list[jax.Array], "slot": jax.Array,
                                 "return": list[jax.Array]}  # fmt: skip
        _JAX_WRITER.append(torch.tpu.pallas.jax_op("hf_tpu::write_kv_rows", write, donate_argnums=(0,)))
    return _JAX_WRITER[0]


def write_rows(cache) -> None:
    """Write the rows a decode graph left in ``cache``'s layers (``hf_tpu_rows``) at their slots, in place, with the
    writer :func:`kv_rows_writer` picks: one ``index_copy_`` per layer's keys and values (on torch_tpu an eager
    in-place op, which updates its buffer in place: ``torch_tpu._internal.execution_mode.
    disable_inplace_buffer_donation`` is False by default), or on torch_tpu one JAX program for every layer with the
    caches donated, each cache then ``set_`` to its written buffer."""
    self_cache = getattr(cache, "self_attention_cache", cache)
    layers = [layer for layer in getattr(self_cache, "layers", ()) if getattr(layer, "hf_tpu_rows", None) is not None]
    if not layers:
        return
    if kv_rows_writer(layers[0].keys) == "jax":
        caches = [t for layer in layers for t in (layer.keys, layer.values)]
        rows = [r for layer in layers for r in layer.hf_tpu_rows[:2]]
        for tensor, written in zip(caches, _jax_rows_writer()(caches, rows, layers[0].hf_tpu_rows[3]), strict=True):
            tensor.set_(written)
    else:
        for layer in layers:
            keys, values, position, _ = layer.hf_tpu_rows
            layer.keys.index_copy_(2, position, keys)
            layer.values.index_copy_(2, position, values)
    for layer in layers:
        layer.hf_tpu_rows = None
