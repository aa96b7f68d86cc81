"""``mla_decode`` compiled (``pytest -m gpu``): what its default routing runs on the GPU (on Hopper
the Mosaic GPU kernels, elsewhere and over pages no kernel reads the XLA path) against float64
attention and the XLA path, through the public API. Each kernel's own tests:
tests/test_mla_decode_mgpu*.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_mla_decode import (attention_f64, cache_contents, fp8_error_bound, make_cache, make_latent, make_queries,
                             out_of_range_inputs, rel_err, run, scrambled_block_table)

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
    (16, 1, 64, 1), (128, 2, 16, 3), (20, 4, 256, None), (16, 2, 32, None)])
def test_compiled_decode_matches_float64_and_the_xla_path(dtype, heads, s_q, page_size, num_splits):
    latent, rope, block_table, seq_lens, q, q_rope = _inputs(
        heads + s_q, batch=3, heads=heads, s_q=s_q, page_size=page_size, pages_per_row=512 // page_size + 1)
    cache = make_cache(latent, rope, dtype)
    out, lse = run(q, q_rope, cache, block_table, seq_lens, backend="pallas", num_splits=num_splits)
    emu, emu_lse = run(q, q_rope, cache, block_table, seq_lens, backend="xla")
    ref, ref_lse, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    seen = np.asarray(seq_lens) > 0
    if dtype == "bf16":
        # P rounded to bf16 (2**-9 relative a weight), a bf16 output and bf16 split partials
        # (2**-9 each): the bound of tests/test_mla_decode_mgpu_bf16.py.
        assert rel_err(np.asarray(out)[seen], ref[seen]) < 6e-3
        np.testing.assert_allclose(np.asarray(lse)[seen], ref_lse[seen], atol=2e-2)
    else:
        # Hopper's FP8 MMA keeps ~14 significant bits in its accumulator (DeepSeek-V3 report,
        # 3.3.2) where the XLA path keeps fp32: up to ~2**-9 of a score's magnitude over a
        # 512-dim product. That moves weights and P' values across e4m3 rounding boundaries:
        # the compiled kernels' bound against the XLA path (MGPU_TOL, tests/test_mla_decode_mgpu.py).
        assert rel_err(np.asarray(out)[seen], np.asarray(emu, np.float64)[seen]) < 7e-2
        finite = np.isfinite(np.asarray(emu_lse))
        np.testing.assert_allclose(lse, emu_lse, atol=2**-9 * float(np.max(np.abs(np.asarray(emu_lse)[finite]))))
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(lse)[0] == -np.inf)  # seq_len 0


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_pages_no_kernel_reads_run_the_xla_path_compiled(dtype):
    """Pages of 24 tokens: no Mosaic kernel reads them; the compiled call is the XLA path, with a
    RuntimeWarning, and within the FP8 bound of float64 attention."""
    latent, rope, block_table, seq_lens, q, q_rope = _inputs(5, batch=3, heads=16, s_q=2, page_size=24,
                                                             pages_per_row=9)
    cache = make_cache(latent, rope, dtype)
    with pytest.warns(RuntimeWarning, match="pages of 24 tokens"):
        out, lse = run(q, q_rope, cache, block_table, seq_lens, backend="pallas")
    ref, _, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    if dtype == "fp8":
        assert np.all(np.abs(np.asarray(out, np.float64) - ref)
                      <= fp8_error_bound(q, q_rope, cache, block_table, seq_lens))
    else:
        assert rel_err(out, ref) < 1e-2
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(lse)[0] == -np.inf)


def test_compiled_layered_cache_with_traced_layer():
    latent, rope, block_table, seq_lens, q, q_rope = _inputs(7, batch=2, heads=16, s_q=1, page_size=64,
                                                             pages_per_row=3)
    caches = [make_cache(latent * (i + 1), rope, "fp8") for i in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *caches)
    want, _ = run(q, q_rope, caches[1], block_table, seq_lens, backend="pallas")
    got = jax.jit(lambda layer: run(q, q_rope, stacked, block_table, seq_lens, backend="pallas", layer=layer))(
        jnp.int32(1))[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [64, 16])
def test_compiled_kernels_clip_traced_pages_and_lengths(dtype, page_size):
    """As test_mla_decode.py's XLA test, compiled: unclipped, the page id 10**6 would address ~10**6
    pages past the cache (an illegal address, or another buffer's bytes)."""
    rng = np.random.default_rng(page_size + 1)
    layers, bad, clipped, q, q_rope = out_of_range_inputs(rng, page_size)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[make_cache(lat, rope, dtype) for lat, rope in layers])
    traced = jax.jit(lambda bt, lens: run(q, q_rope, stacked, bt, lens, backend="pallas", layer=0))
    got, got_lse = traced(*bad)
    want, want_lse = traced(*clipped)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_lse, want_lse)
