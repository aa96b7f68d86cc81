"""Merging split-KV partials in one Mosaic GPU launch, and its jnp reference.

A split-KV decode call (flash decoding) leaves, per batch row, split and query
row, a normalised partial output and its log-sum-exp:

  out [B, S, rows, R] f32 or bf16 (``partial_dtype``), lse [B, S, rows] f32 (natural log;
  -inf: the split saw nothing)

and the result is their average weighted by exp(lse):

  merged[b, r] = sum_s exp(lse[b, s, r] - M) out[b, s, r] / sum_s exp(lse[b, s, r] - M)
  lse[b, r]    = M + log(sum_s exp(lse[b, s, r] - M)),   M = max_s lse[b, s, r]

Why a kernel. Written in jnp (``combine_splits_reference``) XLA runs it as four
or five fusions (the max, the exponentials and their sum, the weighted sum, the
division and the cast), each a launch of ~1 us on an H100 whatever its size. At
short contexts that is a third of a decode call (H100, B=1 x 1k x 16 heads, 8
splits: ~5 of 17.6 us; scripts/profile_decode_launches.py).

Two entry points:

- ``combine_splits``: every batch row in the same S splits, out [B, S, ...] (the Triton
  decode kernels, the Mosaic ones' uniform plan).
- ``combine_items``: a load-balanced split plan (pallas_kernels/split_plan.py), batch row b in
  a dynamic number of work items, item_count[b], laid out flat from item_start[b] in out [W,
  ...]. It updates the decode call's own outputs in place (rows of one item were written there
  directly).

Layout of the work. One CTA of one warpgroup (128 threads) per (batch row, run of values of
its [rows, R] slab). Its items' partials of that run are read straight from global memory
into registers (coalesced vector loads: the merge reads each partial once, so staging them
in SMEM would buy nothing), ``chunk`` items a step with the loads of a step issued together
(a static loop: no serialised latency), merged online across steps (a running max). The
weights are computed once per (item, query row) as scalars, not once per value.

- Partials [.., rows, R]: the run is ``run_rows`` query rows x ``run_cols`` columns, each row a
  [run_cols] vector (``run_cols`` / 128 contiguous values a thread), scaled by its row's weight.
- Partials [.., R, rows] (``transposed``, the 16-row Mosaic kernel's): the run is
  ``run_cols`` columns of every query row, an item's [run_cols, rows] tile contiguous. A
  thread loads values of fixed rows (one value per thread and load: with 128 a multiple of
  rows, one row per thread), so each weight is a per-thread value, built from the rows'
  scalar weights by a select per row. The merged tile goes through SMEM (padded to an odd
  row stride: no bank conflicts) to be stored as [rows, run_cols], contiguous runs again.
  The weights cost rows x items scalar loads, exponentials and selects a CTA: made for the
  16-row kernel's partials (a 64-row tile of 66 items is ~4k of each).

Backend: Pallas Mosaic GPU (``plgpu``), one launch; interpret mode on the CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WARPGROUP = 128  # threads of a CTA; a register array of n values needs n % 128 == 0
# Partial values a CTA loads in one step (its ``chunk`` items x its run): 32 a thread, 64 from
# 33 items (S padded >= 64: a run of one row's 512 values would otherwise be cut below 128).
# Starting point taken from the Triton merge's tuning; scripts/tune_combine_splits.py --compare.
MAX_TILE = 4096
MAX_VECTOR_BYTES = 16  # widest load or store a thread issues (ld.global.v4.b32)
# Values of an item a transposed-partials CTA loads at least (16 a thread): its rows' weights
# cost rows x items scalars and selects a CTA whatever its run, so a wider run amortises them.
MIN_TRANSPOSED_VALUES = 2048


def max_tile(num_splits: int) -> int:
    """Partial values a merge CTA loads in one step: 2 x ``MAX_TILE`` from 33 items (S padded
    >= 64), else ``MAX_TILE``; at least one value a thread and split whatever S."""
    return 2 * MAX_TILE if pl.next_power_of_2(num_splits) >= 64 else MAX_TILE


def partial_dtype(out_dtype) -> jnp.dtype:
    """The dtype a split decode kernel's normalised partials take for a merged output of
    ``out_dtype``: bf16 for a bf16 output, else float32.

    A bf16 output keeps 8 significant bits, and so may its partials: the merge is a weighted
    average (weights summing to 1), so partials rounded to bf16 move the result by at most what
    the output's own rounding does (half an ulp, <= 2**-8 of the largest partial). At small
    batches the partials outweigh the cache: at B=1 x 16k x 128 heads (66 splits of ~250 tokens)
    float32 ones are 17 MB written and read back against 10.5 MB of FP8 cache.
    """
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def combine_splits_reference(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge split partials in jnp: out [B, S, rows, R] f32 (or bf16), lse [B, S, rows] f32 ->
    (merged [B, rows, R] f32, lse [B, rows] f32). Rows no split saw get 0 and -inf."""
    out = out.astype(jnp.float32)
    lse_max = jnp.max(lse, axis=1, keepdims=True)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
    weight = jnp.exp(lse - lse_max)  # 0 for empty splits
    total = jnp.sum(weight, axis=1)
    merged = jnp.einsum("bsr,bsrd->brd", weight, out) / jnp.where(total > 0, total, 1.0)[..., None]
    merged_lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + lse_max[:, 0], -jnp.inf)
    return merged, merged_lse


def combine_items_reference(out: jax.Array, lse: jax.Array, item_start: jax.Array, item_count: jax.Array,
                            merged: jax.Array, merged_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge each batch row's work items in jnp, the math of ``combine_items``.

    out [W, rows, R] f32 or bf16 (finite), lse [W, rows] f32, item_start and item_count [B]
    int32 (row b's items out[item_start[b] : item_start[b] + item_count[b]]), merged [B, rows,
    R] and merged_lse [B, rows] f32 -> (merged, merged_lse): rows of two or more items replaced
    by their lse-weighted average (in merged's dtype), the others as given. Query rows no item
    saw get 0 and -inf. Holds a [B, W, rows] weight: for tests and small shapes.
    """
    item = jnp.arange(lse.shape[0], dtype=jnp.int32)
    member = (item[None, :] >= item_start[:, None]) & (item[None, :] < (item_start + item_count)[:, None])
    row_lse = jnp.where(member[:, :, None], lse[None], -jnp.inf)  # [B, W, rows]
    lse_max = jnp.max(row_lse, axis=1)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
    weight = jnp.exp(row_lse - lse_max[:, None, :])  # 0 for other rows' items
    total = jnp.sum(weight, axis=1)
    # HIGHEST: a GPU's default float32 matmul may round to TF32 (10 bits), coarser than a bf16 output.
    weighted = jnp.einsum("bwr,wrd->brd", weight, out.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    combined = weighted / jnp.where(total > 0, total, 1.0)[..., None]
    several = (item_count >= 2)[:, None]
    return (jnp.where(several[..., None], combined.astype(merged.dtype), merged),
            jnp.where(several, _merged_lse(total, lse_max), merged_lse))


def _merged_lse(total, lse_max):
    """The merged log-sum-exp of a row from its weights' total and max (-inf: no item saw it)."""
    return jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + lse_max, -jnp.inf)


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (1 at least)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def run_shape(chunk: int, num_rows: int, rank: int, transposed: bool) -> tuple[int, int]:
    """(run_rows, run_cols): the query rows and columns of R a merge CTA covers.

    At most ``max_tile(chunk)`` values for ``chunk`` items, but at least one value a thread
    and item (transposed: ``MIN_TRANSPOSED_VALUES``). [.., rows, R] partials: ``run_cols`` a power of two dividing R, >= 128 (a
    thread's share of a row is contiguous), then whole rows dividing ``rows``.
    ``transposed``: every row (``run_rows`` = rows) and ``run_cols`` a power of two dividing
    R, with run_cols x rows a multiple of 128 and of the rows' period (``row_period``).
    """
    values = max(WARPGROUP, max_tile(chunk) // pl.next_power_of_2(chunk))
    if transposed:
        values = max(values, MIN_TRANSPOSED_VALUES)
        cols = row_period(num_rows) // num_rows  # columns of one period of the thread-row pattern
        while cols * 2 <= rank and rank % (cols * 2) == 0 and cols * 2 * num_rows <= values:
            cols *= 2
        return num_rows, cols
    cols = min(rank, pl.next_power_of_2(values))
    while rank % cols:
        cols //= 2
    return _largest_divisor(num_rows, values // cols), cols


def row_period(num_rows: int) -> int:
    """Values of a transposed tile after which the rows of a thread's values repeat: the
    least multiple of 128 (a load of the warpgroup) and of ``num_rows``."""
    return WARPGROUP * num_rows // math.gcd(WARPGROUP, num_rows)


def _vector(num_values: int, dtype) -> int:
    """Contiguous values a thread loads of a row's ``num_values``: up to 16 bytes."""
    return max(1, min(num_values // WARPGROUP, MAX_VECTOR_BYTES // jnp.dtype(dtype).itemsize))


def _merge(load_tile, load_lse, scale, start, count, *, chunk: int, num_items: int, num_rows: int,
           static_count: bool):
    """Merge one batch row's ``count`` items from item ``start`` over one CTA's run.

    load_tile(item) -> the item's partials of the run (a list of f32 arrays); load_lse(item, r)
    -> scalar f32, lse of the run's query row r (of ``num_rows``); scale(tile, weights) -> the
    tile with each query row's values times its scalar of ``weights`` (a list, one a row).
    Returns (merged tile f32, the rows' merged lse: a list of scalars).

    ``chunk`` items a step, their loads issued together; with ``static_count`` count is a
    Python int (every item real: one step when count <= chunk), else items past ``count`` read
    the row's first item again (finite, unlike another row's unused slots) weighted 0, and
    every index is clamped into [0, num_items): a bad start or count can not read past out. Steps after the first rescale the
    running total and sum by exp(old max - new max) (one more rounding of the weights: exact
    to float32 rounding).
    """
    def items_of(k):
        offsets = [k * chunk + j for j in range(chunk)]
        if static_count:
            return [(start + o, True) for o in offsets if o < count]
        return [(jnp.clip(jnp.where(o < count, start + o, start), 0, num_items - 1), o < count) for o in offsets]

    def weigh(k, top):
        """(item, per-row lse) of step k and the rows' new max (``top``: the running one)."""
        members = items_of(k)
        lses = [[jnp.where(real, load_lse(item, r), -jnp.inf) for r in range(num_rows)] for item, real in members]
        new_top = [functools.reduce(jnp.maximum, [row[r] for row in lses], top[r]) for r in range(num_rows)]
        return members, lses, new_top

    def step(k, carry):
        top, total, acc = carry
        members, lses, new_top = weigh(k, top)
        shift = [jnp.where(t == -jnp.inf, 0.0, t) for t in new_top]  # no item saw the row yet: weights 0
        rescale = [jnp.exp(t - s) for t, s in zip(top, shift)]  # 0 on the first step, 1 while the max holds
        weights = [[jnp.exp(row[r] - shift[r]) for r in range(num_rows)] for row in lses]
        acc = scale(acc, rescale)
        total = [t * c for t, c in zip(total, rescale)]
        for (item, _), w in zip(members, weights):
            acc = [a + x for a, x in zip(acc, scale(load_tile(item), w))]
            total = [t + x for t, x in zip(total, w)]
        return new_top, total, acc

    def first_step():
        members, lses, top = weigh(0, [jnp.float32(-jnp.inf)] * num_rows)
        shift = [jnp.where(t == -jnp.inf, 0.0, t) for t in top]
        weights = [[jnp.exp(row[r] - shift[r]) for r in range(num_rows)] for row in lses]
        acc = total = None
        for (item, _), w in zip(members, weights):
            term = scale(load_tile(item), w)
            acc = term if acc is None else [a + x for a, x in zip(acc, term)]
            total = w if total is None else [t + x for t, x in zip(total, w)]
        return top, total, acc

    carry = first_step()
    if static_count:
        for k in range(1, -(-count // chunk)):
            carry = step(k, carry)
    else:
        carry = lax.fori_loop(1, lax.div(count + (chunk - 1), chunk), step, carry)
    top, total, acc = carry
    inverse = [1.0 / jnp.where(t > 0, t, 1.0) for t in total]
    return scale(acc, inverse), [_merged_lse(t, jnp.where(m == -jnp.inf, 0.0, m)) for t, m in zip(total, top)]


def _flat_run(out_ref, lse_ref, o_ref, lse_out_ref, b, start, count, *, chunk: int, run_rows: int, run_cols: int,
              static_count: bool):
    """Merge and store one CTA's run of [.., rows, R] partials: out_ref [W, rows, R], lse_ref
    [W, rows]; o_ref [B, rows, R], lse_out_ref [B, rows]. The run is ``run_rows`` rows x
    ``run_cols`` columns (program 1 numbers the runs row-major); the CTA of a row's first
    columns writes its merged lse."""
    num_items, num_rows, rank = out_ref.shape
    runs_per_row = rank // run_cols
    run = lax.axis_index("run")
    row0 = run // runs_per_row * run_rows
    col0 = pl.multiple_of(run % runs_per_row * run_cols, run_cols)
    layout = plgpu.Layout.WG_STRIDED((run_cols,), _vector(run_cols, out_ref.dtype))

    def load_tile(item):
        return [plgpu.load(out_ref.at[item, row0 + r, pl.ds(col0, run_cols)], layout=layout).astype(jnp.float32)
                for r in range(run_rows)]

    merged, merged_lse = _merge(load_tile, lambda item, r: lse_ref[item, row0 + r],
                                lambda tile, weights: [x * w for x, w in zip(tile, weights)], start, count,
                                chunk=chunk, num_items=num_items, num_rows=run_rows, static_count=static_count)
    for r in range(run_rows):
        o_ref[b, row0 + r, pl.ds(col0, run_cols)] = merged[r].astype(o_ref.dtype)

    @pl.when(col0 == 0)
    def _():
        for r in range(run_rows):
            lse_out_ref[b, row0 + r] = merged_lse[r]


def _transposed_run(out_ref, lse_ref, o_ref, lse_out_ref, stage_ref, b, start, count, *, chunk: int,
                    run_cols: int, static_count: bool):
    """Merge and store one CTA's run of [.., R, rows] partials: out_ref [W, R, rows], lse_ref
    [W, rows]; o_ref [B, rows, R], lse_out_ref [B, rows]; stage_ref SMEM [run_cols, rows + pad]
    in o_ref's dtype. The run is columns [col0, col0 + run_cols) of every query row.

    An item's [run_cols, rows] tile is contiguous: loaded one value a thread and load, as
    [tiles, period // 128, 128] (``row_period``), so that the query row of each value depends
    only on its place in a period, the same for every period: the rows' scalar weights become
    one [period // 128, 128] array (a select per row), broadcast over the periods. The merged
    tile is stored to SMEM as it lies and read back as [rows, run_cols]."""
    num_items, rank, num_rows = out_ref.shape
    period = row_period(num_rows)
    shape = (run_cols * num_rows // period, period // WARPGROUP, WARPGROUP)
    col0 = pl.multiple_of(lax.axis_index("run") * run_cols, run_cols)
    tile_layout = plgpu.Layout.WG_STRIDED((run_cols, num_rows), 1)
    row_of = lax.rem(plgpu.broadcasted_iota(jnp.int32, shape[1:], 0, layout=plgpu.Layout.WG_STRIDED(shape[1:], 1))
                     * WARPGROUP
                     + plgpu.broadcasted_iota(jnp.int32, shape[1:], 1, layout=plgpu.Layout.WG_STRIDED(shape[1:], 1)),
                     num_rows)

    def load_tile(item):
        tile = plgpu.load(out_ref.at[item, pl.ds(col0, run_cols)], layout=tile_layout)
        return [tile.astype(jnp.float32).reshape(shape)]

    def scale(tile, weights):
        per_value = jnp.zeros(shape[1:], jnp.float32)
        for r, w in enumerate(weights):
            per_value = jnp.where(row_of == r, w, per_value)
        return [tile[0] * lax.broadcast_in_dim(per_value, shape, (1, 2))]

    merged, merged_lse = _merge(load_tile, lambda item, r: lse_ref[item, r], scale, start, count, chunk=chunk,
                                num_items=num_items, num_rows=num_rows, static_count=static_count)
    stage = stage_ref.at[:, pl.ds(0, num_rows)]
    stage[...] = merged[0].reshape(run_cols, num_rows).astype(stage_ref.dtype)
    plgpu.commit_smem()  # a warpgroup barrier: every thread's part of the tile is in SMEM
    rows_first = plgpu.load(stage.T, layout=plgpu.Layout.WG_STRIDED((num_rows, run_cols), 1))
    o_ref[b, :, pl.ds(col0, run_cols)] = rows_first

    @pl.when(col0 == 0)
    def _():
        for r in range(num_rows):
            lse_out_ref[b, r] = merged_lse[r]


def _stage_type(run_cols: int, num_rows: int, dtype):
    """The SMEM staging tile of a transposed run: [run_cols, rows + pad], the row stride odd in
    4-byte words (a column read back touches every bank once)."""
    words = num_rows * jnp.dtype(dtype).itemsize / 4
    pad = 1 if jnp.dtype(dtype).itemsize == 4 else 2
    return plgpu.SMEM((run_cols, num_rows + (pad if words == int(words) and int(words) % 2 == 0 else 0)), dtype)


def _check_partials(out, lse, transposed: bool):
    """Raise ValueError unless out [.., rows, R] (or [.., R, rows]) and lse [.., rows] agree;
    return (rows, R)."""
    num_rows, rank = (out.shape[-1], out.shape[-2]) if transposed else out.shape[-2:]
    if out.dtype not in (jnp.float32, jnp.bfloat16) or lse.dtype != jnp.float32:
        raise ValueError(f"out, lse: expected float32 or bfloat16 partials and a float32 lse, got {out.dtype} and "
                         f"{lse.dtype}")
    if rank % WARPGROUP or rank & (rank - 1):
        raise ValueError(f"out: expected R a power of two >= {WARPGROUP} (a thread's share of a row), got {rank}")
    return num_rows, rank


def _launch(body, operands, out_type, *, batch: int, runs: int, scratch: list, name: str, interpret: bool):
    """One Mosaic GPU launch of a merge kernel: grid (batch row "b", run "run"), one warpgroup a
    CTA, every operand whole in global memory (a ``jax.Ref`` operand is written in place)."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(batch, runs), grid_names=("b", "run"),
                        kernel_name=name, interpret=plgpu.InterpretGPUParams() if interpret else None)(*operands)


def _splits_kernel(out_ref, lse_ref, o_ref, lse_out_ref, *scratch, num_splits: int, transposed: bool, **run):
    """One (batch row b, run) CTA of ``combine_splits``: out_ref [B * S, rows, R] (or [B * S, R,
    rows]) and lse_ref [B * S, rows], row b's splits at b * S ...; o_ref [B, rows, R], lse_out_ref
    [B, rows] f32; scratch: the SMEM staging tile of a transposed run."""
    b = lax.axis_index("b")
    if transposed:
        _transposed_run(out_ref, lse_ref, o_ref, lse_out_ref, *scratch, b, b * num_splits, num_splits,
                        static_count=True, **run)
    else:
        _flat_run(out_ref, lse_ref, o_ref, lse_out_ref, b, b * num_splits, num_splits, static_count=True, **run)


@functools.partial(jax.jit, static_argnames=("dtype", "transposed", "interpret"))
def combine_splits(out: jax.Array, lse: jax.Array, dtype=jnp.float32, *, transposed: bool = False,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Merge split partials in one Mosaic GPU launch, the math of ``combine_splits_reference``
    (summed in another order: equal to fp32 rounding).

    out [B, S, rows, R] f32 or bf16 (``partial_dtype``; [B, S, R, rows] with ``transposed``: as
    the Mosaic kernel with the query rows on the wgmma N dimension writes it, merged without a
    transposing copy), lse [B, S, rows] f32 -> (merged [B, rows, R] in ``dtype``, lse [B, rows]
    f32). The sums are float32 either way.

    Raises ValueError when the shapes or dtypes disagree (named in the message) or R is not a
    power of two >= 128.
    """
    if out.ndim != 4 or lse.ndim != 3:
        raise ValueError(f"out, lse: expected 4 and 3 dimensions, got {out.shape} and {lse.shape}")
    batch, num_splits = out.shape[:2]
    num_rows, rank = (out.shape[3], out.shape[2]) if transposed else out.shape[2:]
    if lse.shape != (batch, num_splits, num_rows):
        raise ValueError(f"lse: expected shape {(batch, num_splits, num_rows)} to match out {out.shape}"
                         f"{' (transposed)' if transposed else ''}, got {lse.shape}")
    _check_partials(out, lse, transposed)
    run_rows, run_cols = run_shape(num_splits, num_rows, rank, transposed)
    run = dict(chunk=num_splits, run_cols=run_cols) | ({} if transposed else dict(run_rows=run_rows))
    return _launch(functools.partial(_splits_kernel, num_splits=num_splits, transposed=transposed, **run),
                   (out.reshape(batch * num_splits, *out.shape[2:]), lse.reshape(batch * num_splits, num_rows)),
                   (jax.ShapeDtypeStruct((batch, num_rows, rank), dtype),
                    jax.ShapeDtypeStruct((batch, num_rows), jnp.float32)),
                   batch=batch, runs=num_rows * rank // (run_rows * run_cols),
                   scratch=[_stage_type(run_cols, num_rows, dtype)] if transposed else [],
                   name="snapmla_combine_splits", interpret=interpret)


def _items_kernel(out_ref, lse_ref, start_ref, count_ref, o_ref, lse_out_ref, *scratch, transposed: bool, **run):
    """One (batch row b, run) CTA of ``combine_items``: out_ref [W, rows, R] (or [W, R, rows]),
    lse_ref [W, rows] f32, start_ref and count_ref [B] int32; o_ref [B, rows, R] and lse_out_ref
    [B, rows] f32: the caller's outputs, written in place (rows of at most one item left as
    they are); scratch: the SMEM staging tile of a transposed run."""
    b = lax.axis_index("b")
    start, count = start_ref[b], count_ref[b]

    @pl.when(count >= 2)
    def _():
        if transposed:
            _transposed_run(out_ref, lse_ref, o_ref, lse_out_ref, *scratch, b, start, count, static_count=False,
                            **run)
        else:
            _flat_run(out_ref, lse_ref, o_ref, lse_out_ref, b, start, count, static_count=False, **run)


def _check_items_args(out, lse, item_start, item_count, merged, merged_lse, chunk, transposed: bool):
    """Raise ValueError unless ``combine_items``' arguments agree; return (rows, R)."""
    if out.ndim != 3 or lse.ndim != 2:
        raise ValueError(f"out, lse: expected 3 and 2 dimensions ([W, rows, R], [W, rows]), got {out.shape} and "
                         f"{lse.shape}")
    num_rows, rank = (out.shape[2], out.shape[1]) if transposed else out.shape[1:]
    layout = " (transposed: [W, R, rows])" if transposed else ""
    if lse.shape != (out.shape[0], num_rows):
        raise ValueError(f"lse: expected shape {(out.shape[0], num_rows)} to match out {out.shape}{layout}, "
                         f"got {lse.shape}")
    if item_start.ndim != 1 or item_count.shape != item_start.shape:
        raise ValueError(f"item_start, item_count: expected two [B] arrays, got {item_start.shape} and "
                         f"{item_count.shape}")
    batch = item_start.shape[0]
    if merged.shape != (batch, num_rows, rank) or merged_lse.shape != (batch, num_rows):
        raise ValueError(f"merged, merged_lse: expected shapes {(batch, num_rows, rank)} and {(batch, num_rows)} "
                         f"for B={batch} and out {out.shape}{layout}, got {merged.shape} and {merged_lse.shape}")
    if item_start.dtype != jnp.int32 or item_count.dtype != jnp.int32:
        raise ValueError(f"item_start, item_count: expected int32, got {item_start.dtype} and {item_count.dtype}")
    if merged.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16) or merged_lse.dtype != jnp.float32:
        raise ValueError(f"merged, merged_lse: expected a bfloat16, float32 or float16 output and a float32 lse, "
                         f"got {merged.dtype} and {merged_lse.dtype}")
    if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two >= 1, got {chunk!r}")
    if out.size >= 2 ** 31:
        raise ValueError(f"out: expected fewer than 2**31 values (int32 offsets), got {out.size}")
    return _check_partials(out, lse, transposed)


@functools.partial(jax.jit, static_argnames=("chunk", "transposed", "interpret"))
def combine_items(out: jax.Array, lse: jax.Array, item_start: jax.Array, item_count: jax.Array, merged: jax.Array,
                  merged_lse: jax.Array, *, chunk: int, transposed: bool = False,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Merge each batch row's work items into the decode call's outputs, in one Mosaic GPU launch.

    out [W, rows, R] f32 or bf16: normalised partials of W work items ([W, R, rows] with
    ``transposed``, as the 16-row Mosaic kernel writes them); lse [W, rows] f32 (natural log,
    -inf: the item saw no token); item_start, item_count [B] int32: batch row b's items are
    out[item_start[b] : item_start[b] + item_count[b]] (contiguous, not shared with another
    row, within W; a count may be 0 or 1); merged [B, rows, R] bf16, f32 or f16 and merged_lse
    [B, rows] f32: the call's outputs, where the kernel wrote rows of at most one item directly.

    Returns (merged, merged_lse) with each batch row of two or more items replaced by the math
    of ``combine_items_reference`` (float32 sums in another order: equal to fp32 rounding) and
    the other rows as given, bit for bit. The outputs alias merged and merged_lse: inside a jit
    where those are intermediates (the decode kernel's outputs) they are updated in place,
    untouched rows not copied; an array passed from outside is copied first unless donated.

    ``chunk`` (static, a power of two): items a CTA loads in one step (``_merge``); a row of
    more loops over ceil(count / chunk) steps. Runs follow ``combine_splits``' with ``chunk``
    as S, so with every count <= chunk a row takes one step; counts short of ``chunk`` still
    load ``chunk`` items (the last ones again, weighted 0).

    Raises ValueError when shapes or dtypes disagree (named in the message), chunk is not a
    power of two, R is not one >= 128 or out has 2**31 values or more. item_start and
    item_count are data, not checked: out-of-range items are clamped into out, never read past it.
    """
    num_rows, rank = _check_items_args(out, lse, item_start, item_count, merged, merged_lse, chunk, transposed)
    run_rows, run_cols = run_shape(chunk, num_rows, rank, transposed)
    run = dict(chunk=chunk, run_cols=run_cols) | ({} if transposed else dict(run_rows=run_rows))
    merged_ref, merged_lse_ref = jax.new_ref(merged), jax.new_ref(merged_lse)
    _launch(functools.partial(_items_kernel, transposed=transposed, **run),
            (out, lse, item_start, item_count, merged_ref, merged_lse_ref), (),
            batch=item_start.shape[0], runs=num_rows * rank // (run_rows * run_cols),
            scratch=[_stage_type(run_cols, num_rows, merged.dtype)] if transposed else [],
            name="snapmla_combine_items", interpret=interpret)
    return merged_ref[...], merged_lse_ref[...]
