"""Where a decode step writes its new K/V rows (``HF_TPU_KV_WRITE``, hf_tpu/transformers/_cache/writes.py): in the
graph (upstream's ``index_copy_``), or after it (the graph reads the cache with the row selected in and leaves the
row to ``write_rows``, an in-place write after the graph). Both against upstream's ``generate`` on CPU."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.errors import InvalidArgumentError
from hf_tpu.transformers._cache import writes
from hf_tpu.transformers._cache.layer_classes import BucketedStaticLayer
from hf_tpu.transformers._settings import model_state

NEW = 12


def _cache_of(tpu, batch):
    """The model's pooled caches of ``batch`` rows."""
    return [c for key, c in model_state(tpu).caches.items() if key[0] == batch]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_rows_written_after_the_graph_equal_cpu_and_the_graph_holds_no_cache_write(llama, prompts, monkeypatch,
                                                                                    sampled):  # fmt: skip
    """``HF_TPU_KV_WRITE=after``: greedy and seeded sampled tokens of a left-padded batch equal the CPU's (and the
    in-graph write's); the decode graph's cache layers leave their rows unwritten, and after the call every row
    is in the cache; warmed, a second call compiles nothing."""
    cpu, tpu = llama
    ids, mask = prompts([5, 3, 7], seed=4)
    kwargs = dict(max_new_tokens=NEW, do_sample=sampled, **({"top_k": 20} if sampled else {}))
    monkeypatch.setenv(writes.KV_WRITE_ENV, "graph")
    torch.manual_seed(1)
    in_graph = tpu.generate(ids, attention_mask=mask, **kwargs)
    monkeypatch.setenv(writes.KV_WRITE_ENV, "after")
    torch.manual_seed(1)
    after = tpu.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(after, in_graph)
    if not sampled:
        assert torch.equal(after, cpu.generate(ids, attention_mask=mask, **kwargs))
    cache = _cache_of(tpu, 3)[0]
    layers = [layer for layer in cache.layers if isinstance(layer, BucketedStaticLayer)]
    assert layers and all(layer.hf_tpu_rows_after and layer.hf_tpu_rows is None for layer in layers)
    # every slot from the longest prompt's first token on holds a key: the prompt's, then one per decode step (the
    # last token is never fed back); the bucket's left padding before it (the pad id's embedding row is zeros) and
    # the slots after it none
    written = int(layers[0].cumulative_length)
    bucket = written - (NEW - 1)
    for layer in layers:
        held = layer.keys.abs().sum(-1).gt(0).any(0).any(0).cpu()
        assert held[bucket - ids.shape[1] : written].all() and not held[written:].any()
    with hf_tpu.sim.stats() as s:
        torch.manual_seed(1)
        again = tpu.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(again, after) and s.compiles == 0


def test_the_decode_step_after_the_graph_writes_the_row_the_graph_would(llama):
    """One decode update of a layer with its rows left for after the graph: the keys and values the attention reads
    equal upstream's in-place update's, the cache is unchanged until ``write_rows``, then equals it."""
    layer = BucketedStaticLayer(max_cache_len=8)
    keys = torch.randn(2, 3, 0, 4, device="tpu")
    layer.lazy_initialization(keys, keys)
    reference = BucketedStaticLayer(max_cache_len=8)
    reference.lazy_initialization(keys, keys)
    prompt = torch.randn(2, 3, 5, 4)
    layer.update(prompt.to("tpu"), prompt.to("tpu") * 2)
    reference.update(prompt.to("tpu"), prompt.to("tpu") * 2)
    layer.hf_tpu_rows_after = True
    row = torch.randn(2, 3, 1, 4)
    before = layer.keys.cpu().clone()
    k, v = layer.update(row.to("tpu"), row.to("tpu") * 3)
    k_ref, v_ref = reference.update(row.to("tpu"), row.to("tpu") * 3)
    assert torch.equal(k.cpu(), k_ref.cpu()) and torch.equal(v.cpu(), v_ref.cpu())
    assert torch.equal(layer.keys.cpu(), before) and int(layer.cumulative_length) == 6
    cache = type("C", (), {"layers": [layer]})()
    writes.write_rows(cache)
    assert torch.equal(layer.keys.cpu(), reference.keys.cpu()) and torch.equal(layer.values.cpu(), reference.values.cpu())
    assert layer.hf_tpu_rows is None


def test_auto_writes_after_the_graph_only_for_large_caches_on_a_tpu(monkeypatch):
    """``auto`` (the default): rows after the graph once each full-attention layer's keys and values hold
    ``KV_ROWS_AFTER_LAYER_BYTES``, on a ``tpu`` device only; ``graph`` never, ``after`` always on a tpu; another
    value is an error naming the choices."""
    def cache(device, slots, layers=1):
        built = []
        for _ in range(layers):
            layer = BucketedStaticLayer(max_cache_len=slots)
            empty = torch.zeros(1, 1, 0, 8, device=device)
            layer.lazy_initialization(empty, empty)
            built.append(layer)
        return type("C", (), {"layers": built})()

    monkeypatch.delenv(writes.KV_WRITE_ENV, raising=False)
    monkeypatch.setattr(writes, "KV_ROWS_AFTER_LAYER_BYTES", 2 * 16 * 8 * 4)  # float32 K and V of 16 slots x 8
    assert writes.kv_rows_after(cache("tpu", 16)) and not writes.kv_rows_after(cache("tpu", 15))
    assert writes.kv_rows_after(cache("tpu", 16, layers=3)) and not writes.kv_rows_after(cache("tpu", 15, layers=3))
    assert not writes.kv_rows_after(cache("cpu", 64))
    monkeypatch.setenv(writes.KV_WRITE_ENV, "graph")
    assert not writes.kv_rows_after(cache("tpu", 64))
    monkeypatch.setenv(writes.KV_WRITE_ENV, "after")
    assert writes.kv_rows_after(cache("tpu", 2)) and not writes.kv_rows_after(cache("cpu", 2))
    monkeypatch.setenv(writes.KV_WRITE_ENV, "later")
    with pytest.raises(InvalidArgumentError, match="auto, graph, after"):
        writes.kv_rows_after(cache("tpu", 2))


def test_beam_search_keeps_the_write_in_its_graph(llama, prompts, monkeypatch):
    """Beam search reorders the cache in its graphs: its decode steps write in the graph even with ``after``, and
    its beams equal the CPU's."""
    cpu, tpu = llama
    ids, mask = prompts([4, 6], seed=2)
    monkeypatch.setenv(writes.KV_WRITE_ENV, "after")
    kwargs = dict(max_new_tokens=6, num_beams=2, do_sample=False)
    assert torch.equal(tpu.generate(ids, attention_mask=mask, **kwargs), cpu.generate(ids, attention_mask=mask, **kwargs))
    cache = _cache_of(tpu, 4)
    assert cache and not any(getattr(layer, "hf_tpu_rows_after", False) for layer in cache[0].layers)


def test_the_jax_writer_writes_what_index_copy_writes(monkeypatch):
    """``HF_TPU_KV_ROWS_WRITER``: the JAX program that writes every layer's row in one call (run on the JAX CPU
    backend here) writes what upstream's ``index_copy_`` writes, in float32 and bfloat16; ``write_rows`` with it
    (its torch_tpu bridge, the one part that needs a chip, stood in by a call of the same JAX function) ``set_``s each
    cache to the written buffer, equal to the ``index_copy_`` writer's. ``auto`` takes ``index_copy`` on the
    simulator; ``jax`` there, or an unknown value, is an error that names the fix."""
    import jax.numpy as jnp
    import numpy as np

    def to_jax(t):
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32)

    for dtype in (torch.float32, torch.bfloat16):
        caches = [torch.randn(2, 3, 8, 4).to(dtype) for _ in range(4)]
        rows = [torch.randn(2, 3, 1, 4).to(dtype) for _ in range(4)]
        want = [c.clone().index_copy_(2, torch.tensor([5]), r) for c, r in zip(caches, rows)]
        got = writes.jax_write_rows([to_jax(c) for c in caches], [to_jax(r) for r in rows], jnp.array([5], jnp.int32))
        for g, w in zip(got, want):
            assert np.array_equal(np.asarray(g.astype(jnp.float32)), w.float().numpy())

    def layers_with_rows():
        built = []
        for _ in range(2):
            layer = BucketedStaticLayer(max_cache_len=8)
            prompt = torch.randn(2, 3, 5, 4)
            layer.lazy_initialization(prompt.to("tpu"), prompt.to("tpu"))
            layer.update(prompt.to("tpu"), prompt.to("tpu") * 2)
            layer.hf_tpu_rows_after = True
            layer.update(torch.randn(2, 3, 1, 4).to("tpu"), torch.randn(2, 3, 1, 4).to("tpu"))
            built.append(layer)
        return type("C", (), {"layers": built})()

    monkeypatch.delenv(writes.KV_ROWS_WRITER_ENV, raising=False)
    torch.manual_seed(3)
    by_index_copy = layers_with_rows()
    assert writes.kv_rows_writer(by_index_copy.layers[0].keys) == "index_copy"  # the simulator's tpu
    writes.write_rows(by_index_copy)

    def bridge(caches, rows, slot):  # what torch.tpu.pallas.jax_op runs on a chip: the JAX function on the buffers
        out = writes.jax_write_rows([to_jax(c.cpu()) for c in caches], [to_jax(r.cpu()) for r in rows],
                                    jnp.asarray(slot.cpu().numpy()))  # fmt: skip
        return [torch.from_numpy(np.asarray(o)).to("tpu") for o in out]

    monkeypatch.setattr(writes, "_torch_tpu_tensor", lambda tensor: True)
    monkeypatch.setattr(writes, "_jax_rows_writer", lambda: bridge)
    torch.manual_seed(3)
    by_jax = layers_with_rows()
    assert writes.kv_rows_writer(by_jax.layers[0].keys) == "jax"
    before = [layer.keys for layer in by_jax.layers]
    writes.write_rows(by_jax)
    for layer, ref, tensor in zip(by_jax.layers, by_index_copy.layers, before):
        assert layer.keys is tensor and layer.hf_tpu_rows is None  # the same tensor, set_ to the written buffer
        assert torch.equal(layer.keys.cpu(), ref.keys.cpu()) and torch.equal(layer.values.cpu(), ref.values.cpu())
    monkeypatch.undo()
    monkeypatch.setenv(writes.KV_ROWS_WRITER_ENV, "jax")
    with pytest.raises(InvalidArgumentError, match="needs torch_tpu's tpu device"):
        writes.kv_rows_writer(torch.zeros(1, device="tpu"))
    monkeypatch.setenv(writes.KV_ROWS_WRITER_ENV, "scatter")
    with pytest.raises(InvalidArgumentError, match="auto, index_copy, jax"):
        writes.kv_rows_writer(torch.zeros(1, device="tpu"))
