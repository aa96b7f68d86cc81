"""Per-token FP8 quantization math (defined beside the kernels in pallas_kernels.fp8)."""

from snapmla_jax.pallas_kernels.fp8 import (AMAX_FLOOR, FP8_DTYPE, FP8_E4M3_EPS, FP8_E4M3_MAX, FP8_E4M3_MAX_RECIPROCAL,
                                            dequantize_per_token, fp8_round_trip, fp8_round_trip_np, per_token_scale,
                                            quantize_per_token, quantize_with_scale, round_to_e4m3)

__all__ = ["AMAX_FLOOR", "FP8_DTYPE", "FP8_E4M3_EPS", "FP8_E4M3_MAX", "FP8_E4M3_MAX_RECIPROCAL", "dequantize_per_token",
           "fp8_round_trip", "fp8_round_trip_np", "per_token_scale", "quantize_per_token", "quantize_with_scale",
           "round_to_e4m3"]
