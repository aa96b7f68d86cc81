"""Inline-PTX byte packing of the Mosaic GPU decode kernel (pallas_kernels/mgpu_bytes.py).

CPU: a kernel using ``interleave_bytes`` lowers for CUDA. GPU: its words match
the bytes numpy computes (``lo | hi << 8``), bit for bit, on random bytes
(every value an e4m3 byte can hold, NaN patterns included: bits, not values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_bytes import interleave_bytes

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


def _inputs(seed):
    """Two random byte tiles, as e4m3 (the kernel's V bytes: any bit pattern, NaN included)."""
    b = np.random.default_rng(seed).integers(0, 256, (2, *SHAPE), dtype=np.uint8)
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
