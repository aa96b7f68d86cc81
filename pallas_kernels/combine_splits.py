"""Merging split-KV partials in one launch, and its jnp reference.

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
Here one program per (batch row, run of values) loads every split's values of
that run at once (S padded to a power of two, masked), so no loop over splits
serialises the loads' latency, and writes the merged values in the caller's dtype.

Two entry points:

- ``combine_splits``: every batch row in the same S splits, out [B, S, ...] (the Triton
  decode kernels).
- ``combine_items``: a load-balanced split plan (pallas_kernels/split_plan.py), batch row b in
  a dynamic number of work items, item_count[b], laid out flat from item_start[b] in out [W,
  ...]. It updates the decode call's own outputs in place (rows of one item were written there
  directly) and loads ``chunk`` items at a time, looping over chunks with a running max.

Backend: Pallas' Triton lowering, as the Triton decode kernels (masked
gathers of arbitrary rows; interpret mode on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
try:  # Pallas' Triton backend, deprecated and to be removed: ``pallas_triton_available``
    from jax.experimental.pallas import triton as plgpu_tr
except ImportError:
    plgpu_tr = None

# Partial values one program holds (S padded x its run of a split's slab), so that the loads of
# every split are issued at once: ``max_tile``. H100, kernel us, 4096 / 2048 / 8192 at 4 warps:
# 1 x 8 x 128 2.84 / 3.29 / 3.31 (scripts/tune_combine_splits.py --cases 1x8x128 ...).
MAX_TILE = 4096


def max_tile(num_splits: int) -> int:
    """Partial values a merge program holds at most: 2 x ``MAX_TILE`` from 33 splits (S padded
    >= 64), else ``MAX_TILE``.

    H100, bf16 partials, kernel us, 8192 vs 4096 values at 2 warps: 1 x 66 x 128 4.00 vs 5.27
    (scripts/tune_combine_splits.py --partial-dtype bfloat16).
    """
    return 2 * MAX_TILE if pl.next_power_of_2(num_splits) >= 64 else MAX_TILE


def num_warps(num_splits: int) -> int:
    """Warps a merge program runs: 2 from 9 splits (S padded >= 16), else 4.

    H100, bf16 partials, kernel us at ``max_tile``: 2 vs 4 warps at 8 x 16 x 128 5.00 vs 7.27; 4 vs
    2 at 1 x 8 x 128 1.83 vs 3.01 (scripts/tune_combine_splits.py --partial-dtype bfloat16).
    """
    return 2 if pl.next_power_of_2(num_splits) >= 16 else 4


def partial_dtype(out_dtype) -> jnp.dtype:
    """The dtype a split decode kernel's normalised partials take for a merged output of
    ``out_dtype``: bf16 for a bf16 output, else float32.

    A bf16 output keeps 8 significant bits, and so may its partials: the merge is a weighted
    average (weights summing to 1), so partials rounded to bf16 move the result by at most what
    the output's own rounding does (half an ulp, <= 2**-8 of the largest partial). At small
    batches the partials outweigh the cache: at B=1 x 16k x 128 heads (66 splits of ~250 tokens)
    float32 ones are 17 MB written and read back against 10.5 MB of FP8 cache. H100: the merge
    5-15% faster from bf16 (scripts/tune_combine_splits.py --partial-dtype bfloat16 vs float32).
    """
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def pallas_triton_available() -> bool:
    """Whether this jax still has Pallas' Triton backend (``jax.experimental.pallas.triton``),
    deprecated since jax 0.11.0 and announced for removal (docs/triton_backend.md): the Triton
    decode kernels and this module's merge lower through it. Without it ``mla_decode`` runs what
    the Triton kernels would have run as the XLA path of the same math, and the Mosaic kernels
    merge on Mosaic GPU."""
    return plgpu_tr is not None


def require_pallas_triton(launcher: str) -> None:
    """RuntimeError naming ``launcher`` where this jax has no Pallas Triton backend."""
    if not pallas_triton_available():
        raise RuntimeError(f"{launcher} lowers through Pallas' Triton backend, which jax {jax.__version__} does not "
                           "have; mla_decode runs the XLA path in its place (combine_splits.pallas_triton_available)")


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


def tile_size(num_splits: int, slab: int) -> int:
    """Values of each split's slab (its rows x R partials, ``slab`` floats) a program merges:
    a power of two dividing ``slab``, with S padded to a power of two at most ``max_tile`` in all."""
    size = max(1, max_tile(num_splits) // pl.next_power_of_2(num_splits))
    while slab % size:
        size //= 2
    return size


def _split_weights(lse_ref, b, num_splits: int, num_rows: int, rows):
    """Per split and row: (flat partial index [S'], real split [S'] bool, weight [S', n],
    lse max [n], total [n]) of batch row ``b``'s query rows ``rows`` [n], S' = S padded to a
    power of two.

    Padding splits read split 0 (in bounds) and are masked to lse -inf, weight 0; a row no
    split saw keeps lse max 0 and total 0."""
    splits = jnp.arange(pl.next_power_of_2(num_splits), dtype=jnp.int32)
    real = splits < num_splits
    partial_index = b * num_splits + jnp.where(real, splits, 0)
    mask = jnp.broadcast_to(real[:, None], (splits.shape[0], rows.shape[0]))
    lse = plgpu_tr.load(lse_ref.at[partial_index[:, None] * num_rows + rows[None, :]], mask=mask, other=-jnp.inf)
    lse_max = jnp.max(lse, axis=0)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
    weight = jnp.exp(lse - lse_max[None, :])  # 0 for empty and padding splits
    return partial_index, real, weight, lse_max, jnp.sum(weight, axis=0)


def lse_of_total(total, lse_max):
    """The merged log-sum-exp of a row from its weights' total and max (-inf: no split saw it)."""
    return jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + lse_max, -jnp.inf)


def _combine_kernel(out_ref, lse_ref, o_ref, lse_out_ref, *, num_splits: int, num_rows: int, rank: int,
                    size: int):
    """One (batch row, run of ``size`` values of a split's [rows, R] slab) program.

    out_ref [B * S * rows * R] f32 or bf16 and lse_ref [B * S * rows] f32: the partials, flat;
    o_ref [B * rows * R] (the caller's dtype) and lse_out_ref [B * rows] f32, flat. All whole
    arrays. The run is ``size`` // R whole rows, or a piece of one row (``size`` and R are powers
    of two): the program reads its [S, rows of the run, columns] values at once and each
    split's weight once a row (not once a value: with many splits a run is a few dozen values
    of one row, and a weight a value would be an exp and an lse load a value). The program that
    starts a row writes its merged lse.
    """
    b, run = pl.program_id(0), pl.program_id(1)
    run_rows, run_cols = max(1, size // rank), min(size, rank)
    first = run * size  # in the slab
    rows = first // rank + jnp.arange(run_rows, dtype=jnp.int32)
    columns = first % rank + jnp.arange(run_cols, dtype=jnp.int32)
    partial_index, real, weight, lse_max, total = _split_weights(lse_ref, b, num_splits, num_rows, rows)
    offsets = (partial_index[:, None, None] * num_rows + rows[None, :, None]) * rank + columns[None, None, :]
    partials = plgpu_tr.load(out_ref.at[offsets], mask=jnp.broadcast_to(real[:, None, None], offsets.shape),
                             other=0.0).astype(jnp.float32)
    merged = jnp.sum(partials * weight[:, :, None], axis=0) / jnp.where(total > 0, total, 1.0)[:, None]
    plgpu_tr.store(o_ref.at[(b * num_rows + rows[:, None]) * rank + columns[None, :]], merged.astype(o_ref.dtype))

    @pl.when(first % rank == 0)
    def _():
        plgpu_tr.store(lse_out_ref.at[b * num_rows + rows], lse_of_total(total, lse_max))


def check_splits_args(out: jax.Array, lse: jax.Array) -> tuple[int, int, int, int]:
    """Raise ValueError unless out [B, S, rows, R] f32 or bf16 and lse [B, S, rows] f32 agree
    (the arguments of ``combine_splits``); return (B, S, rows, R)."""
    if out.ndim != 4 or lse.ndim != 3:
        raise ValueError(f"out, lse: expected 4 and 3 dimensions, got {out.shape} and {lse.shape}")
    batch, num_splits, num_rows, rank = out.shape
    if lse.shape != (batch, num_splits, num_rows):
        raise ValueError(f"lse: expected shape {(batch, num_splits, num_rows)} to match out {out.shape}, "
                         f"got {lse.shape}")
    if out.dtype not in (jnp.float32, jnp.bfloat16) or lse.dtype != jnp.float32:
        raise ValueError(f"out, lse: expected float32 or bfloat16 partials and a float32 lse, got {out.dtype} "
                         f"and {lse.dtype}")
    return batch, num_splits, num_rows, rank


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def combine_splits(out: jax.Array, lse: jax.Array, dtype=jnp.float32, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Merge split partials in one Pallas launch, the math of ``combine_splits_reference``
    (summed in another order: equal to fp32 rounding).

    out [B, S, rows, R] f32 or bf16 (``partial_dtype``), lse [B, S, rows] f32 -> (merged
    [B, rows, R] in ``dtype``, lse [B, rows] f32). The sums are float32 either way.
    """
    require_pallas_triton("combine_splits")
    batch, num_splits, num_rows, rank = check_splits_args(out, lse)
    size = tile_size(num_splits, num_rows * rank)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    merged, merged_lse = pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=num_splits, num_rows=num_rows, rank=rank, size=size),
        grid=(batch, num_rows * rank // size),
        in_specs=[whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((batch * num_rows * rank,), dtype),
                   jax.ShapeDtypeStruct((batch * num_rows,), jnp.float32)],
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=num_warps(num_splits), num_stages=1),
        name="snapmla_combine_splits",
    )(out.reshape(-1), lse.reshape(-1))
    return merged.reshape(batch, num_rows, rank), merged_lse.reshape(batch, num_rows)


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
            jnp.where(several, lse_of_total(total, lse_max), merged_lse))


def _merge_items(out_ref, lse_ref, start, count, rows, within, *, chunk: int, num_rows: int, rank: int):
    """Merge one batch row's ``count`` items (from item ``start``) over a tile of their slabs.

    rows [n] int32: the tile's query rows; within [n, c] int32: the tile's offsets inside an
    item's [rows, R] slab. Returns (merged [n, c] f32, merged lse [n] f32).

    ``chunk`` items a step, their loads issued together (those past ``count`` masked, reading
    the row's first item: in bounds), merged online: a running max of the lse's, the weights'
    total and the weighted sum are rescaled by exp(old max - new max) when the max grows (each
    step one more rounding of the weights: exact to float32 rounding). A row of at most
    ``chunk`` items takes one step, the work of ``combine_splits``' program. Item indices are
    clamped into out, so a bad item_start or item_count can not read past it.
    """
    num_items = lse_ref.shape[0] // num_rows
    lanes = jnp.arange(chunk, dtype=jnp.int32)

    def step(k, carry):
        top, total, acc = carry
        real = k * chunk + lanes < count
        index = jnp.minimum(jnp.maximum(start + jnp.where(real, k * chunk + lanes, 0), 0), num_items - 1)
        lse = plgpu_tr.load(lse_ref.at[index[:, None] * num_rows + rows[None, :]],
                            mask=jnp.broadcast_to(real[:, None], (chunk, rows.shape[0])), other=-jnp.inf)
        offsets = index[:, None, None] * (num_rows * rank) + within[None]
        partials = plgpu_tr.load(out_ref.at[offsets], mask=jnp.broadcast_to(real[:, None, None], offsets.shape),
                                 other=0.0).astype(jnp.float32)
        new_top = jnp.maximum(top, jnp.max(lse, axis=0))
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no item saw the row yet: weights all 0
        rescale = jnp.exp(top - shift)  # 0 on the first step (top -inf), 1 while the max holds
        weight = jnp.exp(lse - shift[None, :])  # 0 for masked and empty items
        acc = acc * rescale[:, None] + jnp.sum(partials * weight[:, :, None], axis=0)
        return new_top, total * rescale + jnp.sum(weight, axis=0), acc

    init = (jnp.full(rows.shape, -jnp.inf, jnp.float32), jnp.zeros(rows.shape, jnp.float32),
            jnp.zeros(within.shape, jnp.float32))
    # The first chunk outside the loop: rows of at most ``chunk`` items (a uniform batch) skip
    # it. H200, bf16 partials, kernel us, first chunk outside vs inside the loop: 32 x 2 x 128
    # 4.47 vs 4.77, 8 x 16 x 128 6.04 vs 6.66, 1 x 66 x 128 7.07 vs 7.43.
    top, total, acc = lax.fori_loop(1, lax.div(count + (chunk - 1), chunk), step, step(0, init))
    merged = acc / jnp.where(total > 0, total, 1.0)[:, None]
    return merged, lse_of_total(total, jnp.where(top == -jnp.inf, 0.0, top))


def _items_kernel(out_ref, lse_ref, start_ref, count_ref, _merged_in, _merged_lse_in, o_ref, lse_out_ref, *,
                  chunk: int, num_rows: int, rank: int, size: int):
    """One (batch row, run of ``size`` values of its [rows, R] slab) program, partials [W, rows, R].

    out_ref [W * rows * R] f32 or bf16 and lse_ref [W * rows] f32: the items' partials, flat;
    start_ref, count_ref [B] int32; o_ref [B * rows * R] (the output's dtype) and lse_out_ref
    [B * rows] f32: the merged outputs, flat, aliased to _merged_in and _merged_lse_in (the
    caller's values, left as they are in rows of at most one item). The run is split as in
    ``_combine_kernel``; the program that starts a query row writes its merged lse.
    """
    b, run = pl.program_id(0), pl.program_id(1)
    start, count = start_ref[b], count_ref[b]
    run_rows, run_cols = max(1, size // rank), min(size, rank)
    first = run * size  # in the slab
    rows = first // rank + jnp.arange(run_rows, dtype=jnp.int32)
    columns = first % rank + jnp.arange(run_cols, dtype=jnp.int32)

    @pl.when(count >= 2)
    def _():
        merged, merged_lse = _merge_items(out_ref, lse_ref, start, count, rows, rows[:, None] * rank + columns[None, :],
                                          chunk=chunk, num_rows=num_rows, rank=rank)
        plgpu_tr.store(o_ref.at[(b * num_rows + rows[:, None]) * rank + columns[None, :]], merged.astype(o_ref.dtype))

        @pl.when(first % rank == 0)
        def _():
            plgpu_tr.store(lse_out_ref.at[b * num_rows + rows], merged_lse)


def check_items_args(out, lse, item_start, item_count, merged, merged_lse, chunk):
    """Raise ValueError unless ``combine_items``' arguments agree; return (rows, R)."""
    if out.ndim != 3 or lse.ndim != 2:
        raise ValueError(f"out, lse: expected 3 and 2 dimensions ([W, rows, R], [W, rows]), got {out.shape} and "
                         f"{lse.shape}")
    num_rows, rank = out.shape[1:]
    if lse.shape != (out.shape[0], num_rows):
        raise ValueError(f"lse: expected shape {(out.shape[0], num_rows)} to match out {out.shape}, "
                         f"got {lse.shape}")
    if item_start.ndim != 1 or item_count.shape != item_start.shape:
        raise ValueError(f"item_start, item_count: expected two [B] arrays, got {item_start.shape} and "
                         f"{item_count.shape}")
    batch = item_start.shape[0]
    if merged.shape != (batch, num_rows, rank) or merged_lse.shape != (batch, num_rows):
        raise ValueError(f"merged, merged_lse: expected shapes {(batch, num_rows, rank)} and {(batch, num_rows)} "
                         f"for B={batch} and out {out.shape}, got {merged.shape} and {merged_lse.shape}")
    if out.dtype not in (jnp.float32, jnp.bfloat16) or lse.dtype != jnp.float32:
        raise ValueError(f"out, lse: expected float32 or bfloat16 partials and a float32 lse, got {out.dtype} and "
                         f"{lse.dtype}")
    if item_start.dtype != jnp.int32 or item_count.dtype != jnp.int32:
        raise ValueError(f"item_start, item_count: expected int32, got {item_start.dtype} and {item_count.dtype}")
    if merged.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16) or merged_lse.dtype != jnp.float32:
        raise ValueError(f"merged, merged_lse: expected a bfloat16, float32 or float16 output and a float32 lse, "
                         f"got {merged.dtype} and {merged_lse.dtype}")
    if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two >= 1, got {chunk!r}")
    if rank & (rank - 1):
        raise ValueError(f"out: expected R a power of two (runs of values tile it), got {rank}")
    if out.size >= 2 ** 31:
        raise ValueError(f"out: expected fewer than 2**31 values (int32 offsets), got {out.size}")
    return num_rows, rank


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def combine_items(out: jax.Array, lse: jax.Array, item_start: jax.Array, item_count: jax.Array, merged: jax.Array,
                  merged_lse: jax.Array, *, chunk: int, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Merge each batch row's work items into the decode call's outputs, in one Pallas launch.

    out [W, rows, R] f32 or bf16: normalised partials of W work items; lse [W, rows] f32 (natural log,
    -inf: the item saw no token); item_start, item_count [B] int32: batch row b's items are
    out[item_start[b] : item_start[b] + item_count[b]] (contiguous, not shared with another
    row, within W; a count may be 0 or 1); merged [B, rows, R] bf16, f32 or f16 and merged_lse
    [B, rows] f32: the call's outputs, where the kernel wrote rows of at most one item directly.

    Returns (merged, merged_lse) with each batch row of two or more items replaced by the math
    of ``combine_items_reference`` (float32 sums in another order: equal to fp32 rounding) and
    the other rows as given, bit for bit. The outputs alias merged and merged_lse: inside a jit
    where those are intermediates (the decode kernel's outputs) they are updated in place,
    untouched rows not copied; an array passed from outside is copied first unless donated.

    ``chunk`` (static, a power of two): items a program loads at once (``_merge_items``); a row
    of more loops over ceil(count / chunk) chunks. Tiles and warps follow ``combine_splits``'
    with ``chunk`` as S, so with every count <= chunk a row takes one step.

    Cost, H200, bf16 partials and output, kernel us from the profiler, uniform batches (B x
    count x rows, chunk = count rounded up) against ``combine_splits``: 1 x 8 x 128 1.82 vs 1.73,
    16 x 4 x 128 3.81 vs 3.33, 8 x 16 x 128 6.04 vs 5.01, 1 x 64 x 128 3.88 vs 3.38: the row's item_start and item_count are loaded
    before its partials' addresses are known (one more memory latency). Counts short of
    ``chunk`` leave lanes masked at run time where ``combine_splits`` compiles them out: 1 x 66
    x 128 7.07 at chunk 128 (6.31 at 64, two steps) vs 4.25. Each chunk past the first adds
    ~2.3 us to a long row (7 rows of one item and one of 128 at chunk 16: 19.4 us; 32 rows of 8
    items and one of 64 at chunk 8: 25.7 us). Prefetching the next chunk in the loop saved 18%
    on such rows but cost 7-8% on uniform batches; pipelining (``num_stages`` 2, 3) changed
    nothing.

    Raises ValueError when shapes or dtypes disagree (named in the message), chunk is not a
    power of two, R is not one or out has 2**31 values or more. item_start and item_count are
    data, not checked: out-of-range items are clamped into out, never read past it.
    """
    require_pallas_triton("combine_items")
    num_rows, rank = check_items_args(out, lse, item_start, item_count, merged, merged_lse, chunk)
    size = tile_size(chunk, num_rows * rank)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    new_merged, new_lse = pl.pallas_call(
        functools.partial(_items_kernel, chunk=chunk, num_rows=num_rows, rank=rank, size=size),
        grid=(item_start.shape[0], num_rows * rank // size),
        in_specs=[whole] * 6,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((merged.size,), merged.dtype),
                   jax.ShapeDtypeStruct((merged_lse.size,), jnp.float32)],
        input_output_aliases={4: 0, 5: 1},
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=num_warps(chunk), num_stages=1),
        name="snapmla_combine_items",
    )(out.reshape(-1), lse.reshape(-1), item_start, item_count, merged.reshape(-1), merged_lse.reshape(-1))
    return new_merged.reshape(merged.shape), new_lse.reshape(merged_lse.shape)
