"""Inline-PTX byte packing of the Mosaic GPU decode kernel (pallas_kernels/mgpu_bytes.py).

CPU: kernels using ``interleave_bytes`` and ``store_byte_lane`` lower for CUDA.
GPU: ``interleave_bytes``'s words match the bytes numpy computes (``lo | hi <<
8``), bit for bit, on random bytes (every value an e4m3 byte can hold, NaN
patterns included: bits, not values); ``store_byte_lane`` puts two tiles'
bytes in alternate bytes of one tile, read back through a wgmma-layout TMA;
``interleave_quads``' words (4-byte loads) match numpy's at their relabelled columns
(``quad_column``), and ``quads_in_order`` puts every value of a relabelled f32 tile back at
its column, exactly. ``load_vt_quads`` (V^T as the register A operand, NaN tokens past a count
masked), ``store_quads`` (P' as the B operand) and ``store_feature_pairs`` (O^T tiles back in
row-major order) together multiply as numpy does on small integers, exactly (GPU); their
relabellings (``vt_feature``, ``vt_step_row``) are permutations (CPU).
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

from pallas_kernels.mgpu_bytes import (BYTE_TILE_TRANSFORMS, interleave_bytes, interleave_quads, load_vt_quads,
                                       output_transforms, quad_column, quads_in_order, store_byte_lane,
                                       store_feature_pairs, store_quads, vt_feature, vt_step_row)

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



def _quads_kernel(lo_ref, hi_ref, words_ref, bytes_s, words_s, bar):
    for src, dst in ((lo_ref, bytes_s.at[0]), (hi_ref, bytes_s.at[1])):
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA_8BIT)  # 4 bytes a thread
    words_s[...] = interleave_quads(load(bytes_s.at[0]), load(bytes_s.at[1]))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(words_s, words_ref)
    plgpu.wait_smem_to_gmem(0)


def _run_quads(lo, hi):
    """Two e4m3 [64, 128] tiles (the decode kernel's V chunk halves, in its SMEM layout) -> uint16
    [64, 128] words at relabelled columns."""
    return plgpu.kernel(_quads_kernel, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.uint16), kernel_name="test_quads",
                        scratch_types=[plgpu.SMEM((2, *SHAPE), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                                       plgpu.SMEM(SHAPE, jnp.uint16), plgpu.Barrier(num_arrivals=2)])(lo, hi)


def _in_order_kernel(x_ref, out_ref, x_s, out_s, bar):
    plgpu.copy_gmem_to_smem(x_ref, x_s, bar)
    plgpu.barrier_wait(bar)
    out_s[...] = quads_in_order(plgpu.load(x_s, layout=plgpu.Layout.WGMMA))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_ref)
    plgpu.wait_smem_to_gmem(0)


def _run_in_order(x):
    """f32 [64, 64] -> the same values, column l moved to column quad_column(l)."""
    return plgpu.kernel(_in_order_kernel, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                        kernel_name="test_quads_in_order",
                        scratch_types=[plgpu.SMEM((64, 64), jnp.float32), plgpu.SMEM((64, 64), jnp.float32),
                                       plgpu.Barrier(num_arrivals=1)])(x)


def test_quad_column_is_a_permutation_within_groups_of_16():
    columns = [quad_column(l) for l in range(128)]
    assert sorted(columns) == list(range(128))
    assert all(c // 16 == l // 16 for l, c in enumerate(columns))
    assert columns[:16] == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]


def test_quad_helpers_lower_for_cuda():
    _, lo, hi = _inputs(0)
    jax.jit(_run_quads).trace(lo, hi).lower(lowering_platforms=("cuda",))
    jax.jit(_run_in_order).trace(jnp.zeros((64, 64), jnp.float32)).lower(lowering_platforms=("cuda",))


def test_quad_helpers_reject_bad_arguments():
    with pytest.raises(ValueError, match="interleave_quads: expected two arrays"):
        interleave_quads(jnp.zeros((64, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32))
    with pytest.raises(ValueError, match=r"interleave_quads: expected \[64, N\]"):
        interleave_quads(jnp.zeros((64, 8), jnp.uint8), jnp.zeros((64, 8), jnp.uint8))
    with pytest.raises(ValueError, match="quads_in_order: values: expected f32"):
        quads_in_order(jnp.zeros((64, 64), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 2])
def test_interleave_quads_matches_numpy(seed):
    b, lo, hi = _inputs(seed)
    columns = [quad_column(l) for l in range(SHAPE[1])]
    want = (b[0].astype(np.uint16) | (b[1].astype(np.uint16) << 8))[:, columns]
    np.testing.assert_array_equal(np.asarray(_run_quads(lo, hi)), want)


@pytest.mark.gpu
def test_quads_in_order_puts_columns_back():
    x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    want = np.empty_like(x)
    want[:, [quad_column(l) for l in range(64)]] = x
    np.testing.assert_array_equal(np.asarray(_run_in_order(jnp.asarray(x))), want)


# --- V^T as the register A operand (``load_vt_quads``, ``store_quads``, ``store_feature_pairs``) ---

def _vt_kernel(v_ref, p_ref, visible_ref, out_ref, v_s, p_in_s, p8_s, o_s, bar, *, masked: bool):
    """out [64, 128] = P' . V over one step: P' (two [64, 64] halves in step-row order) stored by
    ``store_quads``, V^T loaded by ``load_vt_quads`` (tokens past ``visible`` zeroed if
    ``masked``), the products' O^T tiles put back in row-major order by ``store_feature_pairs``."""
    plgpu.copy_gmem_to_smem(v_ref, v_s, bar)
    for half in range(2):
        plgpu.copy_gmem_to_smem(p_ref.at[:, pl.ds(64 * half, 64)], p_in_s.at[half], bar)
    plgpu.barrier_wait(bar)
    for half in range(2):
        store_quads(plgpu.load(p_in_s.at[half], layout=plgpu.Layout.WGMMA), p8_s, half)
    plgpu.commit_smem()
    visible = None
    if masked:
        visible = plgpu.layout_cast(jnp.full((64,), visible_ref[0], jnp.int32), plgpu.Layout.WGMMA.reduce(1))
    for tile in range(2):
        def product(acc_ref, tile=tile):
            plgpu.wgmma(acc_ref, load_vt_quads(v_s, tile, visible), p8_s.transpose((1, 0)))
            return acc_ref[...]
        store_feature_pairs(pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32)), o_s.at[tile])
    plgpu.commit_smem()
    for tile in range(2):
        plgpu.copy_smem_to_gmem(o_s.at[tile], out_ref.at[:, pl.ds(64 * tile, 64)])
    plgpu.wait_smem_to_gmem(0)


def _run_vt(v, p, visible, out_dtype=jnp.float32, masked=True):
    """v e4m3 [128 step rows, 128 features], p e4m3 [64, 128 step rows], visible int32 [1]."""
    return plgpu.kernel(
        functools.partial(_vt_kernel, masked=masked), out_type=jax.ShapeDtypeStruct((64, 128), out_dtype),
        kernel_name="test_vt_quads",
        scratch_types=[plgpu.SMEM((128, 128), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                       plgpu.SMEM((2, 64, 64), jnp.float8_e4m3fn),
                       plgpu.SMEM((64, 128), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                       plgpu.SMEM((2, 64, 64), out_dtype, transforms=output_transforms(out_dtype)),
                       plgpu.Barrier(num_arrivals=3)])(v, p, visible)


def _vt_inputs(seed):
    """Small-integer e4m3 V and P' (every product and sum exact in f32), NaN bytes in V's rows
    past ``visible`` tokens (step row c < 64 is token 2c, row 64 + c token 2c + 1)."""
    rng = np.random.default_rng(seed)
    v = rng.integers(-4, 5, (128, 128)).astype(np.float32)
    p = rng.integers(0, 9, (64, 128)).astype(np.float32)
    return v, p


def test_vt_helpers_order_and_reject_bad_arguments():
    rows = [vt_feature(r) for r in range(64)]
    cols = [vt_step_row(k) for k in range(128)]
    assert sorted(rows) == list(range(64)) and sorted(cols) == list(range(128))
    assert rows[:16] == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert cols[:16] == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    with pytest.raises(ValueError, match="load_vt_quads: tile"):
        load_vt_quads(jax.ShapeDtypeStruct((128, 128), jnp.float8_e4m3fn), 2)
    with pytest.raises(ValueError, match="store_quads: values: expected e4m3"):
        store_quads(jnp.zeros((64, 64), jnp.float32), None, 0)
    with pytest.raises(ValueError, match="store_feature_pairs: values: expected f32"):
        store_feature_pairs(jnp.zeros((64, 32), jnp.float32), None)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_vt_helpers_lower_for_cuda(out_dtype):
    v, p = _vt_inputs(0)
    args = (jnp.asarray(v, jnp.float8_e4m3fn), jnp.asarray(p, jnp.float8_e4m3fn), jnp.asarray([100], jnp.int32))
    jax.jit(functools.partial(_run_vt, out_dtype=out_dtype)).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("visible,out_dtype", [(128, jnp.float32), (77, jnp.float32), (1, jnp.float32),
                                               (0, jnp.float32), (200, jnp.bfloat16), (94, jnp.bfloat16)])
def test_vt_product_matches_numpy(visible, out_dtype):
    """P'.V through the three helpers equals numpy's product of the same integers exactly (f32;
    bf16: the exact sum rounded once), with V's rows of tokens at or past ``visible`` NaN."""
    v, p = _vt_inputs(visible)
    tokens = np.concatenate([2 * np.arange(64), 2 * np.arange(64) + 1])
    v_bytes = np.asarray(jnp.asarray(v, jnp.float8_e4m3fn)).view(np.uint8).copy()
    v_bytes[tokens >= visible] = 0x7F  # e4m3 NaN
    want = p @ np.where((tokens < visible)[:, None], v, 0.0)
    got = _run_vt(jnp.asarray(v_bytes).view(jnp.float8_e4m3fn), jnp.asarray(p, jnp.float8_e4m3fn),
                  jnp.asarray([visible], jnp.int32), out_dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.asarray(want, out_dtype), np.float32))
