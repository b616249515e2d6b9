"""The JAX side of the kernel: a Pallas TPU grouped matmul and an XLA path for hosts without a TPU.

Both compute ``ragged_dot(lhs, rhs, group_sizes)``: the rows of ``lhs`` (M, K) are sorted by group, group ``g``
owns ``group_sizes[g]`` consecutive rows, and those rows are multiplied by ``rhs[g]`` ((K, N), or (N, K) with
``rhs_transposed=True``, the layout transformers stores expert weights in). Rows past ``sum(group_sizes)`` come
out as zeros, like ``jax.lax.ragged_dot``. Shapes depend only on (M, K, N, G), never on the routing, so one
compiled program serves every routing.

The Pallas kernel walks a "visit" list: for a row tile of ``tm`` rows, one visit per group that has rows in
that tile, in tile order (at most ``m_tiles + G`` visits, a static bound). A visit loads the tile and its
group's weight block, masks the rows of other groups and accumulates into the tile's output block, which stays
resident across the consecutive visits of one tile. The visit list is computed on device from ``group_sizes``
and handed to the kernel as scalar-prefetch operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["ragged_dot_pallas", "ragged_dot_xla", "ragged_dot_xla_tiled", "visit_plan"]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def visit_plan(group_sizes: jax.Array, m_padded: int, tm: int) -> tuple[jax.Array, ...]:
    """Static-shape visit list for row tiles of ``tm`` rows over ``m_padded`` rows.

    Returns ``(group_ids, tile_ids, first, starts, ends)``: per visit its group (``G`` marks the virtual group
    of rows past the last real group, which contributes zeros), its row tile and whether it is the first
    visit of that tile; per group (``G + 1`` entries) its first and one-past-last row.
    """
    num_groups = group_sizes.shape[0]
    m_tiles = m_padded // tm
    sizes = group_sizes.astype(jnp.int32)
    tail = jnp.maximum(m_padded - jnp.sum(sizes), 0)
    sizes = jnp.concatenate([sizes, tail[None]])
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    counts = jnp.where(sizes > 0, (ends - 1) // tm - starts // tm + 1, 0)
    cum = jnp.cumsum(counts)
    num_visits = m_tiles + num_groups  # upper bound: each group boundary splits at most one tile
    v = jnp.arange(num_visits, dtype=jnp.int32)
    group = jnp.searchsorted(cum, v, side="right").astype(jnp.int32)
    real = group <= num_groups
    g = jnp.minimum(group, num_groups)
    tile = jnp.where(real, starts[g] // tm + v - (cum[g] - counts[g]), m_tiles - 1)
    tile = jnp.clip(tile, 0, m_tiles - 1).astype(jnp.int32)
    # Padding visits (past the real ones) revisit the last tile with the virtual group: they add zeros.
    g = jnp.where(real, g, num_groups).astype(jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32), (tile[1:] != tile[:-1]).astype(jnp.int32)])
    return g, tile, first, starts.astype(jnp.int32), ends.astype(jnp.int32)


def _gmm_kernel(
    gid_ref, tid_ref, first_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, tm, num_groups, rhs_transposed
):
    from jax.experimental import pallas as pl

    v = pl.program_id(1)
    g = gid_ref[v]
    t = tid_ref[v]

    @pl.when(first_ref[v] == 1)
    def _init():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    keep = (rows >= starts_ref[g]) & (rows < ends_ref[g]) & (g < num_groups)
    x = jnp.where(keep, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
    w = rhs_ref[0]
    contract = ((1,), (1,)) if rhs_transposed else ((1,), (0,))
    out_ref[...] += lax.dot_general(x, w, (contract, ((), ())), preferred_element_type=jnp.float32)


def _tile_sizes(m: int, n: int, dtype) -> tuple[int, int]:
    sublane = 16 if jnp.dtype(dtype).itemsize < 4 else 8
    tm = min(128, _round_up(max(m, 1), sublane))
    tn = n
    for cand in (512, 256, 128):
        if n % cand == 0:
            tn = cand
            break
    return tm, tn


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "interpret", "tm", "tn"))
def ragged_dot_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_transposed: bool = False,
    interpret: bool = False,
    tm: int | None = None,
    tn: int | None = None,
) -> jax.Array:
    """Grouped matmul as a Pallas TPU kernel (``interpret=True`` runs the same kernel body on CPU)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    auto_tm, auto_tn = _tile_sizes(m, n, lhs.dtype)
    tm = tm or auto_tm
    tn = tn or auto_tn
    m_padded = _round_up(max(m, 1), tm)
    lhs_p = jnp.pad(lhs, ((0, m_padded - m), (0, 0))) if m_padded != m else lhs
    plan = visit_plan(group_sizes, m_padded, tm)
    num_visits = plan[0].shape[0]
    last = num_groups - 1

    if rhs_transposed:
        rhs_spec = pl.BlockSpec((1, tn, k), lambda j, v, gid, *_: (jnp.minimum(gid[v], last), j, 0))
    else:
        rhs_spec = pl.BlockSpec((1, k, tn), lambda j, v, gid, *_: (jnp.minimum(gid[v], last), 0, j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n // tn, num_visits),
        in_specs=[pl.BlockSpec((tm, k), lambda j, v, gid, tid, *_: (tid[v], 0)), rhs_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, gid, tid, *_: (tid[v], j)),
    )
    kernel = functools.partial(_gmm_kernel, tm=tm, num_groups=num_groups, rhs_transposed=rhs_transposed)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_padded, n), jnp.float32),
        grid_spec=grid_spec,
        interpret=interpret,
        compiler_params=None if interpret else pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="ragged_dot_tpu_gmm",
    )(*plan, lhs_p, rhs)
    return out[:m].astype(lhs.dtype)


@functools.partial(jax.jit, static_argnames=("rhs_transposed",))
def ragged_dot_xla(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, rhs_transposed: bool = False):
    """``jax.lax.ragged_dot``: XLA's own lowering (native on TPU; on CPU it computes every group densely)."""
    if rhs_transposed:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def _row_gather(lhs, rhs, group_sizes, rhs_transposed):
    """Each row times its own group's weight (gathered per row): cheapest for a handful of rows."""
    num_groups = rhs.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right")
    w = rhs[jnp.minimum(group, num_groups - 1)]
    spec = "sk,snk->sn" if rhs_transposed else "sk,skn->sn"
    out = jnp.einsum(spec, lhs, w, preferred_element_type=jnp.float32)
    return jnp.where((group < num_groups)[:, None], out, 0.0)


def _group_loop(lhs, rhs, group_sizes, rhs_transposed, tm):
    """XLA loop over the groups, and inside each non-empty group over its rows ``tm`` at a time.

    Each active group's weight is sliced once (XLA on CPU copies dynamic slices, so slicing it per row tile
    would cost a copy per tile); the inner trip count is data dependent, the shapes are not.
    """
    m = lhs.shape[0]
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    lhs_p = jnp.pad(lhs, ((0, tm), (0, 0)))  # a window starting at any row < m stays in bounds
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    row_offsets = jnp.arange(tm, dtype=jnp.int32)

    def group(g, out):
        def compute(out):
            w = rhs[g].T if rhs_transposed else rhs[g]  # (K, N), laid out once per group

            def tile(i, out):
                r0 = starts[g] + i * tm
                keep = (r0 + row_offsets) < ends[g]
                x = jnp.where(keep[:, None], lax.dynamic_slice_in_dim(lhs_p, r0, tm), jnp.zeros((), lhs.dtype))
                y = jnp.dot(x, w, preferred_element_type=jnp.float32)
                return lax.dynamic_update_slice_in_dim(out, lax.dynamic_slice_in_dim(out, r0, tm) + y, r0, 0)

            return lax.fori_loop(0, (sizes[g] + tm - 1) // tm, tile, out)

        return lax.cond(sizes[g] > 0, compute, lambda out: out, out)

    out = lax.fori_loop(0, num_groups, group, jnp.zeros((m + tm, n), jnp.float32))
    return out[:m]


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "tm"))
def ragged_dot_xla_tiled(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, rhs_transposed: bool = False, tm: int = 8
):
    """CPU path: an XLA loop over the groups and their row tiles (a per-row gather for a handful of rows).

    Static shapes, at most ``M + G * tm`` rows of work and each active group's weight read once, instead of the
    ``M * G`` rows of XLA's dense CPU lowering of ``ragged_dot``.
    """
    if lhs.shape[0] <= 2 * tm:
        out = _row_gather(lhs, rhs, group_sizes, rhs_transposed)
    else:
        out = _group_loop(lhs, rhs, group_sizes, rhs_transposed, tm)
    return out.astype(lhs.dtype)
