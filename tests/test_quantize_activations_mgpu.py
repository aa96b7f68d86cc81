"""The activation quantizer of one Mosaic GPU launch (pallas_kernels/quantize_activations_mgpu.py)
against float64 and against XLA's twin (``fp8_weights.quantize_activations``), on fresh random
rows with outlier rows and channels, ragged row counts and zero blocks; interpreted on CPU,
compiled under ``pytest -m gpu``."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from snapmla_jax.fp8_weights import quantize_activations
from snapmla_jax.pallas_kernels.quantize_activations_mgpu import padded_rows, quantize_activations_mgpu

BLOCK = 128
# A quotient x / scale is an f32 division (within one f32 rounding, 2^-24 relative, of the exact
# one; a GPU division within two): where the exact quotient lies closer than this to the midpoint
# between two e4m3 values, either neighbour is a correct rounding of x / scale.
TIE_BAND = 2.0**-21


def _rows(seed: int, shape, dtype):
    """Random rows [..., M, K] in ``dtype``: normal values, the first row x 300, channel block 1 x
    0.003 (its scale far below the others'), and row 1's first block all zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0
    x[..., 0, :] *= 300.0
    if shape[-1] > BLOCK:
        x[..., BLOCK:2 * BLOCK] *= 0.003
    if shape[-2] > 1:
        x[..., 1, :BLOCK] = 0.0
    return jnp.asarray(x, dtype)


def _check(x, x8, scales, rows, scale_rows, same_division: bool):
    """x8 [..., rows, K] and scales [..., K / 128, scale_rows] against float64 and XLA's twin;
    ``same_division``: the kernel's f32 division is XLA's (interpreted), so the values are XLA's
    bit for bit, ties included."""
    m, k = x.shape[-2:]
    assert x8.shape == (*x.shape[:-2], rows, k) and x8.dtype == jnp.float8_e4m3fn
    assert scales.shape == (*x.shape[:-2], k // BLOCK, scale_rows) and scales.dtype == jnp.float32
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    got8 = np.asarray(x8.astype(jnp.float32), np.float64)
    got_scales = np.swapaxes(np.asarray(scales, np.float64), -1, -2)  # [..., scale_rows, K / 128]
    # Rows past M: zeros, their scales 0.
    assert not got8[..., m:, :].any() and not got_scales[..., m:, :].any()
    got8, got_scales = got8[..., :m, :], got_scales[..., :m, :]
    # A block's scale is its amax times float32(1 / 448): one f32 rounding of the product.
    amax = np.abs(x64.reshape(*x64.shape[:-1], k // BLOCK, BLOCK)).max(-1)
    want_scales = (amax.astype(np.float32) * np.float32(1 / 448)).astype(np.float64)
    np.testing.assert_array_equal(got_scales, want_scales)
    # Values: the e4m3 rounding of x / scale (zero blocks: 0), the quotient taken in float64.
    per_value = np.repeat(want_scales, BLOCK, axis=-1)
    quotient = np.divide(x64, per_value, out=np.zeros_like(x64), where=per_value > 0)
    nearest = quotient.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    # The e4m3 grid around the quotient: spacing 2^(e - 3) in [2^e, 2^(e + 1)), 2^-9 below 2^-6.
    exponent = np.floor(np.log2(np.maximum(np.abs(quotient), 2.0**-6)))
    spacing = 2.0 ** (exponent - 3)
    below = np.floor(quotient / spacing) * spacing
    tie = np.abs(quotient - (below + spacing / 2)) <= TIE_BAND * np.abs(quotient)
    ok = (got8 == nearest) | (tie & ((got8 == below) | (got8 == below + spacing)))
    assert ok.all(), (np.argwhere(~ok)[:4], got8[~ok][:4], quotient[~ok][:4])
    assert np.abs(got8).max() == 448.0  # the outlier row's amax lands on e4m3's top
    # XLA's twin on x padded to the same rows: the same scales, the same values (compiled, the
    # division's last bit may differ from XLA's: at ties either rounding).
    pad = [(0, 0)] * (x.ndim - 2) + [(0, rows - m), (0, 0)]
    xla8, xla_scales = quantize_activations(jnp.pad(x, pad))
    np.testing.assert_array_equal(np.asarray(scales)[..., :rows], np.asarray(xla_scales))
    xla8 = np.asarray(xla8.astype(jnp.float32), np.float64)[..., :m, :]
    assert ((got8 == xla8) | (tie & (not same_division))).all()


CASES = [  # (shape, rows, scale_rows); None: the defaults
    ((1, 256), None, None),
    ((5, 256), None, None),
    ((11, 384), 16, 32),  # K = 3 blocks: CTAs of 128 channels; scales wider than the rows
    ((16, 2048), 16, None),
    ((3, 40, 512), 48, 64),  # groups, a tile of rows wholly past M
    ((70, 256), 80, None),  # past 64 rows: the last tile partly past M
    ((130, 256), 256, None),  # many tiles wholly past M
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape, rows, scale_rows", CASES)
def test_quantizer_matches_float64_and_xla_interpreted(shape, rows, scale_rows, dtype):
    x = _rows(sum(shape) + len(CASES), shape, dtype)
    x8, scales = quantize_activations_mgpu(x, rows, scale_rows, interpret=True)
    rows = padded_rows(shape[-2]) if rows is None else rows
    _check(x, x8, scales, rows, rows if scale_rows is None else scale_rows, same_division=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, rows, scale_rows", CASES + [
    ((4096, 2048), 4096, None), ((64, 16, 2048), None, None), ((1, 100, 1408), 128, None)])
def test_quantizer_matches_float64_and_xla_compiled(shape, rows, scale_rows):
    x = _rows(sum(shape), shape, jnp.bfloat16)
    x8, scales = quantize_activations_mgpu(x, rows, scale_rows)
    rows = padded_rows(shape[-2]) if rows is None else rows
    _check(x, x8, scales, rows, rows if scale_rows is None else scale_rows, same_division=False)


def test_default_rows_are_whole_tiles():
    assert [padded_rows(m) for m in (1, 16, 17, 64, 65, 129)] == [16, 16, 32, 64, 80, 144]


@pytest.mark.parametrize("x, rows, scale_rows, match", [
    (jnp.zeros((256,), jnp.bfloat16), None, None, "x: expected"),
    (jnp.zeros((2, 2, 16, 256), jnp.bfloat16), None, None, "x: expected"),
    (jnp.zeros((16, 200), jnp.bfloat16), None, None, "x: expected"),
    (jnp.zeros((0, 256), jnp.bfloat16), None, None, "x: expected"),
    (jnp.zeros((16, 256), jnp.int32), None, None, "x: expected"),
    (jnp.zeros((20, 256), jnp.bfloat16), 16, None, "rows, scale_rows: expected"),
    (jnp.zeros((16, 256), jnp.bfloat16), 24, None, "rows, scale_rows: expected"),
    (jnp.zeros((16, 256), jnp.bfloat16), 32, 16, "rows, scale_rows: expected"),
])
def test_bad_shapes_get_one_line(x, rows, scale_rows, match):
    with pytest.raises(ValueError, match=match) as err:
        quantize_activations_mgpu(x, rows, scale_rows, interpret=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("shape, dtype, rows, scale_rows", [
    ((11, 384), jnp.bfloat16, 16, 32), ((4096, 2048), jnp.bfloat16, None, None), ((3, 40, 512), jnp.float32, 48, 64),
    ((100, 1408), jnp.float16, 128, None)])
def test_the_kernel_lowers_for_cuda(shape, dtype, rows, scale_rows):
    """Lowered on CPU for an H100: layout inference, the tiled TMAs (at most 256 elements a
    dimension), rows not a multiple of 8 padded to whole 8s."""
    from snapmla_jax.backend import lower_for_cuda

    fn = functools.partial(quantize_activations_mgpu, rows=rows, scale_rows=scale_rows)
    assert "snapmla_quantize_activations" in lower_for_cuda(fn, jax.ShapeDtypeStruct(shape, dtype)).as_text()
