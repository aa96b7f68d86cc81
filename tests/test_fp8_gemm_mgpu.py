"""The block-scaled FP8 GEMM (pallas_kernels/fp8_gemm_mgpu.py) and ``fp8_matmul``'s use of it,
against float64 on fresh random operands with outlier rows and channels; interpreted on CPU,
compiled under ``pytest -m gpu``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.fp8_weights import dequantize_weight, fp8_matmul, quantize_activations, quantize_blocks
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import BLOCK, GemmConfig, choose_splits, fp8_gemm_mgpu, kernel_takes


def _operands(seed: int, m: int, n: int, k: int):
    """x [m, k] f32 with one outlier row and an outlier channel block; W [n, k] block-FP8."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k))
    x[0] *= 50.0
    x[:, BLOCK:2 * BLOCK] *= 0.01
    w = rng.standard_normal((n, k)) * 0.05
    w[:, :3] *= 40.0
    return jnp.asarray(x, jnp.float32), quantize_blocks(jnp.asarray(w, jnp.float32))


def _quantized_f64(x8, x_scales, w):
    """The kernel's operands as float64: x8 * x_scale, w8 * w_scale."""
    m, k = x8.shape
    xs = np.repeat(np.asarray(x_scales, np.float64).T, BLOCK, axis=1)[:, :k]
    x = np.asarray(x8.astype(jnp.float32), np.float64) * xs
    return x, np.asarray(dequantize_weight(w, jnp.float32), np.float64)


def _check_kernel(m, n, k, config, interpret, rel_bound):
    x, w = _operands(m + n + k, m, n, k)
    x8, x_scales = quantize_activations(x)
    y = fp8_gemm_mgpu(x8, x_scales, w.values, w.scales, config=config, num_sms=4, interpret=interpret)
    xq, wq = _quantized_f64(x8, x_scales, w)
    want = xq @ wq.T
    # Per output, the error is a fraction of sum_k |x_k w_k| (the size of the terms summed).
    size = np.abs(xq) @ np.abs(wq).T
    err = np.abs(np.asarray(y, np.float64) - want)
    assert (err <= rel_bound * size + 1e-30).all(), float((err / (size + 1e-30)).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("m, n, k, config", [
    (16, 192, 512, GemmConfig()),  # 192 rows: the last 128-row scale block cropped
    (32, 64, 1024, GemmConfig(kb_per_step=1, depth=3, splits=4)),  # split K, partials summed
    (64, 128, 768, GemmConfig(kb_per_step=3, depth=2)),
])
def test_the_kernel_matches_float64_on_its_quantized_operands(m, n, k, config):
    # Interpreted: float32 sums of each block's 128 products, scaled and added over the blocks:
    # ~(128 + K / 128) roundings of 2^-24 relative to the terms' size; 2^-15 leaves room.
    _check_kernel(m, n, k, config, interpret=True, rel_bound=2.0**-15)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(16, 192, 512), (64, 1024, 7168), (48, 7168, 2048)])
def test_the_compiled_kernel_matches_float64_on_its_quantized_operands(m, n, k):
    # Hopper's FP8 wgmma adds each 32-channel slice with ~14 significant bits: four slices a block,
    # then float32: 2^-10 of the terms' size bounds it.
    _check_kernel(m, n, k, GemmConfig(), interpret=False, rel_bound=2.0**-10)


@pytest.mark.parametrize("lead", [(1,), (3, 5), (2, 16)])
def test_fp8_matmul_through_the_kernel_is_within_the_activation_rounding(lead):
    """Rows padded to the kernel's multiple of 16 (1, 15, 32 rows) and cut back; the error against
    float64 x times the dequantized W comes from quantizing x to e4m3 only."""
    k, n = 512, 192
    rows = int(np.prod(lead))
    x, w = _operands(rows, rows, n, k)
    x = x.reshape(*lead, k)
    y = fp8_matmul(x, w, backend="interpret")
    assert y.shape == (*lead, n) and y.dtype == x.dtype
    x64 = np.asarray(x, np.float64).reshape(rows, k)
    w64 = np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    want = x64 @ w64.T
    # e4m3 keeps 3 mantissa bits: a normal value rounds by at most 2^-4 of itself, a subnormal one
    # (below 2^-6 of the scale's 448 units) by at most 2^-10 of the block's scale amax / 448.
    scales = np.abs(x64.reshape(rows, k // BLOCK, BLOCK)).max(-1) / 448.0
    x_err = 2.0**-4 * np.abs(x64) + 2.0**-10 * np.repeat(scales, BLOCK, axis=1)
    bound = x_err @ np.abs(w64).T + 2.0**-15 * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(np.asarray(y, np.float64).reshape(rows, n) - want)
    assert (err <= bound).all(), float((err / bound).max())
    # Not XLA's unquantized product: the kernel ran (its activation rounding shows).
    assert not np.array_equal(np.asarray(y), np.asarray(fp8_matmul(x, w, backend="xla")))


def test_fp8_matmul_keeps_xla_where_the_kernel_does_not_take_the_shape():
    x, w = _operands(0, 80, 128, 512)  # 80 rows: past the kernel's 64
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x, w, backend="interpret")),
                                  np.asarray(fp8_matmul(x, w, backend="xla")))
    x, w = _operands(1, 4, 128, 384)  # K = 384: not whole 256-channel steps
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x, w, backend="interpret")),
                                  np.asarray(fp8_matmul(x, w, backend="xla")))
    assert not kernel_takes(16, 100, 512) and kernel_takes(64, 128, 512) and not kernel_takes(80, 128, 512)


def test_splits_fill_two_ctas_an_sm_and_divide_the_steps():
    assert choose_splits(n_tiles=288, steps=28, num_sms=132) == 1  # 288 CTAs already
    assert choose_splits(n_tiles=112, steps=72, num_sms=132) == 3  # 336 CTAs
    assert choose_splits(n_tiles=32, steps=28, num_sms=132) == 14  # 7 would give 224 < 264
    assert choose_splits(n_tiles=1, steps=6, num_sms=132) == 6  # all it can


def test_quantize_activations_puts_each_blocks_amax_on_448():
    x, _ = _operands(3, 16, 64, 512)
    x8, scales = quantize_activations(x)
    assert scales.shape == (4, 16)
    top = np.abs(np.asarray(x8.astype(jnp.float32))).reshape(16, 4, BLOCK).max(-1)
    np.testing.assert_array_equal(top, np.full((16, 4), 448.0))
    zero8, zero_scales = quantize_activations(jnp.zeros((16, 256), jnp.float32))
    assert not np.asarray(zero8.astype(jnp.float32)).any() and not np.asarray(zero_scales).any()


def test_a_shape_the_kernel_does_not_take_is_refused_naming_it():
    x8, xs = quantize_activations(jnp.ones((8, 256), jnp.float32))
    w = quantize_blocks(jnp.ones((64, 256), jnp.float32))
    with pytest.raises(ValueError, match="x8, w8: the FP8 GEMM takes M a multiple of 16"):
        fp8_gemm_mgpu(x8, xs, w.values, w.scales, interpret=True)


@pytest.mark.parametrize("m, n, k", [(64, 18432, 7168), (16, 2048, 7168)])
def test_the_kernel_lowers_for_cuda_within_shared_memory_at_the_largest_tokens(m, n, k):
    """Lowered on CPU for an H100 (layout inference, the pipeline's SMEM: 4 slots of 64 x 256
    weight bytes and m x 256 token bytes); 256 tokens overflowed shared memory on the GPU."""
    from snapmla_jax.backend import lower_for_cuda

    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k // BLOCK, m), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((-(-n // BLOCK), k // BLOCK), jnp.float32))
    text = lower_for_cuda(lambda *a: fp8_gemm_mgpu(*a), *args).as_text()
    assert "snapmla_fp8_gemm" in text
