"""Compiled decode kernels (Triton backend) against interpret mode and the xla
path on the same inputs. Run with ``pytest -m gpu`` on a CUDA machine.

The Triton kernels are pinned with their configs where it matters: compiled
fp8 decoding with 64-token pages defaults to the Mosaic GPU kernel
(test_mla_decode_mgpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.pallas_kernels.mla_decode import BF16_CONFIG, FP8_CONFIG
from test_mla_decode import (make_cache, make_latent, make_queries, out_of_range_inputs, rel_err, run,
                             scrambled_block_table)

pytestmark = pytest.mark.gpu


def _inputs(seed, *, batch, heads, s_q, page_size, pages_per_row):
    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_row + 3
    latent, rope = make_latent(rng, num_pages, page_size)
    block_table = scrambled_block_table(rng, batch, pages_per_row, num_pages)
    capacity = pages_per_row * page_size
    seq_lens = jnp.asarray(rng.integers(s_q, capacity + 1, batch), jnp.int32).at[0].set(0)
    q, q_rope = make_queries(rng, batch, s_q, heads)
    return latent, rope, block_table, seq_lens, q, q_rope


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("heads,s_q,page_size,num_splits", [
    (16, 1, 64, 1), (128, 2, 16, 3), (20, 4, 256, None), (128, 1, 24, None)])
def test_compiled_kernel_matches_interpret_and_xla(dtype, heads, s_q, page_size, num_splits):
    latent, rope, block_table, seq_lens, q, q_rope = _inputs(
        heads + s_q, batch=3, heads=heads, s_q=s_q, page_size=page_size, pages_per_row=512 // page_size + 1)
    cache = make_cache(latent, rope, dtype)
    config = FP8_CONFIG if dtype == "fp8" else BF16_CONFIG
    out, lse = run(q, q_rope, cache, block_table, seq_lens, backend="pallas", num_splits=num_splits, config=config)
    interp, interp_lse = run(q, q_rope, cache, block_table, seq_lens, backend="interpret", num_splits=num_splits,
                             config=config)
    emu, emu_lse = run(q, q_rope, cache, block_table, seq_lens, backend="xla", config=config)
    # Same roundings everywhere; the GPU's exp2 (2 ulp) and MMA summation order
    # differ in fp32 only, which can move a P value across an e4m3/bf16 rounding
    # boundary for isolated tokens: 2e-3 of the output scale (see the CPU tests).
    assert rel_err(out, np.asarray(interp, np.float64)) <= 2e-3
    assert rel_err(out, np.asarray(emu, np.float64)) <= 2e-3
    # lse: fp32 log-sum-exp of O(10) scores, 1e-4 apart for BF16 (fp32 MMA
    # accumulation). Hopper's FP8 MMA keeps only ~14 significant bits in its
    # accumulator (DeepSeek-V3 report, 3.3.2) where the CPU paths keep fp32:
    # over the 16 k-steps of a 512-dim product that is up to ~2**-9 of the
    # score's magnitude (measured on an H100: 5e-4 of |lse| at most).
    finite = np.isfinite(np.asarray(interp_lse))
    lse_atol = 1e-4 if dtype == "bf16" else 2**-9 * float(np.max(np.abs(np.asarray(interp_lse)[finite])))
    np.testing.assert_allclose(lse, interp_lse, atol=lse_atol)
    np.testing.assert_allclose(lse, emu_lse, atol=lse_atol)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(lse)[0] == -np.inf)  # seq_len 0


def test_compiled_layered_cache_with_traced_layer():
    latent, rope, block_table, seq_lens, q, q_rope = _inputs(7, batch=2, heads=16, s_q=1, page_size=64,
                                                             pages_per_row=3)
    caches = [make_cache(latent * (i + 1), rope, "fp8") for i in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *caches)
    want, _ = run(q, q_rope, caches[1], block_table, seq_lens, backend="pallas")
    got = jax.jit(lambda layer: run(q, q_rope, stacked, block_table, seq_lens, backend="pallas", layer=layer))(
        jnp.int32(1))[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("config", [
    dict(block_m=64, num_warps=8, pv_mma="fp8"),
    dict(block_m=64, num_warps=8, pv_mma="bf16"),
    dict(block_m=32, num_warps=4, pv_mma="bf16"),
], ids=str)
def test_compiled_fp8_config_variants_match_interpret(config):
    from snapmla_jax.pallas_kernels.mla_decode import DecodeConfig
    latent, rope, block_table, seq_lens, q, q_rope = _inputs(
        11, batch=3, heads=128, s_q=2, page_size=64, pages_per_row=9)
    cache = make_cache(latent, rope, "fp8")
    out, lse = run(q, q_rope, cache, block_table, seq_lens, backend="pallas", config=DecodeConfig(**config))
    interp, interp_lse = run(q, q_rope, cache, block_table, seq_lens, backend="interpret")
    # Same e4m3 operands whichever MMA runs P'.V; the FP8 Q.K^T MMA's ~14-bit
    # accumulation bounds the lse as in the test above.
    assert rel_err(out, np.asarray(interp, np.float64)) <= 2e-3
    finite = np.isfinite(np.asarray(interp_lse))
    lse_atol = 2**-9 * float(np.max(np.abs(np.asarray(interp_lse)[finite])))
    np.testing.assert_allclose(lse, interp_lse, atol=lse_atol)


@pytest.mark.parametrize("dtype,config", [("bf16", BF16_CONFIG), ("fp8", FP8_CONFIG)])
@pytest.mark.parametrize("page_size", [64, 24])
def test_compiled_kernels_clip_traced_pages_and_lengths(dtype, config, page_size):
    """As test_mla_decode.py's interpreter test, compiled: unclipped, the page id 10**6 would
    address ~10**6 pages past the cache (an illegal address, or another buffer's bytes)."""
    rng = np.random.default_rng(page_size + 1)
    layers, bad, clipped, q, q_rope = out_of_range_inputs(rng, page_size)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[make_cache(lat, rope, dtype) for lat, rope in layers])
    traced = jax.jit(lambda bt, lens: run(q, q_rope, stacked, bt, lens, backend="pallas", config=config, layer=0))
    got, got_lse = traced(*bad)
    want, want_lse = traced(*clipped)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_lse, want_lse)
