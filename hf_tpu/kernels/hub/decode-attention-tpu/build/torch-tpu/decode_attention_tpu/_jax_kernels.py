"""The JAX side of the kernel: one-token (decode) attention over a static cache as a ragged Pallas TPU kernel.

A decode step's cache is static: keys and values ``(batch, kv_heads, slots, head_dim)`` whose rows are filled to
different lengths (a left-padded batch: each row's valid slots start after its padding; a bucketed cache: slots past
the longest row hold nothing yet). ``mask`` (batch, slots) marks the valid slots. The kernel reads, per row, only the
blocks of slots between the row's first and last valid slot:

- grid (batch, kv_heads, slot blocks); the row's first valid slot and one past its last (``starts``, ``ends``, from
  the mask) are scalar-prefetched, and the key/value/mask blocks' index maps clamp the block index into the row's
  range, so a block outside it repeats the previous block's index and no new copy is made; its step computes
  nothing;
- all query heads of one KV head are the rows of one block (grouped-query attention: the KV block is read once for
  the group);
- online softmax across the blocks in float32 (running max, running sum, accumulator in VMEM scratch); the scores
  are summed in float32 from the operands as they are, each block's numerator ``exp(s - running max)`` is rounded
  to the value dtype for the second product (the order of arithmetic of a flash kernel);
- a row with no valid slot gives zeros.

Inside the range the mask is applied slot by slot, so a mask with holes gives the masked attention too; it just reads
the holes' blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["block_slots", "decode_attention_device", "decode_attention_pallas", "decode_attention_xla", "row_ranges"]

#: The largest slot block the kernel takes (the two K/V blocks, double-buffered, stay a few MiB of VMEM).
MAX_BLOCK = 2048
#: VMEM the K and V blocks may take together, double-buffered.
KV_VMEM_BUDGET = 8 * 1024 * 1024


def block_slots(slots: int, head_dim: int, itemsize: int) -> int:
    """The slot block for a cache of ``slots`` slots: the largest of 2048, 1024, ..., 128 that divides ``slots`` and
    keeps two double-buffered K/V blocks in :data:`KV_VMEM_BUDGET`; ``slots`` itself (one block) for a cache not
    a multiple of 128 that fits; else 0 (the caller pads the cache to a multiple of 128)."""
    def fits(block: int) -> bool:
        return 4 * block * head_dim * itemsize <= KV_VMEM_BUDGET

    if slots % 128 == 0:
        block = MAX_BLOCK
        while block > 128 and (slots % block or not fits(block)):
            block //= 2
        return block
    return slots if slots <= MAX_BLOCK and fits(slots) else 0


def row_ranges(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's first valid slot and one past its last, int32 ``(batch,)`` each; ``(0, 0)`` for a row with none."""
    valid = mask.astype(jnp.bool_)
    slots = valid.shape[-1]
    any_valid = valid.any(axis=-1)
    first = jnp.argmax(valid, axis=-1).astype(jnp.int32)
    last = slots - jnp.argmax(valid[:, ::-1], axis=-1).astype(jnp.int32)
    return jnp.where(any_valid, first, 0), jnp.where(any_valid, last, 0)


def _kernel(starts_ref, ends_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, block):
    from jax.experimental import pallas as pl

    b = pl.program_id(0)
    j = pl.program_id(2)
    start = starts_ref[b]
    end = ends_ref[b]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    lo = j * block

    @pl.when(jnp.logical_and(lo < end, lo + block > start))
    def _block():
        q = q_ref[0, 0]  # (group, head_dim)
        k = k_ref[0, 0]  # (block, head_dim)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        valid = mask_ref[0] != 0  # (1, block)
        s = jnp.where(valid, s, -jnp.inf)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a block (so far) without a valid slot: exp(-inf) = 0
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = alpha * l_sc[...] + p.sum(axis=-1, keepdims=True)
        v = v_ref[0, 0]  # (block, v_dim)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        total = l_sc[...]
        out = jnp.where(total > 0, acc_sc[...] / jnp.where(total > 0, total, 1.0), 0.0)
        o_ref[0, 0] = out.astype(o_ref.dtype)


def _grouped(query: jax.Array, kv_heads: int) -> jax.Array:
    """``(batch, heads, 1, head_dim)`` -> ``(batch, kv_heads, group, head_dim)``: the query heads of KV head ``j``."""
    batch, heads, one, dim = query.shape
    if one != 1 or heads % kv_heads:
        raise ValueError(
            f"decode_attention: query {tuple(query.shape)} must be (batch, heads, 1, head_dim) with heads a multiple "
            f"of the {kv_heads} KV heads"
        )
    return query.reshape(batch, kv_heads, heads // kv_heads, dim)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block"))
def decode_attention_pallas(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    interpret: bool = False,
    block: int | None = None,
) -> jax.Array:
    """Decode attention as the ragged Pallas TPU kernel (``interpret=True`` runs the same kernel body on CPU).

    ``query`` (batch, heads, 1, head_dim), ``key`` / ``value`` (batch, kv_heads, slots, head_dim / v_dim), ``mask``
    (batch, slots), nonzero where a slot is attended -> (batch, heads, 1, v_dim) in the query's dtype. ``block``:
    the slot block (a multiple of 128 dividing ``slots``, or ``slots``); :func:`block_slots` by default.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    batch, kv_heads, slots, dim = key.shape
    v_dim = value.shape[-1]
    q = _grouped(query, kv_heads)
    group = q.shape[2]
    mask = mask.astype(jnp.int32)
    if block is None:
        block = block_slots(slots, max(dim, v_dim), jnp.dtype(key.dtype).itemsize)
        if block == 0:  # not a multiple of 128 and too long for one block: pad the cache to the next multiple
            padded = -(-slots // 128) * 128
            widths = ((0, 0), (0, 0), (0, padded - slots), (0, 0))
            key, value = jnp.pad(key, widths), jnp.pad(value, widths)
            mask = jnp.pad(mask, ((0, 0), (0, padded - slots)))
            slots = padded
            block = block_slots(slots, max(dim, v_dim), jnp.dtype(key.dtype).itemsize)
    if slots % block or (block % 128 and block != slots):
        raise ValueError(f"decode_attention_pallas: block {block} must divide {slots} slots and be a multiple of 128")
    starts, ends = row_ranges(mask)
    num_blocks = slots // block

    def kv_block(b, h, j, starts, ends):
        # lax.div (truncating; the operands are not negative): a floor division lowers through sign, which Mosaic
        # lowers by asking the chip's generation (no export for TPU from a host without one)
        first = lax.div(starts[b], block)
        last = jnp.maximum(lax.div(ends[b] + block - 1, block) - 1, first)
        return jnp.minimum(jnp.maximum(j, first), last)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, kv_heads, num_blocks),
        in_specs=[
            pl.BlockSpec((1, 1, group, dim), lambda b, h, j, *_: (b, h, 0, 0)),
            pl.BlockSpec((1, 1, block, dim), lambda b, h, j, *r: (b, h, kv_block(b, h, j, *r), 0)),
            pl.BlockSpec((1, 1, block, v_dim), lambda b, h, j, *r: (b, h, kv_block(b, h, j, *r), 0)),
            pl.BlockSpec((1, 1, block), lambda b, h, j, *r: (b, 0, kv_block(b, h, j, *r))),
        ],
        out_specs=pl.BlockSpec((1, 1, group, v_dim), lambda b, h, j, *_: (b, h, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, v_dim), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block=block),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group, v_dim), query.dtype),
        grid_spec=grid_spec,
        interpret=interpret,
        compiler_params=None
        if interpret
        else pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        name="decode_attention_tpu_ragged",
    )(starts, ends, q, key, value, mask[:, None, :])
    return out.reshape(batch, kv_heads * group, 1, v_dim)


@functools.partial(jax.jit, static_argnames=("scale",))
def decode_attention_xla(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array, *, scale: float):
    """The same attention as plain XLA over every slot (no blocks skipped): the kernel's reference in JAX."""
    kv_heads = key.shape[1]
    q = _grouped(query, kv_heads)
    s = jnp.einsum("bhgd,bhsd->bhgs", q, key, preferred_element_type=jnp.float32) * scale
    valid = (mask != 0)[:, None, None, :]
    s = jnp.where(valid, s, -jnp.inf)
    top = s.max(axis=-1, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    p = jnp.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bhgs,bhsd->bhgd", p.astype(value.dtype), value, preferred_element_type=jnp.float32)
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    batch, _, group, v_dim = out.shape
    return out.astype(query.dtype).reshape(batch, kv_heads * group, 1, v_dim)


# The function TorchTPU's public JAX bridge registers (``torch.tpu.pallas.jax_op``, see ``_ops.torch_tpu_op``).
# jax_op reads its annotations to build the op's schema: ``jax.Array`` parameters become tensors, the others static
# arguments (a compile-time constant each, part of TorchTPU's kernel cache key); one array comes back.


def decode_attention_device(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array, scale: float, implementation: str
) -> jax.Array:
    """:func:`decode_attention_pallas` (``"pallas"``) or :func:`decode_attention_xla` (``"xla"``) with every
    argument annotated, for ``jax_op``."""
    if implementation == "pallas":
        return decode_attention_pallas(query, key, value, mask, scale=scale)
    if implementation == "pallas_interpret":
        return decode_attention_pallas(query, key, value, mask, scale=scale, interpret=True)
    if implementation == "xla":
        return decode_attention_xla(query, key, value, mask, scale=scale)
    raise ValueError(f"decode_attention_device: unknown implementation {implementation!r}")
