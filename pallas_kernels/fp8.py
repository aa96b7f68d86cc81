"""Per-token FP8 (e4m3) quantization of the MLA latent: the math shared by the
cache write kernel, its reference, the decode kernels and the ablation report.

It lives in pallas_kernels (the bottom layer: kernels import nothing from
snapmla_jax) and is re-exported as ``snapmla_jax.quantization``.

A token's 512-dim latent gets ONE float32 scale: ``s_t = max(amax_t, AMAX_FLOOR) * float32(1 / 448)``
and is stored as ``e4m3(clip(x / s_t, -448, 448))``; it is read back as
``float32(q) * s_t``. The RoPE part is not quantized (see ``LatentCache``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite e4m3fn value; scales map a token's amax onto it
# A scale is amax times this float32 constant, not amax / 448: XLA rewrites a division by a
# constant into that product under jit and, in some jax versions, not op by op, so only the
# product is computed alike by the jnp references, the interpreted kernels and the compiled ones.
FP8_E4M3_MAX_RECIPROCAL = np.float32(1.0 / FP8_E4M3_MAX)
# Floor on a token's amax before it becomes a scale. It keeps the scale a normal
# float32 (GPUs flush denormals, and x / 0 would be NaN) for all-zero tokens;
# a token whose amax is below it loses nothing that bf16 inputs could carry.
AMAX_FLOOR = 1e-30
# Relative spacing of e4m3 values: 3 mantissa bits, so one ulp is 2**-3 of the
# leading power of two and round-to-nearest errs by at most half of that.
FP8_E4M3_EPS = 2.0**-3
E4M3_MIN_EXPONENT = -6  # of e4m3's smallest normal value, 2**-6


def per_token_scale(x: jnp.ndarray) -> jnp.ndarray:
    """Scale per row of ``x`` [..., D] (any float dtype) -> float32 [...]."""
    return scale_of_amax(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))


def scale_of_amax(amax: jnp.ndarray) -> jnp.ndarray:
    """The scale of rows whose largest magnitude is ``amax`` (float32 [...]): ``per_token_scale``'s."""
    return jnp.maximum(amax, AMAX_FLOOR) * FP8_E4M3_MAX_RECIPROCAL


def saturate_to_e4m3(y: jnp.ndarray) -> jnp.ndarray:
    """float32 ``y`` (already divided by its scale) -> float8_e4m3fn, saturating at +-448.

    Saturation matters: e4m3fn has no inf, and an unclipped value past 448
    would become NaN.
    """
    return jnp.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8_DTYPE)


def round_to_e4m3(y: jnp.ndarray) -> jnp.ndarray:
    """float ``y`` (already divided by its scale, |y| <= 448) -> float32: the e4m3fn value nearest
    ``y``, ties to even, computed without a conversion to float8.

    A jnp round trip ``y.astype(float8_e4m3fn).astype(float32)`` emulates nothing on a GPU: XLA's
    GPU compiler folds chains of float conversions into one (SimplifyFPConversions, on under the
    default ``xla_allow_excess_precision``), so the float8 step vanishes. This is arithmetic: the
    spacing of e4m3 values at y is 2**(e - 3) for y's leading power of two 2**e, floored at
    e4m3's smallest normal exponent (-6, below which its subnormals are spaced 2**-9).
    """
    y = jnp.asarray(y, jnp.float32)
    _, exponent = jnp.frexp(y)  # |y| = m * 2**exponent, m in [0.5, 1)
    spacing = jnp.ldexp(jnp.float32(1.0), jnp.maximum(exponent - 1, E4M3_MIN_EXPONENT) - 3)
    return jnp.round(y / spacing) * spacing


def e4m3_values_with_scale(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """``quantize_with_scale``'s e4m3 values held in float32 [..., D], on every backend
    (``round_to_e4m3``)."""
    return round_to_e4m3(jnp.clip(x.astype(jnp.float32) / scale[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX))


def residual_per_token(x: jnp.ndarray, values: jnp.ndarray, scale: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """What ``values * scale`` (x's e4m3 values [..., D] under its row scales [...]) leaves of
    ``x`` [..., D], quantized per row the same way: (its e4m3 values held in float32 [..., D],
    their scales [...]). The second FP8 term of a two-term quantization."""
    rest = x.astype(jnp.float32) - values * scale[..., None]
    rest_scale = per_token_scale(rest)
    return e4m3_values_with_scale(rest, rest_scale), rest_scale


def fp8_round_trip(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """``x`` [..., D] quantized with ``scale`` [...] and read back, float32 [..., D]: the values
    ``dequantize_per_token(quantize_with_scale(x, scale), scale)`` holds, on every backend."""
    return e4m3_values_with_scale(x, scale) * scale[..., None]


def quantize_with_scale(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """``x`` [..., D] / ``scale`` [...] -> float8_e4m3fn [..., D] (``saturate_to_e4m3``)."""
    return saturate_to_e4m3(x.astype(jnp.float32) / scale[..., None])


def quantize_per_token(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``x`` [..., D] -> (float8_e4m3fn [..., D], float32 scale [...])."""
    scale = per_token_scale(x)
    return quantize_with_scale(x, scale), scale


def dequantize_per_token(q: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """float8 [..., D] and float32 scale [...] -> float32 [..., D]."""
    return q.astype(jnp.float32) * scale[..., None]


def fp8_round_trip_np(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 numpy model of quantize + dequantize, for tests and reports.

    ``x`` [..., D], ``scale`` [...] (float64 or float32) -> float64 [..., D].
    """
    y = np.clip(np.asarray(x, np.float64) / np.asarray(scale, np.float64)[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.asarray(scale, np.float64)[..., None]
