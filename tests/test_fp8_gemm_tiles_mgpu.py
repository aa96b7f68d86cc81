"""The tiled block-scaled FP8 GEMM for many tokens (pallas_kernels/fp8_gemm_tiles_mgpu.py) against
float64 on fresh random operands with outlier tokens and channels; interpreted on CPU, compiled
under ``pytest -m gpu``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.fp8_weights import dequantize_weight, quantize_activations, quantize_blocks
from snapmla_jax.pallas_kernels.fp8_gemm_tiles_mgpu import (BLOCK, TilesConfig, choose_splits, fp8_gemm_tiles_mgpu,
                                                            fp8_grouped_gemm_tiles_mgpu, kernel_takes, pipeline_depth)


def _operands(seed: int, m: int, n: int, k: int):
    """x [m, k] with an outlier token and a quiet channel block; W [n, k] block-FP8 with outlier
    channels; both quantized as the kernel takes them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k))
    x[rng.integers(m)] *= 50.0
    x[:, BLOCK:2 * BLOCK] *= 0.01
    w = rng.standard_normal((n, k)) * 0.05
    w[:, rng.integers(k, size=3)] *= 40.0
    w = quantize_blocks(jnp.asarray(w, jnp.float32))
    x8, x_scales = quantize_activations(jnp.asarray(x, jnp.float32))
    return x8, x_scales, w


def _check(m, n, k, config, out_dtype, interpret, rel_bound):
    x8, x_scales, w = _operands(m * 7 + n + k, m, n, k)
    y = fp8_gemm_tiles_mgpu(x8, x_scales, w.values, w.scales, out_dtype=out_dtype, config=config,
                            interpret=interpret)
    assert y.shape == (m, n) and y.dtype == out_dtype
    xs = np.repeat(np.asarray(x_scales, np.float64).T, BLOCK, axis=1)
    xq = np.asarray(x8.astype(jnp.float32), np.float64) * xs
    wq = np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    want = xq @ wq.T
    # Per output, the error is a fraction of sum_k |x_k w_k| (the size of the terms summed); a
    # bfloat16 output adds its own rounding, at most 2^-8 of the value (8 significant bits).
    size = np.abs(xq) @ np.abs(wq).T
    got = np.asarray(y.astype(jnp.float32), np.float64)
    out_rounding = 2.0**-8 * np.abs(want) if out_dtype == jnp.bfloat16 else 0.0
    err = np.abs(got - want)
    assert (err <= rel_bound * size + out_rounding + 1e-30).all(), float((err / (size + 1e-30)).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("m, n, k, config, out_dtype", [
    (128, 256, 384, TilesConfig(), jnp.float32),  # two weight tiles, three blocks of K
    (384, 128, 256, TilesConfig(compute_wgs=3, depth=2), jnp.bfloat16),  # two token tiles of 192
    (128, 128, 128, TilesConfig(depth=4), jnp.float32),  # one step: the pipeline shorter than its depth
    (256, 128, 512, TilesConfig(kb_per_step=2, depth=2), jnp.bfloat16),  # two blocks a step
    (128, 256, 768, TilesConfig(splits=3), jnp.bfloat16),  # K split three ways, partials summed
])
def test_the_kernel_matches_float64_on_its_quantized_operands(m, n, k, config, out_dtype):
    # Interpreted: float32 sums of each block's 128 products, scaled and added over the blocks:
    # ~(128 + K / 128) roundings of 2^-24 relative to the terms' size; 2^-15 leaves room.
    _check(m, n, k, config, out_dtype, interpret=True, rel_bound=2.0**-15)


def test_k_is_split_where_the_tiles_leave_sms_idle():
    assert choose_splits(144, 56, 132) == 1  # 4096 x 18432: the tiles fill the SMs
    assert choose_splits(16, 56, 132) == 8  # 128 x 2048: 128 CTAs of 7 steps (14 would take two waves)
    assert choose_splits(56, 144, 132) == 2  # 128 x 7168 over K = 18432: 112 CTAs
    assert choose_splits(1, 5, 132) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, config, out_dtype", [
    (128, 256, 384, TilesConfig(), jnp.float32),
    (1024, 1024, 7168, TilesConfig(), jnp.bfloat16),
    (576, 2048, 1536, TilesConfig(compute_wgs=3), jnp.float32),
    (512, 768, 2048, TilesConfig(kb_per_step=2, depth=2), jnp.bfloat16),
    (128, 2048, 7168, TilesConfig(), jnp.bfloat16),  # 16 tiles: K split 8 ways
])
def test_the_compiled_kernel_matches_float64_on_its_quantized_operands(m, n, k, config, out_dtype):
    # Hopper's FP8 wgmma adds each 32-channel slice with ~14 significant bits: four slices a block,
    # then float32: 2^-10 of the terms' size bounds it.
    _check(m, n, k, config, out_dtype, interpret=False, rel_bound=2.0**-10)


def test_shapes_the_kernel_does_not_take_are_refused_naming_the_arguments():
    x8, x_scales, w = _operands(0, 128, 128, 256)
    assert kernel_takes(128, 128, 256) and not kernel_takes(64, 128, 256) and not kernel_takes(128, 192, 256)
    assert kernel_takes(192, 128, 256, TilesConfig(compute_wgs=3)) and not kernel_takes(128, 128, 200)
    assert not kernel_takes(128, 128, 384, TilesConfig(kb_per_step=2))
    with pytest.raises(ValueError, match="x8, w8: the tiled FP8 GEMM takes M a multiple of 192"):
        fp8_gemm_tiles_mgpu(x8, x_scales, w.values, w.scales, config=TilesConfig(compute_wgs=3), interpret=True)
    with pytest.raises(ValueError, match="x_scales, w_scales: expected"):
        fp8_gemm_tiles_mgpu(x8, x_scales[:1], w.values, w.scales, interpret=True)
    with pytest.raises(ValueError, match="out_dtype: expected float32 or bfloat16"):
        fp8_gemm_tiles_mgpu(x8, x_scales, w.values, w.scales, out_dtype=jnp.float16, interpret=True)


def test_the_pipeline_gives_way_to_shared_memory():
    # 128 tokens: 32.5 KB a step beside a 64 KB float32 output tile (and 1 KB of barriers): 4
    # fit; 192 tokens: 40.75 KB a step beside 96 KB: 3; two blocks a step of 128 tokens: 65 KB,
    # 2 beside a 32 KB bfloat16 tile.
    assert pipeline_depth(TilesConfig(depth=4), jnp.float32) == 4
    assert pipeline_depth(TilesConfig(depth=8), jnp.bfloat16) == 5
    assert pipeline_depth(TilesConfig(compute_wgs=3, depth=6), jnp.float32) == 3
    assert pipeline_depth(TilesConfig(compute_wgs=3, depth=6), jnp.bfloat16) == 4
    assert pipeline_depth(TilesConfig(kb_per_step=2, depth=4), jnp.bfloat16) == 2


@pytest.mark.parametrize("config", [TilesConfig(), TilesConfig(compute_wgs=3), TilesConfig(kb_per_step=2, depth=2)])
def test_the_kernel_lowers_for_cuda_at_a_prefill_shape(config):
    """Lowered on CPU for an H100 (layout inference, the warp-specialized pipeline's SMEM)."""
    from snapmla_jax.backend import lower_for_cuda

    m, n, k = 4 * config.tile_tokens, 18432, 7168
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k // BLOCK, m), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n // BLOCK, k // BLOCK), jnp.float32))
    text = lower_for_cuda(lambda *a: fp8_gemm_tiles_mgpu(*a, out_dtype=jnp.bfloat16, config=config), *args).as_text()
    assert "snapmla_fp8_gemm_tiles" in text


def _stack(seed: int, experts: int, n: int, k: int):
    """A block-FP8 stack [E, n, k] with outlier channels."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((experts, n, k)) * 0.05
    w[:, :, rng.integers(k, size=3)] *= 40.0
    return quantize_blocks(jnp.asarray(w, jnp.float32))


def _check_grouped(shared, with_matrices, experts, m, n, k, interpret, rel_bound):
    """Two stacks (a MoE's gate and up) in one launch; groups of their own tokens pick matrices by
    id (one repeated, one skipped), or share one token set over every matrix."""
    stacks = (_stack(1, experts, n, k), _stack(2, experts, n, k))
    matrices = jnp.asarray([2, -1, 0, 2], jnp.int32) if with_matrices else None
    groups = 4 if with_matrices else experts
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1 if shared else groups, m, k))
    x[:, 5] *= 30.0
    x8, x_scales = quantize_activations(jnp.asarray(x, jnp.float32))
    ys = fp8_grouped_gemm_tiles_mgpu(x8, x_scales, tuple(s.values for s in stacks), tuple(s.scales for s in stacks),
                                     matrices, interpret=interpret)
    assert len(ys) == 2 and all(y.shape == (groups, m, n) for y in ys)
    xs = np.repeat(np.asarray(x_scales, np.float64).swapaxes(-1, -2), BLOCK, axis=-1)
    xq = np.asarray(x8.astype(jnp.float32), np.float64) * xs
    for y, stack in zip(ys, stacks):
        wq = np.asarray(dequantize_weight(stack, jnp.float32), np.float64)
        for g in range(groups):
            e = int(matrices[g]) if with_matrices else g
            if e < 0:
                continue  # skipped: its rows are left unwritten
            xg = xq[0 if shared else g]
            want = xg @ wq[e].T
            assert (np.abs(np.asarray(y[g], np.float64) - want) <= rel_bound * (np.abs(xg) @ np.abs(wq[e]).T)).all()


@pytest.mark.parametrize("shared, with_matrices", [(True, False), (False, True)])
def test_grouped_products_match_float64_each_with_its_matrix(shared, with_matrices):
    # The single product's bound: 2^-15 of the terms' size in the interpreter.
    _check_grouped(shared, with_matrices, 3, 128, 128, 256, interpret=True, rel_bound=2.0**-15)


@pytest.mark.gpu
@pytest.mark.parametrize("shared, with_matrices", [(True, False), (False, True)])
def test_compiled_grouped_products_match_float64_each_with_its_matrix(shared, with_matrices):
    # The compiled single product's bound: 2^-10 (the FP8 wgmma's ~14-bit sums).
    _check_grouped(shared, with_matrices, 3, 256, 1408, 2048, interpret=False, rel_bound=2.0**-10)


def test_grouped_launch_lowers_for_cuda_with_matrices_by_id():
    from snapmla_jax.backend import lower_for_cuda

    experts, groups, m, n, k = 64, 80, 128, 1408, 2048
    args = (jax.ShapeDtypeStruct((groups, m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((groups, k // BLOCK, m), jnp.float32),
            (jax.ShapeDtypeStruct((experts, n, k), jnp.float8_e4m3fn),) * 2,
            (jax.ShapeDtypeStruct((experts, n // BLOCK, k // BLOCK), jnp.float32),) * 2,
            jax.ShapeDtypeStruct((groups,), jnp.int32))
    text = lower_for_cuda(lambda *a: fp8_grouped_gemm_tiles_mgpu(*a), *args).as_text()
    assert "snapmla_fp8_gemm_tiles" in text
