"""The merge of split-KV partials on Mosaic GPU: the one the Mosaic decode kernels run
(``mla_decode_mgpu.merge_items``).

The math of ``combine_splits.combine_splits_reference`` and ``combine_items_reference``
(pallas_kernels/combine_splits.py, with the argument checks):

  merged[b, r] = sum_s exp(lse[b, s, r] - M) out[b, s, r] / sum_s exp(lse[b, s, r] - M)
  lse[b, r]    = M + log(sum_s exp(lse[b, s, r] - M)),   M = max_s lse[b, s, r]

over out [.., rows, R] f32 or bf16 partials (``combine_splits.partial_dtype``) and lse [..,
rows] f32 (natural log; -inf: the split saw nothing).

Layout. One CTA of one warpgroup (128 threads) a (batch row, run of its [rows, R] slab); a run
is ``run_rows`` whole query rows x ``run_cols`` columns (``run_shape``). Its items' partials of
the run go from global memory straight into registers (coalesced vector loads of up to 16 bytes
a thread: each partial is read once, so staging it in SMEM would buy nothing), ``chunk`` items
a step with a step's loads issued together (a static loop), merged online across steps (a
running max). Each weight is computed once per (item, query row), as a scalar, not per value.

- ``combine_splits_mgpu``: every batch row in the same S splits, out [B, S, rows, R] (the
  Mosaic kernels' uniform plan); S is static, so a row's steps are unrolled.
- ``combine_items_mgpu``: a balanced split plan (pallas_kernels/split_plan.py), batch row b in
  item_count[b] work items from item_start[b] of out [W, rows, R], merged into the decode
  call's own outputs in place (``jax.new_ref`` operands: rows of one item, which the kernel
  wrote there directly, are not copied).

Backend: Pallas Mosaic GPU (``plgpu``); interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.combine_splits import check_items_args, check_splits_args, lse_of_total
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import GRID_YZ_MAX

WARPGROUP = 128  # threads of a CTA; a register array of n values needs n % 128 == 0
# Partial values a CTA loads in one step (its ``chunk`` items x its run): 32 a thread, 64 from 33
# items (S padded >= 64: a run of one row's 512 values would otherwise be cut below 128).
MAX_TILE = 4096
MAX_VECTOR_BYTES = 16  # the widest load or store a thread issues (ld.global.v4.b32)
# Values of an item's run a thread loads at least (8-16 byte loads), however many items a step
# holds: with one value a thread (a run of 128, what ``max_tile`` alone gives 64 or more items)
# the merge of 1 x 66 splits x 128 rows took 4.79 us against the Triton merge's 3.99 (H200, bf16;
# the Triton merge of the Triton decode kernels, since removed).
MIN_THREAD_VALUES = 4
# CTAs a merge keeps at least where it can, before it widens a thread's loads: one a run of 512
# values would leave 1 x 66 splits x 16 rows 16 CTAs (2.59 us against 2.04 at 64 CTAs, H200).
MIN_CTAS = 64
# Items a CTA of ``combine_items_mgpu`` loads in a step at most, whatever its ``chunk``. A step
# of a row's whole chunk, items past its count read again weighted 0, was 1.7x slower at 66 items
# (chunk 128). H200, bf16, us at no cap / 32 / 16 / 8 (the Triton merge): 1 x 66 x 128 9.06 /
# 5.91 / 5.46 / 5.78 (7.65); 2 x 33 x 128 5.13 / 5.54 / 4.56 / 4.26 (5.70); 8 x 8 x 128 3.28 /
# 3.19 / 3.16 / 3.20 (3.92); 8 x 16 x 16 2.17 / 2.16 / 2.16 / 2.28 (2.14).
MAX_STEP_ITEMS = 16


def max_tile(num_splits: int) -> int:
    """Partial values a merge CTA loads in one step: 2 x ``MAX_TILE`` from 33 items (S padded
    >= 64), else ``MAX_TILE``."""
    return 2 * MAX_TILE if pl.next_power_of_2(num_splits) >= 64 else MAX_TILE


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (1 at least)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def run_shape(chunk: int, num_rows: int, rank: int, batch: int = 1) -> tuple[int, int]:
    """(run_rows, run_cols): the query rows and columns of R a merge CTA covers, for ``chunk``
    items a step over ``batch`` rows of [num_rows, R] slabs: ``run_cols`` a power of two dividing
    R, >= 128 (a thread's share of a row is contiguous values), then whole rows dividing
    ``num_rows``; at most ``max_tile(chunk)`` values for the step's items in all, and more (up to
    ``MIN_THREAD_VALUES`` a thread and item) while the grid keeps ``MIN_CTAS`` CTAs."""
    values = max(WARPGROUP, max_tile(chunk) // pl.next_power_of_2(chunk))
    while values < WARPGROUP * MIN_THREAD_VALUES and batch * num_rows * rank // (2 * values) >= MIN_CTAS:
        values *= 2
    cols = min(rank, pl.next_power_of_2(values))
    while rank % cols:
        cols //= 2
    return _largest_divisor(num_rows, values // cols), cols


def _vector(num_values: int, dtype) -> int:
    """Contiguous values a thread loads of a row's ``num_values``: up to 16 bytes."""
    return max(1, min(num_values // WARPGROUP, MAX_VECTOR_BYTES // jnp.dtype(dtype).itemsize))


def _merge(load_tile, load_lse, start, count, *, chunk: int, num_items: int, num_rows: int, static_count: bool):
    """Merge one batch row's ``count`` items from item ``start`` over one CTA's run.

    load_tile(item) -> the item's partials of the run, one f32 array a query row; load_lse(item,
    r) -> the f32 scalar lse of the run's query row r (of ``num_rows``). Returns (merged rows,
    f32 arrays; their merged lse, scalars).

    ``chunk`` items a step, their loads issued together. With ``static_count`` ``count`` is a
    Python int (every item real). Otherwise items past ``count`` read the row's first item again
    (finite, unlike another row's unused items) weighted 0, and every index is clamped into [0,
    ``num_items``): a bad start or count can not read past out. Steps after the first rescale
    the running total and sum by exp(old max - new max) (one more rounding of the weights).
    """
    def items_of(k):
        offsets = [k * chunk + j for j in range(chunk)]
        if static_count:
            return [(start + o, True) for o in offsets if o < count]
        return [(jnp.clip(jnp.where(o < count, start + o, start), 0, num_items - 1), o < count) for o in offsets]

    def weigh(k, top):
        """Step k's (item, real) pairs, their lse per query row, and the rows' new max."""
        members = items_of(k)
        lses = [[jnp.where(real, load_lse(item, r), -jnp.inf) for r in range(num_rows)] for item, real in members]
        return members, lses, [functools.reduce(jnp.maximum, [row[r] for row in lses], top[r])
                               for r in range(num_rows)]

    def shift_of(top):
        return [jnp.where(t == -jnp.inf, 0.0, t) for t in top]  # no item saw the row yet: weights 0

    def add_items(members, lses, shift, acc, total):
        for (item, _), row_lse in zip(members, lses):
            weights = [jnp.exp(row_lse[r] - shift[r]) for r in range(num_rows)]
            terms = [x * w for x, w in zip(load_tile(item), weights)]
            acc = terms if acc is None else [a + x for a, x in zip(acc, terms)]
            total = weights if total is None else [t + w for t, w in zip(total, weights)]
        return acc, total

    def step(k, carry):
        top, total, acc = carry
        members, lses, new_top = weigh(k, top)
        shift = shift_of(new_top)
        rescale = [jnp.exp(t - s) for t, s in zip(top, shift)]  # 0 while top is -inf, 1 while the max holds
        acc = [a * c for a, c in zip(acc, rescale)]
        total = [t * c for t, c in zip(total, rescale)]
        acc, total = add_items(members, lses, shift, acc, total)
        return new_top, total, acc

    members, lses, top = weigh(0, [jnp.float32(-jnp.inf)] * num_rows)
    acc, total = add_items(members, lses, shift_of(top), None, None)
    carry = (top, total, acc)
    if static_count:
        for k in range(1, -(-count // chunk)):
            carry = step(k, carry)
    else:
        carry = lax.fori_loop(1, lax.div(count + (chunk - 1), chunk), step, carry)
    top, total, acc = carry
    merged = [a * (1.0 / jnp.where(t > 0, t, 1.0)) for a, t in zip(acc, total)]
    return merged, [lse_of_total(t, jnp.where(m == -jnp.inf, 0.0, m)) for t, m in zip(total, top)]


def _merge_run(out_ref, lse_ref, o_ref, lse_out_ref, b, start, count, *, chunk: int, run_rows: int,
               run_cols: int, static_count: bool) -> None:
    """Merge and store one CTA's run: out_ref [W, rows, R], lse_ref [W, rows]; o_ref [B, rows,
    R], lse_out_ref [B, rows]. Grid axis "run" numbers the runs row-major; the CTA of a row's
    first columns writes its merged lse."""
    num_items, _, rank = out_ref.shape
    runs_per_row = rank // run_cols
    run = lax.axis_index("run")
    row0 = run // runs_per_row * run_rows
    col0 = pl.multiple_of(run % runs_per_row * run_cols, run_cols)
    layout = plgpu.Layout.WG_STRIDED((run_cols,), _vector(run_cols, out_ref.dtype))

    def load_tile(item):
        return [plgpu.load(out_ref.at[item, row0 + r, pl.ds(col0, run_cols)], layout=layout).astype(jnp.float32)
                for r in range(run_rows)]

    merged, lses = _merge(load_tile, lambda item, r: lse_ref[item, row0 + r], start, count, chunk=chunk,
                          num_items=num_items, num_rows=run_rows, static_count=static_count)
    for r in range(run_rows):
        o_ref[b, row0 + r, pl.ds(col0, run_cols)] = merged[r].astype(o_ref.dtype)

    @pl.when(col0 == 0)
    def _():
        for r in range(run_rows):
            lse_out_ref[b, row0 + r] = lses[r]


def _launch(body, operands, out_type, *, batch: int, runs: int, name: str, interpret: bool):
    """One Mosaic GPU launch of a merge: grid (batch row "b", run "run"), one warpgroup a CTA,
    every operand whole in global memory (a ``jax.Ref`` operand is written in place)."""
    if batch > GRID_YZ_MAX:  # the batch rows go to CUDA's y (the runs to x)
        raise ValueError(f"out: {batch} batch rows, past the {GRID_YZ_MAX} a CUDA grid's y takes; merge them in parts")
    return plgpu.kernel(body, out_type=out_type, grid=(batch, runs), grid_names=("b", "run"), kernel_name=name,
                        interpret=plgpu.InterpretGPUParams() if interpret else None)(*operands)


def _check_rank(rank: int) -> None:
    if rank % WARPGROUP or rank & (rank - 1):
        raise ValueError(f"out: expected R a power of two >= {WARPGROUP} (a thread's share of a row), got {rank}")


def _splits_kernel(out_ref, lse_ref, o_ref, lse_out_ref, *, num_splits: int, **run):
    """One (batch row b, run) CTA of ``combine_splits_mgpu``: out_ref [B * S, rows, R], lse_ref
    [B * S, rows] (row b's splits from b * S); o_ref [B, rows, R], lse_out_ref [B, rows] f32."""
    b = lax.axis_index("b")
    _merge_run(out_ref, lse_ref, o_ref, lse_out_ref, b, b * num_splits, num_splits, static_count=True, **run)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def combine_splits_mgpu(out: jax.Array, lse: jax.Array, dtype=jnp.float32, *,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Merge split partials in one Mosaic GPU launch: out [B, S, rows, R] f32 or bf16, lse [B, S,
    rows] f32 -> (merged [B, rows, R] in ``dtype``, lse [B, rows] f32), float32 sums; the math of
    ``combine_splits_reference`` summed in another order (equal to float32 rounding).

    Raises ValueError when the shapes or dtypes disagree (named in the message) or R is not a
    power of two >= 128.
    """
    batch, num_splits, num_rows, rank = check_splits_args(out, lse)
    _check_rank(rank)
    chunk = min(num_splits, MAX_STEP_ITEMS)
    run_rows, run_cols = run_shape(chunk, num_rows, rank, batch)
    return _launch(functools.partial(_splits_kernel, num_splits=num_splits, chunk=chunk, run_rows=run_rows,
                                     run_cols=run_cols),
                   (out.reshape(batch * num_splits, num_rows, rank), lse.reshape(batch * num_splits, num_rows)),
                   (jax.ShapeDtypeStruct((batch, num_rows, rank), dtype),
                    jax.ShapeDtypeStruct((batch, num_rows), jnp.float32)),
                   batch=batch, runs=num_rows * rank // (run_rows * run_cols), name="snapmla_combine_splits_mgpu",
                   interpret=interpret)


def _items_kernel(out_ref, lse_ref, start_ref, count_ref, o_ref, lse_out_ref, **run):
    """One (batch row b, run) CTA of ``combine_items_mgpu``: out_ref [W, rows, R], lse_ref [W,
    rows] f32, start_ref and count_ref [B] int32; o_ref [B, rows, R] and lse_out_ref [B, rows]
    f32, the caller's outputs written in place (rows of at most one item left as they are)."""
    b = lax.axis_index("b")
    start, count = start_ref[b], count_ref[b]

    @pl.when(count >= 2)
    def _():
        _merge_run(out_ref, lse_ref, o_ref, lse_out_ref, b, start, count, static_count=False, **run)


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def combine_items_mgpu(out: jax.Array, lse: jax.Array, item_start: jax.Array, item_count: jax.Array,
                       merged: jax.Array, merged_lse: jax.Array, *, chunk: int,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Merge each batch row's work items into the decode call's outputs, in one Mosaic GPU launch.

    The math of ``combine_splits.combine_items_reference``: out [W, rows, R] f32 or bf16, lse
    [W, rows] f32, item_start and item_count [B] int32, merged [B, rows, R] bf16, f32 or f16 and
    merged_lse [B, rows] f32 (the call's outputs, where the kernel wrote rows of at most one item
    directly; those come back bit for bit). The outputs alias merged and merged_lse: inside a
    jit where those are intermediates they are updated in place.

    ``chunk`` (static, a power of two): items a CTA loads in one step, at most ``MAX_STEP_ITEMS``;
    a row of more loops over its steps, and a step short of items loads the row's first again,
    weighted 0. Raises ValueError as ``combine_splits.check_items_args`` does, and for R not a power
    of two >= 128. item_start and item_count are data, not checked: out-of-range items are
    clamped into out, never read past it.
    """
    num_rows, rank = check_items_args(out, lse, item_start, item_count, merged, merged_lse, chunk)
    _check_rank(rank)
    chunk = min(chunk, MAX_STEP_ITEMS)
    run_rows, run_cols = run_shape(chunk, num_rows, rank, item_start.shape[0])
    merged_ref, merged_lse_ref = jax.new_ref(merged), jax.new_ref(merged_lse)
    _launch(functools.partial(_items_kernel, chunk=chunk, run_rows=run_rows, run_cols=run_cols),
            (out, lse, item_start, item_count, merged_ref, merged_lse_ref), (),
            batch=item_start.shape[0], runs=num_rows * rank // (run_rows * run_cols),
            name="snapmla_combine_items_mgpu", interpret=interpret)
    return merged_ref[...], merged_lse_ref[...]
