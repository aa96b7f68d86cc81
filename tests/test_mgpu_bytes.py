"""Inline-PTX operand helpers of the Mosaic GPU decode kernel's transposed P'.V (pallas_kernels/mgpu_bytes.py).

``load_vt_quads`` (V^T as the register A operand, NaN tokens past a count masked),
``store_quads`` (P' as the B operand) and ``store_feature_pairs`` (O^T tiles back in
row-major order) together multiply as numpy does on small integers, exactly (GPU); they
lower for CUDA and name the argument they reject (CPU); their relabellings (``vt_feature``,
``vt_step_row``) are permutations (CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.mgpu_bytes import (BYTE_TILE_TRANSFORMS, load_vt_quads, output_transforms,
                                                   store_feature_pairs, store_quads, store_token_bytes, vt_column,
                                                   vt_feature, vt_step_row)

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


def _token_bytes_kernel(v_ref, pt_ref, out_ref, v_s, pt_in_s, p8_s, o_s, bar, stored_bar):
    """out [N, 128] = P' . V over one step, P' given as P'^T [128 step rows, N]: warpgroup w
    stores rows [64 w, 64 w + 64) of it by ``store_token_bytes``, then warpgroup 0 multiplies
    with V^T from ``load_vt_quads`` ([64, N] O^T tiles out through ``store_feature_pairs``)."""
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(v_ref, v_s, bar)
        for half in range(2):
            plgpu.copy_gmem_to_smem(pt_ref.at[pl.ds(64 * half, 64)], pt_in_s.at[half], bar)

    plgpu.barrier_wait(bar)
    store_token_bytes(plgpu.load(pt_in_s.at[wg], layout=plgpu.Layout.WGMMA), p8_s)
    plgpu.commit_smem()
    plgpu.barrier_arrive(stored_bar)
    plgpu.barrier_wait(stored_bar)

    @pl.when(wg == 0)
    def _():
        rows = p8_s.shape[0]
        for tile in range(2):
            def product(acc_ref, tile=tile):
                plgpu.wgmma(acc_ref, load_vt_quads(v_s, tile), p8_s.transpose((1, 0)))
                return acc_ref[...]
            store_feature_pairs(pl.run_scoped(product, plgpu.ACC((64, rows), jnp.float32)), o_s.at[tile])
        plgpu.commit_smem()
        for tile in range(2):
            plgpu.copy_smem_to_gmem(o_s.at[tile], out_ref.at[:, pl.ds(64 * tile, 64)])
        plgpu.wait_smem_to_gmem(0)


def _run_token_bytes(v, pt):
    """v e4m3 [128 step rows, 128 features], pt e4m3 [128 step rows, N] -> f32 [N, 128]."""
    rows = pt.shape[1]
    return plgpu.kernel(
        _token_bytes_kernel, out_type=jax.ShapeDtypeStruct((rows, 128), jnp.float32), num_threads=2,
        thread_name="wg", kernel_name="test_token_bytes",
        scratch_types=[plgpu.SMEM((128, 128), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                       plgpu.SMEM((2, 64, rows), jnp.float8_e4m3fn),
                       plgpu.SMEM((rows, 128), jnp.float8_e4m3fn, transforms=BYTE_TILE_TRANSFORMS),
                       plgpu.SMEM((2, rows, 64), jnp.float32, transforms=output_transforms(jnp.float32)),
                       plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=2)])(v, pt)


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
    tile = jnp.zeros((64, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="store_quads: values: expected e4m3"):
        store_quads(tile.astype(jnp.float32), None, 0)
    with pytest.raises(ValueError, match="store_quads: dst_ref: expected e4m3"):
        store_quads(tile, jnp.zeros((64, 64), jnp.float8_e4m3fn), 0)
    with pytest.raises(ValueError, match="store_quads: lane: expected 0, 1 or None"):
        store_quads(tile, jnp.zeros((64, 128), jnp.float8_e4m3fn), 2)
    with pytest.raises(ValueError, match="store_feature_pairs: values: expected f32"):
        store_feature_pairs(jnp.zeros((64, 48), jnp.float32), None)
    with pytest.raises(ValueError, match="store_token_bytes: values: expected e4m3"):
        store_token_bytes(jnp.zeros((64, 16), jnp.float32), None)
    with pytest.raises(ValueError, match="store_token_bytes: dst_ref: expected e4m3"):
        store_token_bytes(jnp.zeros((64, 16), jnp.float8_e4m3fn), jnp.zeros((32, 128), jnp.float8_e4m3fn))


def test_vt_column_inverts_vt_step_row():
    assert [vt_column(vt_step_row(k)) for k in range(128)] == list(range(128))


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


@pytest.mark.parametrize("rows", [16, 32])
def test_token_bytes_lower_for_cuda(rows):
    v, p = _vt_inputs(rows)
    args = (jnp.asarray(v, jnp.float8_e4m3fn), jnp.asarray(p[:rows].T, jnp.float8_e4m3fn))
    jax.jit(_run_token_bytes).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 32])
def test_token_bytes_product_matches_numpy(rows):
    """P'.V with P' stored from P'^T halves by ``store_token_bytes`` (the 16-row kernel's layout)
    equals numpy's product of the same small integers exactly (every sum exact in f32)."""
    v, p = _vt_inputs(rows)
    p = p[:rows]
    got = _run_token_bytes(jnp.asarray(v, jnp.float8_e4m3fn), jnp.asarray(p.T, jnp.float8_e4m3fn))
    np.testing.assert_array_equal(np.asarray(got), p @ v)
