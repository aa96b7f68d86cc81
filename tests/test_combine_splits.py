"""The split-KV merge of the Mosaic decode kernels (combine_splits_mgpu.py) and its references
(combine_splits.py) against a float64 merge, in interpret mode (compiled on a GPU: ``-m gpu``),
and its lowering for CUDA on the CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from snapmla_jax.backend import lower_for_cuda
from snapmla_jax.pallas_kernels import combine_splits_mgpu as mosaic
from snapmla_jax.pallas_kernels.combine_splits import combine_items_reference, combine_splits_reference, partial_dtype

# Each merge as (combine_splits, combine_items).
MERGES = {"mosaic": (mosaic.combine_splits_mgpu, mosaic.combine_items_mgpu)}
merges = pytest.mark.parametrize("merge", list(MERGES))


def merge_float64(out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out [B, S, rows, R], lse [B, S, rows] -> merged [B, rows, R], lse [B, rows], in float64."""
    out, lse = out.astype(np.float64), lse.astype(np.float64)
    top = lse.max(axis=1, keepdims=True)
    top = np.where(np.isneginf(top), 0.0, top)
    weight = np.exp(lse - top)
    total = weight.sum(axis=1)
    merged = np.einsum("bsr,bsrd->brd", weight, out) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        merged_lse = np.where(total > 0, np.log(total) + top[:, 0], -np.inf)
    return merged, merged_lse


def random_partials(seed: int, batch: int, splits: int, rows: int, rank: int = 512):
    """Partials as a split decode leaves them: normalised outputs with outlier rows, log-sum-exps
    spread over +-40 (weights down to e^-80 next to 1), some splits that saw nothing (lse -inf,
    out 0: the tail splits of a short row) and one query row no split saw."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((batch, splits, rows, rank)).astype(np.float32)
    out[:, :, rows // 2] *= 300.0  # an outlier row
    lse = (rng.standard_normal((batch, splits, rows)) * 20.0).astype(np.float32)
    if splits > 1:
        lse[0, splits // 2:] = -np.inf  # batch row 0: its last splits are past its seq_len
        out[0, splits // 2:] = 0.0
    lse[-1, :, 1] = -np.inf  # a query row that saw no token in any split (seq_len 0)
    out[-1, :, 1] = 0.0
    return out, lse


# (batch, splits, rows): odd batch, split counts that are and are not powers of two (padded
# to one in the kernel), up to the planner's 128; 16/32/64-row blocks, and 48 rows (three
# 16-row blocks).
SHAPES = [(3, 5, 16), (1, 66, 64), (2, 128, 16), (1, 2, 32), (5, 3, 64), (3, 3, 48)]


@merges
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_combine_matches_float64(shape, merge):
    out, lse = random_partials(sum(shape), *shape)
    want, want_lse = merge_float64(out, lse)
    merged, merged_lse = MERGES[merge][0](jnp.asarray(out), jnp.asarray(lse), jnp.float32, interpret=True)
    # float32 sums of <= 128 terms with weights <= 1 and a float32 exp/log: a few ulps of
    # the largest partial (|out| <= ~1500 here), 1e-6 relative to it; the lse to 1e-6 of its size.
    scale = np.abs(out).max()
    np.testing.assert_allclose(np.asarray(merged), want, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-6, atol=1e-5)
    assert np.isneginf(np.asarray(merged_lse)[-1, 1]) and not np.asarray(merged)[-1, 1].any()


@merges
def test_combine_casts_to_the_callers_dtype(merge):
    out, lse = random_partials(7, 2, 6, 16)
    want, _ = merge_float64(out, lse)
    merged, _ = MERGES[merge][0](jnp.asarray(out), jnp.asarray(lse), jnp.bfloat16, interpret=True)
    assert merged.dtype == jnp.bfloat16
    # bf16 keeps 8 significant bits: within 2**-8 of each value (plus the float32 error).
    np.testing.assert_allclose(np.asarray(merged, np.float32), want, rtol=2.0 ** -8, atol=1e-6 * np.abs(out).max())


@merges
@pytest.mark.parametrize("shape", [(3, 5, 16), (1, 66, 64), (2, 2, 64)], ids=lambda s: "x".join(map(str, s)))
def test_combine_takes_bf16_partials(shape, merge):
    """bf16 partials (``partial_dtype`` of a bf16 output) are merged in float32: as float64 on
    the rounded partials to float32's error, and within one bf16 rounding (half an ulp: at most
    2**-8 of the value) of the largest partial of the float64 merge of the unrounded ones."""
    out, lse = random_partials(sum(shape) + 11, *shape)
    rounded = np.asarray(jnp.asarray(out, jnp.bfloat16).astype(jnp.float32))
    merged, merged_lse = MERGES[merge][0](jnp.asarray(rounded, jnp.bfloat16), jnp.asarray(lse), jnp.float32,
                                          interpret=True)
    want, want_lse = merge_float64(rounded, lse)
    scale = np.abs(out).max()
    np.testing.assert_allclose(np.asarray(merged), want, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-6, atol=1e-5)
    exact, _ = merge_float64(out, lse)
    np.testing.assert_allclose(np.asarray(merged), exact, rtol=0, atol=2.0 ** -8 * scale)
    ref, _ = combine_splits_reference(jnp.asarray(rounded, jnp.bfloat16), jnp.asarray(lse))
    np.testing.assert_allclose(np.asarray(ref), want, rtol=0, atol=1e-6 * scale)


def test_partial_dtype_follows_the_output():
    assert partial_dtype(jnp.bfloat16) == jnp.bfloat16
    assert partial_dtype(jnp.float32) == jnp.float32
    assert partial_dtype(jnp.float16) == jnp.float32  # f16's range (65504) is not the partials'


def test_reference_agrees_with_float64():
    out, lse = random_partials(3, 3, 5, 16)
    want, want_lse = merge_float64(out, lse)
    merged, merged_lse = combine_splits_reference(jnp.asarray(out), jnp.asarray(lse))
    np.testing.assert_allclose(np.asarray(merged), want, rtol=0, atol=1e-6 * np.abs(out).max())
    np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-6, atol=1e-5)


def test_mosaic_run_shape_fits_and_divides():
    widest = mosaic.WARPGROUP * mosaic.MIN_THREAD_VALUES
    for splits in (1, 2, 3, 8, 33, 66, 128, 256):
        for rows in (16, 20, 48, 64, 128):
            for batch in (1, 8, 64):
                run_rows, run_cols = mosaic.run_shape(splits, rows, 512, batch)
                values = run_rows * run_cols
                # Runs tile the slab; a thread holds whole values of each row, at most ``max_tile``
                # values for the step's items unless MIN_THREAD_VALUES a thread and item are more.
                assert rows % run_rows == 0 and 512 % run_cols == 0 and run_cols % mosaic.WARPGROUP == 0
                assert values <= max(mosaic.max_tile(splits) // pl.next_power_of_2(splits), widest)
                # Loads as wide as MIN_THREAD_VALUES where the grid keeps MIN_CTAS CTAs.
                ctas = batch * rows * 512 // values
                assert values >= widest or ctas < 2 * mosaic.MIN_CTAS
                assert mosaic.run_shape(splits, rows, 512, 64)[1] >= min(widest, 512)


@merges
@pytest.mark.parametrize("out_shape, lse_shape, dtype, match", [
    ((2, 3, 16, 512), (2, 3, 8), jnp.float32, "lse"),
    ((2, 3, 512, 16), (2, 3, 16), jnp.float32, "lse"),
    ((2, 3, 16, 512), (2, 3, 16), jnp.float16, "float32 or bfloat16"),
    ((3, 16, 512), (3, 16), jnp.float32, "dimensions"),
])
def test_bad_partials_raise(out_shape, lse_shape, dtype, match, merge):
    with pytest.raises(ValueError, match=match):
        MERGES[merge][0](jnp.ones(out_shape, dtype), jnp.zeros(lse_shape, jnp.float32), interpret=True)


def test_mosaic_merge_refuses_a_rank_it_cannot_tile():
    with pytest.raises(ValueError, match="R a power of two >= 128"):
        mosaic.combine_splits_mgpu(jnp.ones((1, 2, 16, 64)), jnp.zeros((1, 2, 16)), interpret=True)


@pytest.mark.parametrize("shape", [(3, 5, 16), (1, 66, 64), (3, 3, 48)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("partial", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_mosaic_merges_lower_for_cuda(shape, partial):
    """Both Mosaic merges lower for CUDA on the CPU (layouts, vector widths) at the decode's R = 512."""
    batch, splits, rows = shape
    out, lse = jnp.zeros((batch, splits, rows, 512), partial), jnp.zeros((batch, splits, rows), jnp.float32)
    lower_for_cuda(lambda o, l: mosaic.combine_splits_mgpu(o, l, jnp.float32), out, lse)
    items = (out.reshape(batch * splits, rows, 512), lse.reshape(batch * splits, rows),
             jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32),
             jnp.zeros((batch, rows, 512), partial), jnp.zeros((batch, rows), jnp.float32))
    lower_for_cuda(functools.partial(mosaic.combine_items_mgpu, chunk=pl.next_power_of_2(splits)), *items)


@pytest.mark.gpu
@merges
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compiled_combine_matches_float64(shape, merge):
    out, lse = random_partials(sum(shape), *shape)
    want, want_lse = merge_float64(out, lse)
    merged, merged_lse = jax.jit(MERGES[merge][0], static_argnames=("dtype",))(
        jnp.asarray(out), jnp.asarray(lse), jnp.float32)
    # The GPU's exp/log differ from numpy's by a few ulps: the same bounds as interpret mode.
    np.testing.assert_allclose(np.asarray(merged), want, rtol=0, atol=1e-6 * np.abs(out).max())
    np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-6, atol=1e-5)


# --- combine_items: ragged work items per batch row, merged in place -------------------------

GAP_LSE, GAP_VALUE = 60.0, 1e4  # unused items between rows' ranges: would swamp any merge they leaked into


def random_items(seed: int, counts, rows: int, rank: int, partial, output, chunk: int):
    """Inputs of ``combine_items`` as a balanced decode call leaves them, in numpy.

    Batch row b has counts[b] items, the rows' ranges in shuffled order with an unused item
    (GAP_*) before each and one at the end. Partials: normal with outlier query rows (x100),
    stored in ``partial`` (the float64 check merges the stored values); lse: normal x 20 (weights
    down to e^-100 beside 1). In rows of >= 3 items the last saw no token (lse -inf, out 0);
    the first row of >= 2 items has query row 1 unseen by every item; the longest row has query
    row 3 unseen by its first chunk (the running max starts at -inf, then grows). merged and
    merged_lse: random sentinels (``output``; rows of <= 1 item must come back as they are).
    Returns (out, lse, starts, counts, merged, merged_lse) with out as [W, rows, R].
    """
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts, np.int32)
    starts, position = np.zeros(len(counts), np.int32), 0
    for b in rng.permutation(len(counts)):
        starts[b], position = position + 1, position + 1 + counts[b]
    width = position + 1
    out = rng.standard_normal((width, rows, rank)).astype(np.float32)
    out[rng.random((width, rows)) < 0.03] *= 100.0
    lse = (rng.standard_normal((width, rows)) * 20.0).astype(np.float32)
    used = np.zeros(width, bool)
    for start, count in zip(starts, counts):
        used[start:start + count] = True
        if count >= 3:
            lse[start + count - 1], out[start + count - 1] = -np.inf, 0.0
    lse[~used], out[~used] = GAP_LSE, GAP_VALUE
    several = np.flatnonzero(counts >= 2)
    lse[starts[several[0]]:starts[several[0]] + counts[several[0]], 1] = -np.inf
    longest = int(np.argmax(counts))
    lse[starts[longest]:starts[longest] + min(chunk, counts[longest]), 3] = -np.inf
    out = np.asarray(jnp.asarray(out, partial).astype(jnp.float32))  # as stored
    merged = np.asarray(jnp.asarray(rng.standard_normal((len(counts), rows, rank)) * 5.0, output))
    merged_lse = (rng.standard_normal((len(counts), rows)) * 10.0).astype(np.float32)
    return out, lse, starts, counts, merged, merged_lse


def merge_items_float64(out, lse, starts, counts):
    """Each batch row's merge of its items, float64: ([B, rows, R], [B, rows]); NaN in rows of <= 1 item."""
    merged = np.full((len(counts), *out.shape[1:]), np.nan)
    merged_lse = np.full((len(counts), out.shape[1]), np.nan)
    for b, (start, count) in enumerate(zip(starts, counts)):
        if count >= 2:
            row, row_lse = merge_float64(out[None, start:start + count], lse[None, start:start + count])
            merged[b], merged_lse[b] = row[0], row_lse[0]
    return merged, merged_lse


# counts per batch row (odd B) for a chunk of 4: none, one, two, fewer than, exactly and more than a
# chunk, and four chunks (13).
RAGGED = (0, 5, 1, 2, 4, 13, 3)
# (rows, partial dtype, output dtype, chunk, counts): 128, 64, 20 (not a power of two) and 16 rows;
# a uniform batch (every count == chunk: one chunk); chunk 1 (a chunk an item) and 2 (seven chunks).
ITEM_CASES = [
    (128, jnp.float32, jnp.float32, 4, RAGGED),
    (64, jnp.bfloat16, jnp.bfloat16, 4, RAGGED),
    (20, jnp.float32, jnp.float32, 4, RAGGED),
    (20, jnp.bfloat16, jnp.bfloat16, 2, (1, 13, 2, 0, 3)),
    (16, jnp.bfloat16, jnp.float16, 8, (8, 8, 8)),
    (64, jnp.bfloat16, jnp.float32, 1, (2, 0, 3, 1, 5)),
    (128, jnp.float32, jnp.bfloat16, 8, (8, 8, 8)),
]
ITEM_IDS = ["{}-{}-{}-c{}-{}".format(r, jnp.dtype(p).name, jnp.dtype(o).name, c, len(n))
            for r, p, o, c, n in ITEM_CASES]
# Half an ulp of the output (8 and 11 significant bits): its rounding moves a value by at most
# 2**-8 (bf16) or 2**-11 (f16) of itself; float32 outputs are not rounded again.
OUTPUT_RTOL = {jnp.dtype(jnp.float32): 0.0, jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float16): 2.0 ** -11}
# Small R: interpret mode's cost grows with it; the Mosaic merge takes R >= 128 (a thread's
# share of a row is whole values).
RANK = {"mosaic": 128}


@functools.lru_cache(maxsize=None)
def run_items_case(case_index: int, merge: str):
    """(inputs of ``random_items``, merged, merged_lse as numpy) of ITEM_CASES[case_index] under
    ``merge``, run once."""
    rows, partial, output, chunk, counts = ITEM_CASES[case_index]
    inputs = random_items(100 + case_index, counts, rows, RANK[merge], partial, output, chunk)
    out, lse, starts, counts, merged, merged_lse = inputs
    got, got_lse = MERGES[merge][1](jnp.asarray(out, partial), jnp.asarray(lse), jnp.asarray(starts),
                                    jnp.asarray(counts), jnp.asarray(merged), jnp.asarray(merged_lse), chunk=chunk,
                                    interpret=True)
    assert got.dtype == jnp.dtype(output) and got_lse.dtype == jnp.float32
    return inputs, np.asarray(got), np.asarray(got_lse)


def assert_items_match_float64(inputs, got, got_lse):
    """Rows of >= 2 items of (got, got_lse) against the float64 merge of the stored partials.

    Float32: weights <= 1 summed over <= 13 items, a rescale a chunk, an exp and a division: a few
    dozen roundings of 2**-24, under 1e-6 of the row's largest partial (|out| up to ~500 with the
    outliers); the lse (|lse| up to ~100, an ulp 2**-17 ~ 8e-6 there) to 1e-6 of itself, 1e-5 near
    0. Plus the output's rounding (OUTPUT_RTOL)."""
    out, lse, starts, counts, merged, _ = inputs
    want, want_lse = merge_items_float64(out, lse, starts, counts)
    for b in np.flatnonzero(counts >= 2):
        scale = np.abs(out[starts[b]:starts[b] + counts[b]]).max()
        np.testing.assert_allclose(got[b].astype(np.float64), want[b], atol=1e-6 * scale,
                                   rtol=OUTPUT_RTOL[merged.dtype], err_msg=f"batch row {b}")
        np.testing.assert_allclose(got_lse[b], want_lse[b], rtol=1e-6, atol=1e-5, err_msg=f"batch row {b}")


@merges
@pytest.mark.parametrize("case_index", range(len(ITEM_CASES)), ids=ITEM_IDS)
def test_combine_items_merges_rows_of_several_items(case_index, merge):
    assert_items_match_float64(*run_items_case(case_index, merge))


@merges
@pytest.mark.parametrize("case_index", range(len(ITEM_CASES)), ids=ITEM_IDS)
def test_combine_items_leaves_rows_of_one_item_bit_identical(case_index, merge):
    (_, _, _, counts, merged, merged_lse), got, got_lse = run_items_case(case_index, merge)
    kept = counts <= 1
    bits = {2: np.uint16, 4: np.uint32}[merged.dtype.itemsize]
    assert np.array_equal(got[kept].view(bits), merged[kept].view(bits))
    assert np.array_equal(got_lse[kept].view(np.uint32), merged_lse[kept].view(np.uint32))


@merges
@pytest.mark.parametrize("case_index", range(len(ITEM_CASES)), ids=ITEM_IDS)
def test_combine_items_zeroes_a_query_row_no_item_saw(case_index, merge):
    (_, _, _, counts, _, _), got, got_lse = run_items_case(case_index, merge)
    b = np.flatnonzero(counts >= 2)[0]  # query row 1 is -inf in every item of this row
    assert np.isneginf(got_lse[b, 1]) and not got[b, 1].astype(np.float32).any()


def test_combine_items_reference_agrees_with_float64():
    inputs = random_items(5, RAGGED, 16, 64, jnp.float32, jnp.float32, 4)
    got, got_lse = combine_items_reference(*map(jnp.asarray, inputs))
    assert_items_match_float64(inputs, np.asarray(got), np.asarray(got_lse))
    kept = inputs[3] <= 1
    assert np.array_equal(np.asarray(got)[kept], inputs[4][kept])


def item_args(width=6, batch=3, rows=16, rank=64, **changes):
    """Valid ``combine_items`` arguments (zeros), with ``changes`` replacing some."""
    args = dict(out=jnp.zeros((width, rows, rank), jnp.float32),
                lse=jnp.zeros((width, rows), jnp.float32), item_start=jnp.zeros((batch,), jnp.int32),
                item_count=jnp.zeros((batch,), jnp.int32), merged=jnp.zeros((batch, rows, rank), jnp.bfloat16),
                merged_lse=jnp.zeros((batch, rows), jnp.float32))
    return {**args, **changes}


@pytest.mark.parametrize("changes, chunk, match", [
    (dict(out=jnp.zeros((6, 16), jnp.float32)), 4, "out, lse: expected 3 and 2 dimensions"),
    (dict(lse=jnp.zeros((6, 8), jnp.float32)), 4, "lse: expected shape"),
    (dict(lse=jnp.zeros((5, 16), jnp.float32)), 4, "lse: expected shape"),
    (dict(out=jnp.zeros((6, 64, 16), jnp.float32)), 4, "lse: expected shape"),
    (dict(item_start=jnp.zeros((3, 1), jnp.int32)), 4, "item_start, item_count: expected two"),
    (dict(item_count=jnp.zeros((4,), jnp.int32)), 4, "item_start, item_count: expected two"),
    (dict(merged=jnp.zeros((3, 16, 32), jnp.bfloat16)), 4, "merged, merged_lse: expected shapes"),
    (dict(merged_lse=jnp.zeros((2, 16), jnp.float32)), 4, "merged, merged_lse: expected shapes"),
    (dict(out=jnp.zeros((6, 16, 64), jnp.float16)), 4, "float32 or bfloat16 partials"),
    (dict(lse=jnp.zeros((6, 16), jnp.bfloat16)), 4, "float32 lse"),
    (dict(item_count=jnp.zeros((3,), jnp.uint32)), 4, "item_start, item_count: expected int32"),
    (dict(merged=jnp.zeros((3, 16, 64), jnp.int32)), 4, "bfloat16, float32 or float16 output"),
    (dict(merged_lse=jnp.zeros((3, 16), jnp.bfloat16)), 4, "bfloat16, float32 or float16 output"),
    (dict(out=jnp.zeros((6, 16, 48), jnp.float32), merged=jnp.zeros((3, 16, 48), jnp.float32)), 4,
     "R a power of two"),
    ({}, 3, "chunk: expected a power of two"),
    ({}, 0, "chunk: expected a power of two"),
])
@merges
def test_bad_item_args_raise(changes, chunk, match, merge):
    with pytest.raises(ValueError, match=match):
        MERGES[merge][1](**item_args(**changes), chunk=chunk, interpret=True)


@pytest.mark.gpu
@merges
@pytest.mark.parametrize("case_index", range(len(ITEM_CASES)), ids=ITEM_IDS)
def test_compiled_combine_items_matches_float64(case_index, merge):
    rows, partial, output, chunk, counts = ITEM_CASES[case_index]
    inputs = random_items(100 + case_index, counts, rows, 512, partial, output, chunk)
    out, lse, starts, counts, merged, merged_lse = inputs
    got, got_lse = MERGES[merge][1](jnp.asarray(out, partial), jnp.asarray(lse), jnp.asarray(starts),
                                    jnp.asarray(counts), jnp.asarray(merged), jnp.asarray(merged_lse), chunk=chunk)
    got, got_lse = np.asarray(got), np.asarray(got_lse)
    # The GPU's exp/log differ from numpy's by a few ulps: the same bounds as interpret mode.
    assert_items_match_float64(inputs, got, got_lse)
    bits = {2: np.uint16, 4: np.uint32}[merged.dtype.itemsize]
    kept = counts <= 1
    assert np.array_equal(got[kept].view(bits), merged[kept].view(bits))
    assert np.array_equal(got_lse[kept].view(np.uint32), merged_lse[kept].view(np.uint32))
