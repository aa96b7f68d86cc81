"""The split-KV merge kernel (pallas_kernels/combine_splits.py) against a float64 merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.combine_splits import (combine_splits, combine_splits_reference, max_tile, partial_dtype,
                                           tile_size)


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
# 16-row blocks: the transposed tile pads them to 64).
SHAPES = [(3, 5, 16), (1, 66, 64), (2, 128, 16), (1, 2, 32), (5, 3, 64), (3, 3, 48)]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_combine_matches_float64(shape, transposed):
    out, lse = random_partials(sum(shape) + transposed, *shape)
    want, want_lse = merge_float64(out, lse)
    stored = out.transpose(0, 1, 3, 2) if transposed else out
    merged, merged_lse = combine_splits(jnp.asarray(stored), jnp.asarray(lse), jnp.float32,
                                        transposed=transposed, interpret=True)
    # float32 sums of <= 128 terms with weights <= 1 and a float32 exp/log: a few ulps of
    # the largest partial (|out| <= ~1500 here), 1e-6 relative to it; the lse to 1e-6 of its size.
    scale = np.abs(out).max()
    np.testing.assert_allclose(np.asarray(merged), want, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-6, atol=1e-5)
    assert np.isneginf(np.asarray(merged_lse)[-1, 1]) and not np.asarray(merged)[-1, 1].any()


def test_combine_casts_to_the_callers_dtype():
    out, lse = random_partials(7, 2, 6, 16)
    want, _ = merge_float64(out, lse)
    merged, _ = combine_splits(jnp.asarray(out), jnp.asarray(lse), jnp.bfloat16, interpret=True)
    assert merged.dtype == jnp.bfloat16
    # bf16 keeps 8 significant bits: within 2**-8 of each value (plus the float32 error).
    np.testing.assert_allclose(np.asarray(merged, np.float32), want, rtol=2.0 ** -8, atol=1e-6 * np.abs(out).max())


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 16), (1, 66, 64), (2, 2, 64)], ids=lambda s: "x".join(map(str, s)))
def test_combine_takes_bf16_partials(shape, transposed):
    """bf16 partials (``partial_dtype`` of a bf16 output) are merged in float32: as float64 on
    the rounded partials to float32's error, and within one bf16 rounding (half an ulp: at most
    2**-8 of the value) of the largest partial of the float64 merge of the unrounded ones."""
    out, lse = random_partials(sum(shape) + 11, *shape)
    rounded = np.asarray(jnp.asarray(out, jnp.bfloat16).astype(jnp.float32))
    stored = rounded.transpose(0, 1, 3, 2) if transposed else rounded
    merged, merged_lse = combine_splits(jnp.asarray(stored, jnp.bfloat16), jnp.asarray(lse), jnp.float32,
                                        transposed=transposed, interpret=True)
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


def test_tile_size_fits_and_divides():
    for splits in (1, 2, 3, 8, 33, 66, 128, 256):
        for rows in (16, 48, 64):
            size = tile_size(splits, rows * 512)
            # Every split's run in one load of at most ``max_tile`` values; runs tile the slab.
            assert size * pl.next_power_of_2(splits) <= max_tile(splits) and (rows * 512) % size == 0


@pytest.mark.parametrize("out_shape, lse_shape, dtype, transposed, match", [
    ((2, 3, 16, 512), (2, 3, 8), jnp.float32, False, "lse"),
    ((2, 3, 16, 512), (2, 3, 16), jnp.float32, True, "lse"),
    ((2, 3, 16, 512), (2, 3, 16), jnp.float16, False, "float32 or bfloat16"),
    ((3, 16, 512), (3, 16), jnp.float32, False, "dimensions"),
])
def test_bad_partials_raise(out_shape, lse_shape, dtype, transposed, match):
    with pytest.raises(ValueError, match=match):
        combine_splits(jnp.ones(out_shape, dtype), jnp.zeros(lse_shape, jnp.float32), transposed=transposed,
                       interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compiled_combine_matches_float64(shape, transposed):
    out, lse = random_partials(sum(shape), *shape)
    want, want_lse = merge_float64(out, lse)
    stored = out.transpose(0, 1, 3, 2) if transposed else out
    merged, merged_lse = jax.jit(combine_splits, static_argnames=("dtype", "transposed"))(
        jnp.asarray(stored), jnp.asarray(lse), jnp.float32, transposed=transposed)
    # The GPU's exp/log differ from numpy's by a few ulps: the same bounds as interpret mode.
    np.testing.assert_allclose(np.asarray(merged), want, rtol=0, atol=1e-6 * np.abs(out).max())
    np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-6, atol=1e-5)
