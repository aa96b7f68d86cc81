"""Inline-PTX byte packing of the Mosaic GPU decode kernel (pallas_kernels/mgpu_bytes.py).

CPU: kernels using ``interleave_bytes`` and ``store_byte_lane`` lower for CUDA.
GPU: ``interleave_bytes``'s words match the bytes numpy computes (``lo | hi <<
8``), bit for bit, on random bytes (every value an e4m3 byte can hold, NaN
patterns included: bits, not values); ``store_byte_lane`` puts two tiles'
bytes in alternate bytes of one tile, read back through a wgmma-layout TMA;
``interleave_columns``' register operand multiplies as numpy's interleaved tile does,
exactly (small values whose products and sums fp32 holds exactly).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_bytes import BYTE_TILE_TRANSFORMS, interleave_bytes, interleave_columns, store_byte_lane

SHAPE = (64, 128)


def _kernel(lo_ref, hi_ref, words_ref, bytes_s, words_s, bar):
    for src, dst in ((lo_ref, bytes_s.at[0]), (hi_ref, bytes_s.at[1])):
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA)
    words_s[...] = interleave_bytes(load(bytes_s.at[0]), load(bytes_s.at[1]))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(words_s, words_ref)
    plgpu.wait_smem_to_gmem(0)


def _run(lo, hi):
    return plgpu.kernel(_kernel, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.uint16), kernel_name="test_mgpu_bytes",
                        scratch_types=[plgpu.SMEM((2, *SHAPE), jnp.float8_e4m3fn), plgpu.SMEM(SHAPE, jnp.uint16),
                                       plgpu.Barrier(num_arrivals=2)])(lo, hi)


def _inputs(seed, shape=SHAPE):
    """Two random byte tiles, as e4m3 (the kernel's V or P' bytes: any bit pattern, NaN included)."""
    b = np.random.default_rng(seed).integers(0, 256, (2, *shape), dtype=np.uint8)
    return b, jnp.asarray(b[0]).view(jnp.float8_e4m3fn), jnp.asarray(b[1]).view(jnp.float8_e4m3fn)


def test_byte_helper_lowers_for_cuda():
    _, lo, hi = _inputs(0)
    jax.jit(_run).trace(lo, hi).lower(lowering_platforms=("cuda",))


def test_byte_helper_rejects_mismatched_pairs():
    with pytest.raises(ValueError, match="interleave_bytes: expected two arrays"):
        interleave_bytes(jnp.zeros((64, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32))
    with pytest.raises(ValueError, match="interleave_bytes: expected two arrays"):
        interleave_bytes(jnp.zeros((64, 64), jnp.uint8), jnp.zeros((64, 128), jnp.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 2])
def test_byte_helper_matches_numpy(seed):
    b, lo, hi = _inputs(seed)
    want = b[0].astype(np.uint16) | (b[1].astype(np.uint16) << 8)
    np.testing.assert_array_equal(np.asarray(_run(lo, hi)), want)


def _lanes_kernel(even_ref, odd_ref, out_ref, bytes_s, out_s, bar, done, *, by_warpgroup):
    """``by_warpgroup``: warpgroup w stores tile w with lane None; else warpgroup 0 stores both."""
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
        for src, dst in ((even_ref, bytes_s.at[0]), (odd_ref, bytes_s.at[1])):
            plgpu.copy_gmem_to_smem(src, dst, bar)

    plgpu.barrier_wait(bar)
    if by_warpgroup:
        store_byte_lane(plgpu.load(bytes_s.at[wg], layout=plgpu.Layout.WGMMA), out_s, None)
    else:
        @pl.when(wg == 0)
        def _():
            for lane in range(2):
                store_byte_lane(plgpu.load(bytes_s.at[lane], layout=plgpu.Layout.WGMMA), out_s, lane)
    plgpu.commit_smem()
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)

    @pl.when(wg == 0)
    def _():
        plgpu.copy_smem_to_gmem(out_s, out_ref)
    plgpu.wait_smem_to_gmem(0)


def _run_lanes(even, odd, by_warpgroup=False):
    """Two e4m3 [64, 64] tiles -> e4m3 [64, 128], even's bytes at even columns (two warpgroups)."""
    return plgpu.kernel(
        functools.partial(_lanes_kernel, by_warpgroup=by_warpgroup),
        out_type=jax.ShapeDtypeStruct((64, 128), jnp.float8_e4m3fn), kernel_name="test_byte_lanes",
        num_threads=2, thread_name="wg",
        scratch_types=[plgpu.SMEM((2, 64, 64), jnp.float8_e4m3fn),
                       plgpu.SMEM((64, 128), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                       plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2)])(even, odd)


@pytest.mark.parametrize("by_warpgroup", [False, True])
def test_byte_lane_store_lowers_for_cuda(by_warpgroup):
    _, even, odd = _inputs(0, (64, 64))
    jax.jit(functools.partial(_run_lanes, by_warpgroup=by_warpgroup)).trace(even, odd).lower(
        lowering_platforms=("cuda",))


def test_byte_lane_store_rejects_bad_arguments():
    tile = jnp.zeros((64, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="store_byte_lane: values: expected e4m3"):
        store_byte_lane(tile.astype(jnp.float32), None, 0)
    with pytest.raises(ValueError, match="store_byte_lane: dst_ref: expected e4m3"):
        store_byte_lane(tile, jnp.zeros((64, 64), jnp.float8_e4m3fn), 0)
    with pytest.raises(ValueError, match="store_byte_lane: lane: expected 0, 1 or None"):
        store_byte_lane(tile, jnp.zeros((64, 128), jnp.float8_e4m3fn), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed, by_warpgroup", [(1, False), (2, True)])
def test_byte_lane_store_matches_numpy(seed, by_warpgroup):
    b, even, odd = _inputs(seed, (64, 64))
    want = np.stack([b[0], b[1]], axis=-1).reshape(64, 128)
    got = np.asarray(_run_lanes(even, odd, by_warpgroup)).view(np.uint8)
    np.testing.assert_array_equal(got, want)



def _operand_kernel(lo_ref, hi_ref, b_ref, out_ref, halves_s, b_s, out_s, bar):
    """out = interleave_columns(lo, hi) @ b^T by an FP8 wgmma, the A operand from registers."""
    for src, dst in ((lo_ref, halves_s.at[0]), (hi_ref, halves_s.at[1]), (b_ref, b_s)):
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA)
    a = interleave_columns(load(halves_s.at[0]), load(halves_s.at[1]))

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b_s.transpose((1, 0)))  # b_s [N, K] bytes: the K-major B an FP8 wgmma needs
        return acc_ref[...]
    out_s[...] = pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_ref)
    plgpu.wait_smem_to_gmem(0)


def _run_operand(lo, hi, b):
    """lo, hi e4m3 [64, 64], b e4m3 [64, 128] -> f32 [64, 64]."""
    return plgpu.kernel(_operand_kernel, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                        kernel_name="test_interleave_columns",
                        scratch_types=[plgpu.SMEM((2, 64, 64), jnp.float8_e4m3fn),
                                       plgpu.SMEM((64, 128), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                                       plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_arrivals=3)])(lo, hi, b)


def _operand_inputs(seed):
    """lo, hi from {0, +-0.5, +-1, +-2} and b from {0, +-1, +-2} (e4m3 holds them exactly): each
    output is a sum of 128 products, a multiple of 0.5 below 512, exact even in the FP8 wgmma's
    ~14-bit accumulation, so any misplaced column shows."""
    rng = np.random.default_rng(seed)
    lo, hi = rng.choice([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0], (2, 64, 64))
    b = rng.choice([0.0, 1.0, -1.0, 2.0, -2.0], (64, 128))
    return [jnp.asarray(x, jnp.float8_e4m3fn) for x in (lo, hi, b)]


def test_interleave_columns_lowers_for_cuda():
    jax.jit(_run_operand).trace(*_operand_inputs(0)).lower(lowering_platforms=("cuda",))


def test_interleave_columns_rejects_bad_arguments():
    with pytest.raises(ValueError, match="interleave_columns: expected two arrays"):
        interleave_columns(jnp.zeros((64, 64), jnp.uint8), jnp.zeros((64, 64), jnp.uint8))
    with pytest.raises(ValueError, match=r"interleave_columns: expected \[64, N\] tiles"):
        interleave_columns(jnp.zeros((32, 64), jnp.float8_e4m3fn), jnp.zeros((32, 64), jnp.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 2])
def test_interleave_columns_multiplies_as_interleaved_tile(seed):
    lo, hi, b = _operand_inputs(seed)
    a = np.stack([np.asarray(lo, np.float64), np.asarray(hi, np.float64)], axis=-1).reshape(64, 128)
    np.testing.assert_array_equal(np.asarray(_run_operand(lo, hi, b), np.float64), a @ np.asarray(b, np.float64).T)
