"""Inline-PTX byte packing of the Mosaic GPU decode kernel (pallas_kernels/mgpu_bytes.py).

CPU: a kernel using both helpers lowers for CUDA. GPU: its words match the
bytes numpy computes (``lo | hi << 8``), bit for bit, on random values with
ties, values past e4m3's range and NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_bytes import interleave_bytes, pack_e4m3_pairs

SHAPE = (64, 128)


def _kernel(f_lo_ref, f_hi_ref, b_lo_ref, b_hi_ref, packed_ref, interleaved_ref, f_s, b_s, words_s, bar):
    for src, dst in ((f_lo_ref, f_s.at[0]), (f_hi_ref, f_s.at[1]), (b_lo_ref, b_s.at[0]), (b_hi_ref, b_s.at[1])):
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA)
    words_s[0] = pack_e4m3_pairs(load(f_s.at[0]), load(f_s.at[1]))
    words_s[1] = interleave_bytes(load(b_s.at[0]), load(b_s.at[1]))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(words_s.at[0], packed_ref)
    plgpu.copy_smem_to_gmem(words_s.at[1], interleaved_ref)
    plgpu.wait_smem_to_gmem(0)


def _run(*args):
    words = jax.ShapeDtypeStruct(SHAPE, jnp.uint16)
    return plgpu.kernel(_kernel, out_type=(words, words), kernel_name="test_mgpu_bytes",
                        scratch_types=[plgpu.SMEM((2, *SHAPE), jnp.float32), plgpu.SMEM((2, *SHAPE), jnp.float8_e4m3fn),
                                       plgpu.SMEM((2, *SHAPE), jnp.uint16), plgpu.Barrier(num_arrivals=4)])(*args)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((2, *SHAPE)).astype(np.float32) * np.float32(40.0)
    f[0, 0, :8] = [464.0, -1000.0, 448.0, np.nan, 0.0, -0.0, 2.0**-10, 13.0]  # saturation, NaN, signed 0, subnormal
    f[1, 0, :8] = [9.0, 11.0, 0.4375 + 2.0**-6, 1e-9, -600.0, 300.0, 15.0, -17.0]  # ties round to even
    b = rng.integers(0, 256, (2, *SHAPE), dtype=np.uint8)
    return f, b


def _expected(f, b):
    # satfinite: out-of-range values saturate to +-448 (NaN stays NaN) before the e4m3 rounding.
    bits = np.clip(f, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    pack = lambda lo, hi: lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
    return pack(bits[0], bits[1]), pack(b[0], b[1])


def test_byte_helpers_lower_for_cuda():
    f, b = _inputs(0)
    args = (jnp.asarray(f[0]), jnp.asarray(f[1]), jnp.asarray(b[0]).view(jnp.float8_e4m3fn),
            jnp.asarray(b[1]).view(jnp.float8_e4m3fn))
    jax.jit(_run).trace(*args).lower(lowering_platforms=("cuda",))


def test_byte_helpers_reject_mismatched_pairs():
    with pytest.raises(ValueError, match="pack_e4m3_pairs: expected two arrays"):
        pack_e4m3_pairs(jnp.zeros((64, 64)), jnp.zeros((64, 128)))
    with pytest.raises(ValueError, match="interleave_bytes: expected two arrays"):
        interleave_bytes(jnp.zeros((64, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 2])
def test_byte_helpers_match_numpy(seed):
    f, b = _inputs(seed)
    packed, interleaved = _run(jnp.asarray(f[0]), jnp.asarray(f[1]), jnp.asarray(b[0]).view(jnp.float8_e4m3fn),
                               jnp.asarray(b[1]).view(jnp.float8_e4m3fn))
    want_packed, want_interleaved = _expected(f, b)
    np.testing.assert_array_equal(np.asarray(interleaved), want_interleaved)
    got, want = np.asarray(packed), want_packed
    nan_byte = lambda w: ((w & 0x7F) == 0x7F)  # e4m3fn NaN: S.1111.111 (either sign)
    for shift in (0, 8):
        g, w = (got >> shift) & 0xFF, (want >> shift) & 0xFF
        np.testing.assert_array_equal(nan_byte(g), nan_byte(w))
        np.testing.assert_array_equal(np.where(nan_byte(w), 0, g), np.where(nan_byte(w), 0, w))
