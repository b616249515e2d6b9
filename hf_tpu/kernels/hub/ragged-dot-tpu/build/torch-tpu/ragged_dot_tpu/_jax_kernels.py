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

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "moe_experts",
    "moe_experts_device",
    "ragged_dot_device",
    "ragged_dot_dense",
    "ragged_dot_megablox",
    "ragged_dot_pallas",
    "ragged_dot_pallas_decode",
    "ragged_dot_xla",
    "ragged_dot_xla_tiled",
    "visit_plan",
    "expert_plan",
]


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
    gid_ref,
    tid_ref,
    first_ref,
    starts_ref,
    ends_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    tm,
    tk,
    k,
    num_groups,
    rhs_transposed,
):
    from jax.experimental import pallas as pl

    v = pl.program_id(1)
    kk = pl.program_id(2)
    g = gid_ref[v]
    t = tid_ref[v]

    @pl.when((first_ref[v] == 1) & (kk == 0))
    def _init():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    keep = (rows >= starts_ref[g]) & (rows < ends_ref[g]) & (g < num_groups)
    w = rhs_ref[0]
    if k % tk:
        # The last contraction block reaches past K: what it holds there is unspecified (Pallas pads edge blocks
        # with undefined values), so those columns of the rows and rows of the weights are zeroed, not multiplied.
        cols = kk * tk + lax.broadcasted_iota(jnp.int32, (1, tk), 1)
        keep = keep & (cols < k)
        k_axis = 1 if rhs_transposed else 0  # the weight block is (tn, tk) transposed, (tk, tn) otherwise
        w_k = kk * tk + lax.broadcasted_iota(jnp.int32, (1, tk) if rhs_transposed else (tk, 1), k_axis)
        w = jnp.where(w_k < k, w, jnp.zeros((), w.dtype))
    x = jnp.where(keep, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
    contract = ((1,), (1,)) if rhs_transposed else ((1,), (0,))
    # float32 operands: every bit of them (the MXU's default for float32 is one bfloat16 pass: on a v5e 2e-3 off a
    # float64 reference, where torch's float32 matmul precision, "highest", promises float32's)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out_ref[...] += lax.dot_general(
        x, w, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


# VMEM the kernel may take (see :func:`vmem_bytes`), kept under the smallest default scoped VMEM limit of current
# TPUs (16 MiB) with room for Mosaic's own scratch.
VMEM_BUDGET = 12 * 1024 * 1024
_LANE = 128


def vmem_bytes(tm: int, tn: int, tk: int, dtype, *, ragged_k: bool = False) -> int:
    """VMEM one grid step takes: the (tm, tk) row block, the (tk, tn) weight block and the (tm, tn) float32 output
    block, each double-buffered by the pipeline, plus the kernel body's temporaries (the masked rows, the dot's
    float32 product and, when the last contraction block reaches past K, the masked weight block)."""
    itemsize = jnp.dtype(dtype).itemsize
    blocks = 2 * (tm * tk + tk * tn) * itemsize + 2 * tm * tn * 4
    temporaries = tm * tk * itemsize + tm * tn * 4 + (tk * tn * itemsize if ragged_k else 0)
    return blocks + temporaries


def _fits(tm: int, tn: int, tk: int, k: int, dtype) -> bool:
    return vmem_bytes(tm, tn, tk, dtype, ragged_k=k % tk != 0) <= VMEM_BUDGET


# The tile choice weighs each tiling that fits by an estimate of its time: the bytes it moves through HBM over a
# v5e's bandwidth, plus a fixed cost per grid step. Measured on a TPU v5e (scripts/chip_kernels.py --tiles, every
# tiling of six expert projections of Qwen3-30B-A3B, Mixtral-8x7B and gpt-oss-20b): the estimate's pick was the
# fastest tiling or within 1.2% of it in all six, where the earlier rule (at most 512 output columns, 128 rows)
# was up to 1.6x slower (Mixtral's down projection). Row tiles of 512 never won there.
_HBM_BYTES_PER_SECOND = 819e9
_SECONDS_PER_STEP = 0.35e-6


def tile_seconds(m: int, n: int, k: int, num_groups: int, tm: int, tn: int, tk: int, itemsize: int) -> float:
    """Estimated time of one tiling (the tile choice's cost): HBM traffic over the bandwidth plus the grid steps.

    With the whole K in one block, consecutive visits of one group keep its weight block and consecutive visits of
    one row tile keep its rows (Pallas fetches a block only when its index changes), so each group's weight is
    read once per output tile column and the rows once per output tile; with K split, every visit reads its
    weight and row blocks anew.
    """
    m_tiles, n_tiles, k_tiles = -(-m // tm), -(-n // tn), -(-k // tk)
    visits = m_tiles + num_groups
    if k_tiles == 1:
        weights = num_groups * n_tiles * tn * k * itemsize
        rows = n_tiles * m_tiles * tm * k * itemsize
    else:
        weights = visits * n_tiles * tn * k_tiles * tk * itemsize
        rows = n_tiles * visits * tm * k_tiles * tk * itemsize
    out = visits * n_tiles * tm * tn * 4
    return (weights + rows + out) / _HBM_BYTES_PER_SECOND + n_tiles * visits * k_tiles * _SECONDS_PER_STEP


def _tile_sizes(m: int, n: int, k: int, dtype, num_groups: int = 1) -> tuple[int, int, int]:
    """Row, output and contraction tiles for any (M, N, K): of the tilings whose blocks fit :data:`VMEM_BUDGET`,
    the one :func:`tile_seconds` estimates fastest.

    Candidates: rows up to 128 (M rounded up to the sublane below that) and 256 when M is larger; output columns
    N itself up to 128, else every multiple of 128 up to 2048 and N itself up to 2048 (a partial last block is
    padded by Pallas); contraction the whole K, or 2048 ... 128 dividing K where one does, else (K with no such
    divisor) those under K with the last block masked past K. Where nothing fits, the rows are halved.

    Raises ValueError where no tiling fits (only with a budget far below any TPU's VMEM).
    """
    itemsize = jnp.dtype(dtype).itemsize
    sublane = 16 if itemsize < 4 else 8
    tm_options = [min(128, _round_up(max(m, 1), sublane))] + ([256] if m > 128 else [])
    if n <= _LANE:
        tn_options = [n]
    else:
        tn_options = sorted({c for c in range(_LANE, min(n, 2048) + 1, _LANE)} | ({n} if n <= 2048 else set()))
    splits = [c for c in (2048, 1024, 512, 256, 128) if c < k]
    tk_options = [k] + ([c for c in splits if k % c == 0] or splits)
    while True:
        fitting = [
            (tm, tn, tk) for tm in tm_options for tn in tn_options for tk in tk_options if _fits(tm, tn, tk, k, dtype)
        ]
        if fitting:
            return min(
                fitting,
                key=lambda t: (tile_seconds(m, n, k, max(num_groups, 1), *t, itemsize), -t[1], -t[2], t[0]),
            )
        if tm_options[0] <= sublane:
            raise ValueError(
                f"ragged_dot_pallas: no tiling of M={m}, N={n}, K={k} ({jnp.dtype(dtype).name}) fits the "
                f"{VMEM_BUDGET / 2**20:.0f} MiB VMEM budget; use implementation='xla' for this shape."
            )
        tm_options = [max(sublane, tm_options[0] // 2)]


def _check_tiles(m: int, n: int, k: int, tm: int, tn: int, tk: int, dtype, interpret: bool) -> None:
    """Tiles passed by hand: Mosaic's block rules and the VMEM budget, checked before anything compiles."""
    if tm < 1 or tn < 1 or tk < 1:
        raise ValueError(f"ragged_dot_pallas: tiles must be positive, got tm={tm}, tn={tn}, tk={tk}")
    for name, tile, dim in (("tn", tn, n), ("tk", tk, k)):
        if dim % tile and tile % _LANE:
            raise ValueError(
                f"ragged_dot_pallas: {name}={tile} must divide {name[1].upper()}={dim} or be a multiple of {_LANE} "
                "(the last block is then masked)"
            )
    if not interpret and not _fits(tm, tn, tk, k, dtype):
        raise ValueError(
            f"ragged_dot_pallas: tiles tm={tm}, tn={tn}, tk={tk} need "
            f"{vmem_bytes(tm, tn, tk, dtype, ragged_k=k % tk != 0) / 2**20:.1f} MiB of VMEM, over the "
            f"{VMEM_BUDGET / 2**20:.0f} MiB budget; pass smaller tiles or leave them to the kernel."
        )


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "interpret", "tm", "tn", "tk"))
def ragged_dot_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_transposed: bool = False,
    interpret: bool = False,
    tm: int | None = None,
    tn: int | None = None,
    tk: int | None = None,
) -> jax.Array:
    """Grouped matmul as a Pallas TPU kernel (``interpret=True`` runs the same kernel body on CPU).

    Grid: (output column tiles, visits, contraction tiles); a visit accumulates its group's product into its row
    tile's float32 output block over the contraction tiles. Tiles: see :func:`_tile_sizes`; tiles passed by hand
    must divide their dimension or be multiples of 128, and fit the VMEM budget (a ValueError says which does not).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    if tm is None or tn is None or tk is None:
        auto_tm, auto_tn, auto_tk = _tile_sizes(m, n, k, lhs.dtype, num_groups)
        tm, tn, tk = tm or auto_tm, tn or auto_tn, tk or auto_tk
    _check_tiles(m, n, k, tm, tn, tk, lhs.dtype, interpret)
    m_padded = _round_up(max(m, 1), tm)
    lhs_p = jnp.pad(lhs, ((0, m_padded - m), (0, 0))) if m_padded != m else lhs
    plan = visit_plan(group_sizes, m_padded, tm)
    num_visits = plan[0].shape[0]
    last = num_groups - 1

    if rhs_transposed:
        rhs_spec = pl.BlockSpec((1, tn, tk), lambda j, v, kk, gid, *_: (jnp.minimum(gid[v], last), j, kk))
    else:
        rhs_spec = pl.BlockSpec((1, tk, tn), lambda j, v, kk, gid, *_: (jnp.minimum(gid[v], last), kk, j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(pl.cdiv(n, tn), num_visits, pl.cdiv(k, tk)),
        in_specs=[pl.BlockSpec((tm, tk), lambda j, v, kk, gid, tid, *_: (tid[v], kk)), rhs_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, kk, gid, tid, *_: (tid[v], j)),
    )
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, k=k, num_groups=num_groups, rhs_transposed=rhs_transposed)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_padded, n), jnp.float32),
        grid_spec=grid_spec,
        interpret=interpret,
        compiler_params=None
        if interpret
        else pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name="ragged_dot_tpu_gmm",
    )(*plan, lhs_p, rhs)
    return out[:m].astype(lhs.dtype)


def expert_plan(group_sizes: jax.Array, slots: int) -> tuple[jax.Array, ...]:
    """Static-shape list of the routed groups for the decode form: ``slots`` entries.

    Returns ``(ids, valid, starts, ends)``: per slot the group it visits (the non-empty groups in order; the slots
    past them repeat the last one, so that Pallas fetches no new weight block for them) and whether it computes;
    per group its first and one-past-last row. ``slots`` is ``min(G, M)``: M rows fall in at most M groups.
    """
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    nonempty = sizes > 0
    order = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)[:slots]
    count = jnp.sum(nonempty.astype(jnp.int32))
    s = jnp.arange(slots, dtype=jnp.int32)
    valid = s < count
    last = order[jnp.clip(count - 1, 0, slots - 1)]
    return jnp.where(valid, order, last), valid.astype(jnp.int32), starts, ends


def _decode_kernel(ids_ref, valid_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, tk, k, rhs_transposed):
    from jax.experimental import pallas as pl

    s = pl.program_id(1)
    kk = pl.program_id(2)

    @pl.when((s == 0) & (kk == 0))
    def _init():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(valid_ref[s] == 1)
    def _accumulate():
        g = ids_ref[s]
        rows = lax.broadcasted_iota(jnp.int32, (lhs_ref.shape[0], 1), 0)
        keep = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        w = rhs_ref[0]
        if k % tk:  # the last contraction block reaches past K: zero what lies there (see _gmm_kernel)
            cols = kk * tk + lax.broadcasted_iota(jnp.int32, (1, tk), 1)
            keep = keep & (cols < k)
            k_axis = 1 if rhs_transposed else 0
            w_k = kk * tk + lax.broadcasted_iota(jnp.int32, (1, tk) if rhs_transposed else (tk, 1), k_axis)
            w = jnp.where(w_k < k, w, jnp.zeros((), w.dtype))
        x = jnp.where(keep, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
        contract = ((1,), (1,)) if rhs_transposed else ((1,), (0,))
        precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        out_ref[...] += lax.dot_general(
            x, w, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
        )


def decode_tile_seconds(m: int, n: int, k: int, slots: int, tn: int, tk: int, itemsize: int) -> float:
    """Estimated time of the decode form with (tn, tk) tiles: every routed group's weight read once (padded to
    whole blocks), the rows once per contraction block and output column block, plus the grid steps."""
    n_tiles, k_tiles = -(-n // tn), -(-k // tk)
    weights = slots * n_tiles * tn * k_tiles * tk * itemsize
    rows = n_tiles * k_tiles * m * tk * itemsize
    return (weights + rows + m * n * 4) / _HBM_BYTES_PER_SECOND + n_tiles * slots * k_tiles * _SECONDS_PER_STEP


def decode_tile_sizes(m: int, n: int, k: int, dtype, num_groups: int) -> tuple[int, int, int]:
    """``(rows, tn, tk)`` of the decode form for ``m`` rows (chosen per token count): all the rows in one block
    (``m`` rounded up to the sublane, no padding to 128), and of the (tn, tk) tiles whose blocks fit
    :data:`VMEM_BUDGET`, those with the longest contraction block first, then the one :func:`decode_tile_seconds`
    estimates fastest (fewest grid steps for the same weight bytes). The longest contraction first: on the v5e
    (2026-12-06, an experts layer at 1 and 8 tokens, weights in transformers' (E, N, K) layout, the only one swept) a
    block of the whole K was faster than any split of it, whatever tn (Qwen3-30B-A3B's gate_up at 8 tokens: 675 us
    with (512, 2048), 784 us with the (1536, 1024) the estimate alone chose; Mixtral-8x7B's at 1 token: 984 us with
    (512, 4096), 1,084 us with (4096, 512)). Why is not measured; likely the rows' block then stays put across a
    group's steps, and a block of whole weight rows is one contiguous copy. Raises ValueError where nothing fits
    (rows too many for one block: use the visit form)."""
    itemsize = jnp.dtype(dtype).itemsize
    mp = _round_up(max(m, 1), 16 if itemsize < 4 else 8)
    slots = max(1, min(num_groups, m))
    whole = {n} if n <= 4096 else set()
    tn_options = [n] if n <= _LANE else sorted(set(range(_LANE, min(n, 4096) + 1, _LANE)) | whole)
    splits = [c for c in (4096, 2048, 1024, 512, 256, 128) if c < k]
    tk_options = [k] + ([c for c in splits if k % c == 0] or splits)
    fitting = [
        (tn, tk) for tn in tn_options for tk in tk_options
        if vmem_bytes(mp, tn, tk, dtype, ragged_k=k % tk != 0) <= VMEM_BUDGET
    ]  # fmt: skip
    if not fitting:
        raise ValueError(
            f"ragged_dot_pallas_decode: {m} rows of K={k} do not fit one block in the {VMEM_BUDGET / 2**20:.0f} MiB "
            "VMEM budget; use implementation='pallas' (the visit form) for this many rows."
        )
    tn, tk = min(fitting, key=lambda t: (-t[1], decode_tile_seconds(mp, n, k, slots, *t, itemsize), -t[0]))
    return mp, tn, tk


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "interpret", "tn", "tk"))
def ragged_dot_pallas_decode(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_transposed: bool = False,
    interpret: bool = False,
    tn: int | None = None,
    tk: int | None = None,
) -> jax.Array:
    """Grouped matmul for a few rows (decode): the grid runs over the routed groups only.

    Grid: (output column tiles, ``min(G, M)`` group slots, contraction tiles). All M rows sit in one VMEM block
    (M rounded up to the sublane: no padding to 128); each slot multiplies its group's rows (the others masked) by
    its group's weight block, accumulating into the resident (M, tn) float32 output block. Each routed group's
    weight is fetched from HBM once per (column, contraction) tile, i.e. once in all; slots past the routed groups
    repeat the last one's block index (no fetch) and skip their arithmetic. Tiles: :func:`decode_tile_sizes`.
    Same contract as :func:`ragged_dot_pallas` (rows past the groups are zeros).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    mp, auto_tn, auto_tk = decode_tile_sizes(m, n, k, lhs.dtype, num_groups)
    tn, tk = tn or auto_tn, tk or auto_tk
    _check_tiles(mp, n, k, mp, tn, tk, lhs.dtype, interpret)
    lhs_p = jnp.pad(lhs, ((0, mp - m), (0, 0))) if mp != m else lhs
    slots = max(1, min(num_groups, m))
    plan = expert_plan(group_sizes, slots)
    if rhs_transposed:
        rhs_spec = pl.BlockSpec((1, tn, tk), lambda j, s, kk, ids, *_: (ids[s], j, kk))
    else:
        rhs_spec = pl.BlockSpec((1, tk, tn), lambda j, s, kk, ids, *_: (ids[s], kk, j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(pl.cdiv(n, tn), slots, pl.cdiv(k, tk)),
        in_specs=[pl.BlockSpec((mp, tk), lambda j, s, kk, *_: (0, kk)), rhs_spec],
        out_specs=pl.BlockSpec((mp, tn), lambda j, s, kk, *_: (0, j)),
    )
    kernel = functools.partial(_decode_kernel, tk=tk, k=k, rhs_transposed=rhs_transposed)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32),
        grid_spec=grid_spec,
        interpret=interpret,
        compiler_params=None
        if interpret
        else pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name="ragged_dot_tpu_decode",
    )(*plan, lhs_p, rhs)
    return out[:m].astype(lhs.dtype)


def _megablox_rows(m: int, dtype) -> tuple[int, int]:
    """``(tm, mp)``: megablox ``gmm``'s row tile for ``m`` rows and the rows padded to it (its kernel needs M
    divisible by the row tile)."""
    tm = min(128, _round_up(max(m, 1), 16 if jnp.dtype(dtype).itemsize < 4 else 8))
    return tm, _round_up(max(m, 1), tm)


def _megablox_gmm(lhs, rhs, group_sizes, tm: int, rhs_transposed: bool, interpret: bool):
    """``gmm`` of rows already padded to a multiple of ``tm``, float32 out; the rows past the groups unwritten.

    float32 operands are multiplied at float32 precision, as in this kernel's own forms: ``gmm`` passes no precision
    to its ``dot_general``, and Mosaic's default for float32 is one bfloat16 pass (2e-3 off on a v5e), so it is
    traced under ``jax.default_matmul_precision("highest")``, which its dot then takes (Mosaic's
    ``contract_precision<fp32>``).
    Without it a float32 Qwen3-MoE's greedy tokens at batch 4 (whose decode graph ran this form) differed from the
    CPU's on a v5e at torch's "highest" precision (issue #67)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    k = lhs.shape[1]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    tiling = (tm, min(k, 1024), min(n, 512))  # the better of two tilings in most of the v5e's measurements
    float32 = lhs.dtype == jnp.float32  # as _gmm_kernel's and _decode_kernel's dots; other dtypes left as they are
    with jax.default_matmul_precision("highest") if float32 else contextlib.nullcontext():
        return gmm(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32, tiling=tiling,
                   transpose_rhs=rhs_transposed, interpret=interpret)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "interpret"))
def ragged_dot_megablox(lhs, rhs, group_sizes, *, rhs_transposed: bool = False, interpret: bool = False):
    """JAX's own Pallas grouped matmul (``jax.experimental.pallas.ops.tpu.megablox.gmm``) with tiles for this M:
    rows padded to the row tile (its kernel needs M divisible by it), the padding's rows zero."""
    m = lhs.shape[0]
    tm, mp = _megablox_rows(m, lhs.dtype)
    lhs_p = jnp.pad(lhs, ((0, mp - m), (0, 0))) if mp != m else lhs
    out = _megablox_gmm(lhs_p, rhs, group_sizes, tm, rhs_transposed, interpret)
    rows = jnp.arange(mp)[:, None] < jnp.sum(group_sizes)
    return jnp.where(rows, out, 0.0)[:m].astype(lhs.dtype)


def _float32_precision(dtype):
    """``Precision.HIGHEST`` for float32 operands, else None (the default): an XLA dot of float32 operands on a TPU
    runs one bfloat16 pass by default (4.8e-3 off for the dense experts layer on a v5e, issue #67), where torch's
    float32 matmul precision "highest" promises float32; bfloat16 operands are exact in one pass."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


@functools.partial(jax.jit, static_argnames=("rhs_transposed",))
def ragged_dot_dense(lhs, rhs, group_sizes, *, rhs_transposed: bool = False):
    """Every row times every group's weight, each row keeping its own group's product: G times the arithmetic,
    every weight read once, no routing-dependent work (a TPU streams it at the all-groups floor)."""
    num_groups = rhs.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0], dtype=jnp.int32), side="right")
    spec = "mk,gnk->gmn" if rhs_transposed else "mk,gkn->gmn"
    precision = _float32_precision(lhs.dtype)
    all_groups = jnp.einsum(spec, lhs, rhs, preferred_element_type=jnp.float32, precision=precision)
    onehot = (group[None, :] == jnp.arange(num_groups)[:, None]).astype(jnp.float32)
    return jnp.einsum("gmn,gm->mn", all_groups, onehot, precision=precision).astype(lhs.dtype)


@functools.partial(jax.jit, static_argnames=("rhs_transposed",))
def ragged_dot_xla(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, rhs_transposed: bool = False):
    """``jax.lax.ragged_dot``: XLA's own lowering (native on TPU; on CPU it computes every group densely)."""
    if rhs_transposed:
        rhs = jnp.swapaxes(rhs, 1, 2)
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None  # as the Pallas kernel's
    out = lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), precision=precision, preferred_element_type=jnp.float32
    )
    return out.astype(lhs.dtype)


def _contraction(rhs_transposed: bool):
    """``dot_general`` dimension numbers for (rows, K) times one group's weight in its stored layout.

    The weight is never transposed: (N, K) weights contract on their last axis, which on the CPU is a
    row-major matrix-vector product over memory read once, instead of a (K, N) copy of the weight per group.
    """
    return (((1,), (1,)) if rhs_transposed else ((1,), (0,))), ((), ())


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


def _loop_tiles(m: int, num_groups: int) -> tuple[int, ...]:
    """Row steps of the group loop, largest first: single rows (matrix-vector products, which XLA's CPU dot runs
    about as fast per row as a handful of rows) while an even routing gives the groups fewer than 16 rows each,
    then steps of 16 rows with single rows for the remainder."""
    return (1,) if m < 16 * max(num_groups, 1) else (16, 1)


def _num_groups(rhs) -> int:
    return len(rhs) if isinstance(rhs, (tuple, list)) else rhs.shape[0]


def _matrix(rhs) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one group's weight matrix."""
    if isinstance(rhs, (tuple, list)):
        return jax.ShapeDtypeStruct(rhs[0].shape, rhs[0].dtype)
    return jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype)


def _out_features(rhs, rhs_transposed: bool) -> int:
    shape = _matrix(rhs).shape
    return shape[0] if rhs_transposed else shape[1]


def _group_loop(lhs, rhs, group_sizes, rhs_transposed, tiles):
    """XLA loop over the groups that have rows; each group's rows in exact steps, never a padded or masked row.

    ``rhs`` is the (G, ., .) weight array, or a tuple of the G weight matrices (separate buffers). With the
    array, XLA on CPU copies each visited group's weight out of it (a dynamic slice is a copy there); with the
    tuple, a ``switch`` on the group hands its matrix to the dot as it lies, so no weight is ever copied. A group
    of ``s`` rows takes ``s // tiles[0]`` steps of ``tiles[0]`` rows, then the next tile size for the rest, down
    to ``tiles[-1] == 1``. Empty groups cost nothing (the loop runs over the compacted list of non-empty
    groups); trip counts depend on the routing, shapes do not.
    """
    m = lhs.shape[0]
    n = _out_features(rhs, rhs_transposed)
    dims = _contraction(rhs_transposed)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    sizes = jnp.clip(jnp.minimum(ends, m) - starts, 0)  # rows past lhs's last row (bad group sizes) are dropped
    nonempty = sizes > 0
    visit = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)  # non-empty groups first, in order
    split = isinstance(rhs, (tuple, list))
    if split:
        branches = [
            functools.partial(lambda x, w: lax.dot_general(x, w, dims, preferred_element_type=jnp.float32), w=w)
            for w in rhs
        ]

    def group(j, out):
        g = visit[j]
        if split:
            dot = functools.partial(lax.switch, g, branches)
        else:
            w = rhs[g]  # one copy of this group's weight, shared by its steps
            dot = functools.partial(lambda x, w: lax.dot_general(x, w, dims, preferred_element_type=jnp.float32), w=w)
        start, left = starts[g], sizes[g]
        for rows in tiles:
            count = left // rows

            def step(i, out, rows=rows, base=start):
                r0 = base + i * rows
                return lax.dynamic_update_slice_in_dim(out, dot(lax.dynamic_slice_in_dim(lhs, r0, rows)), r0, 0)

            out = lax.fori_loop(0, count, step, out)
            start, left = start + count * rows, left - count * rows
        return out

    return lax.fori_loop(0, jnp.sum(nonempty), group, jnp.zeros((m, n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "tm"))
def ragged_dot_xla_tiled(lhs: jax.Array, rhs, group_sizes: jax.Array, *, rhs_transposed: bool = False, tm=None):
    """CPU path: an XLA loop over the non-empty groups and their rows.

    ``rhs``: the (G, K, N) / (G, N, K) weights, or a tuple of their G matrices, which spares XLA a copy of each
    visited weight (see :func:`_group_loop`). Static shapes, exactly ``M`` rows of work and each non-empty group's
    weight read in its stored layout, instead of the ``M * G`` rows of XLA's dense CPU lowering of
    ``ragged_dot``. ``tm``: rows per loop step (default: see :func:`_loop_tiles`); a handful of rows against the
    weight array take a per-row gather instead.
    """
    m = lhs.shape[0]
    if tm is not None and tm < 1:
        raise ValueError(f"ragged_dot_xla_tiled: tm must be at least 1, got {tm}")
    split = isinstance(rhs, (tuple, list))
    if m == 0 or (tm is None and m <= 16 and not split):
        out = _row_gather(lhs, rhs, group_sizes, rhs_transposed)
    else:
        tiles = _loop_tiles(m, _num_groups(rhs)) if tm is None else tuple(sorted({min(tm, m), 1}, reverse=True))
        out = _group_loop(lhs, rhs, group_sizes, rhs_transposed, tiles)
    return out.astype(lhs.dtype)


def _dot_for(implementation: str):
    try:
        return {
            "pallas": ragged_dot_pallas,
            "pallas_interpret": functools.partial(ragged_dot_pallas, interpret=True),
            "pallas_decode": ragged_dot_pallas_decode,
            "pallas_decode_interpret": functools.partial(ragged_dot_pallas_decode, interpret=True),
            "megablox": ragged_dot_megablox,
            "megablox_interpret": functools.partial(ragged_dot_megablox, interpret=True),
            "dense": ragged_dot_dense,
            "xla": ragged_dot_xla,
            "xla_tiled": ragged_dot_xla_tiled,
        }[implementation]
    except KeyError:
        raise ValueError(f"unknown ragged_dot implementation {implementation!r}") from None


def _gated_mlp(x, gate_up, down, group_sizes, rhs_transposed, implementation):
    if implementation in ("megablox", "megablox_interpret"):
        return _gated_mlp_megablox(x, gate_up, down, group_sizes, rhs_transposed, implementation == "megablox_interpret")
    dot = _dot_for(implementation)
    h = dot(x, gate_up, group_sizes, rhs_transposed=rhs_transposed)
    gate, up = jnp.split(h, 2, axis=-1)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    return dot(h, down, group_sizes, rhs_transposed=rhs_transposed)


def _gated_mlp_megablox(x, gate_up, down, group_sizes, rhs_transposed, interpret):
    """The gated MLP with megablox ``gmm`` for both products, as one padded block of rows: the rows padded to the row
    tile once (not once per product), the first product's float32 output gated directly (its values rounded to the
    weights' dtype first, as :func:`ragged_dot_megablox` returns them). The rows past the groups (expert parallelism's
    sentinels) are left as ``gmm`` leaves them, unwritten: :func:`moe_experts` selects them away where it weighs the
    rows. The same values as :func:`_gated_mlp` with :func:`ragged_dot_megablox`, with two pads, two slices and two
    masks fewer (on the v5e at decode sizes those small ops were a few percent of the layer)."""
    m = x.shape[0]
    tm, mp = _megablox_rows(m, x.dtype)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    h = _megablox_gmm(xp, gate_up, group_sizes, tm, rhs_transposed, interpret).astype(x.dtype)
    gate, up = jnp.split(h, 2, axis=-1)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    return _megablox_gmm(h, down, group_sizes, tm, rhs_transposed, interpret)[:m].astype(x.dtype)


def _moe_experts_dense(hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed):
    """Every expert on every token, each token's outputs weighted by its routing (zero for experts it did not
    choose): E / k times the arithmetic, every weight read once, no sort, gather or scatter."""
    num_experts = gate_up.shape[0]
    x = hidden.astype(gate_up.dtype)
    p = _float32_precision(x.dtype)
    h = jnp.einsum("th,eih->eti" if rhs_transposed else "th,ehi->eti", x, gate_up, preferred_element_type=jnp.float32,
                   precision=p)  # fmt: skip
    gate, up = jnp.split(h, 2, axis=-1)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)
    y = jnp.einsum("eti,ehi->eth" if rhs_transposed else "eti,eih->eth", h, down, preferred_element_type=jnp.float32,
                   precision=p)  # fmt: skip
    ids = top_k_index.astype(jnp.int32)
    chosen = ids[:, :, None] == jnp.arange(num_experts, dtype=jnp.int32)  # (T, k, E); ids >= E choose nothing
    scale = jnp.einsum("tke,tk->et", chosen.astype(jnp.float32), top_k_weights.astype(jnp.float32), precision=p)
    return jnp.einsum("eth,et->th", y.astype(x.dtype).astype(jnp.float32), scale, precision=p).astype(hidden.dtype)


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "implementation"))
def moe_experts(
    hidden: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    rhs_transposed: bool,
    implementation: str,
) -> jax.Array:
    """A whole SiLU-gated experts layer as one program: route, gather, the two grouped matmuls, weigh, combine.

    ``hidden`` (T, H), ``top_k_index`` / ``top_k_weights`` (T, k), ``gate_up`` (E, 2I, H) and ``down`` (E, H, I)
    with ``rhs_transposed`` (transformers' layout; the other layout otherwise) -> (T, H) in ``hidden``'s dtype.
    With ``implementation="xla_tiled"`` the weights may also be tuples of their E matrices.
    Expert ids ``>= E`` (expert parallelism's sentinels for experts on other ranks) contribute nothing. The
    arithmetic follows transformers' experts: the gathered tokens in the weights' dtype, each slot's output
    scaled by its routing weight in that dtype, the ``k`` slots of a token summed.
    """
    if implementation == "dense":
        return _moe_experts_dense(hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed)
    num_tokens, top_k = top_k_index.shape
    num_experts = _num_groups(gate_up)
    ids = top_k_index.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(jnp.clip(ids, 0, num_experts), length=num_experts + 1)[:num_experts]
    x = hidden[order // top_k].astype(_matrix(gate_up).dtype)
    h = _gated_mlp(x, gate_up, down, group_sizes.astype(jnp.int32), rhs_transposed, implementation)
    # a sentinel's row: zero (the megablox form leaves the rows past the groups unwritten; a select, not a product
    # with a zero weight, so that whatever lies there does not reach the sum), in the same pass as the weighting
    valid = (ids[order] < num_experts)[:, None]
    h = jnp.where(valid, h * top_k_weights.reshape(-1)[order].astype(h.dtype)[:, None], jnp.zeros((), h.dtype))
    slots = jnp.zeros_like(h).at[order].set(h, unique_indices=True)
    # summed with float32 accumulation and rounded once, like torch's reductions in low precision
    combined = slots.reshape(num_tokens, top_k, -1).astype(jnp.float32).sum(axis=1).astype(h.dtype)
    return combined.astype(hidden.dtype)


# The two functions TorchTPU's public JAX bridge registers (``torch.tpu.pallas.jax_op``, see ``_ops.torch_tpu_ops``).
# jax_op reads their annotations to build the op's schema: ``jax.Array`` parameters become tensors, the others
# static arguments (a compile-time constant each, part of TorchTPU's kernel cache key); one array comes back.


def ragged_dot_device(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool, implementation: str
) -> jax.Array:
    """:func:`ragged_dot_pallas` (or another ``implementation``) with every argument annotated, for ``jax_op``."""
    return _dot_for(implementation)(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed)


def moe_experts_device(
    hidden: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    rhs_transposed: bool,
    implementation: str,
) -> jax.Array:
    """:func:`moe_experts` with every argument annotated, for ``jax_op``."""
    return moe_experts(
        hidden, top_k_index, top_k_weights, gate_up, down, rhs_transposed=rhs_transposed, implementation=implementation
    )
