"""``round_to_e4m3`` / ``fp8_round_trip``: e4m3 rounding in float32 arithmetic, with no float8
conversion that XLA's GPU compiler could fold away (SimplifyFPConversions)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from snapmla_jax.quantization import (FP8_DTYPE, FP8_E4M3_MAX, dequantize_per_token, fp8_round_trip,
                                      per_token_scale, quantize_with_scale, round_to_e4m3)


def _e4m3_values() -> np.ndarray:
    """Every finite e4m3fn value, ascending, as float64."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def test_every_value_and_every_midpoint_rounds_as_the_float8_conversion():
    """Each e4m3 value maps to itself; each midpoint between neighbours (a tie) and points just
    either side of it go where numpy's conversion to float8_e4m3fn (ties to even) sends them."""
    values = _e4m3_values()
    mids = (values[:-1] + values[1:]) / 2
    near = np.concatenate([values, mids, np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                           np.nextafter(mids.astype(np.float32), np.float32(-np.inf))]).astype(np.float32)
    expected = near.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(jax.jit(round_to_e4m3)(near))
    np.testing.assert_array_equal(got, expected)
    assert np.array_equal(np.signbit(got[near == 0]), np.signbit(expected[near == 0]))


def test_random_values_across_the_range_and_below_the_subnormals():
    rng = np.random.default_rng(0)
    magnitude = np.exp2(rng.uniform(-14, np.log2(FP8_E4M3_MAX), 200_000))  # 2**-14: far below 2**-9
    y = (magnitude * rng.choice([-1, 1], magnitude.shape)).astype(np.float32)
    y = np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    np.testing.assert_array_equal(np.asarray(jax.jit(round_to_e4m3)(y)),
                                  y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_round_trip_holds_what_the_quantized_cache_holds():
    """Per-token scales, an outlier channel, a zero row: the values the FP8 cache reads back."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 512)).astype(np.float32)
    x[2, 17] = 300.0
    x[4] = 0.0
    x = jnp.asarray(x, jnp.bfloat16)
    scale = per_token_scale(x)
    np.testing.assert_array_equal(np.asarray(fp8_round_trip(x, scale)),
                                  np.asarray(dequantize_per_token(quantize_with_scale(x, scale), scale)))


@pytest.mark.parametrize("fn", [round_to_e4m3, lambda x: fp8_round_trip(x, per_token_scale(x))],
                         ids=["round_to_e4m3", "fp8_round_trip"])
def test_no_float8_conversion_for_a_compiler_to_fold(fn):
    """The rule that keeps the rounding on a GPU: no float8 type anywhere in the program."""
    text = jax.jit(fn).lower(jnp.ones((4, 64), jnp.float32)).as_text()
    assert "f8E4M3" not in text and jnp.dtype(FP8_DTYPE).name not in text
