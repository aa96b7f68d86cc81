"""The compiled kernels on one cache array past 2**31 - 1 latent elements (a Hopper GPU).

An int32 element offset would stop there; the Mosaic GPU kernels index token rows (TMA
coordinates) and must not. Rows whose pages sit at the end of a pool of 2.29e9 latent
elements are written and decoded, and must give the same bits as the same rows at the start of a
small pool: the same kernels on the same data, only the addresses differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.cache import LatentCache
from snapmla_jax.decode import mla_decode
from snapmla_jax.write import write_kv

PAGE = 64
LARGE_PAGES = 70_000  # 4.48M token slots: 2.29e9 latent elements


def _zeros(pages: int, dtype: str) -> LatentCache:
    shape = (pages, PAGE)
    latent = jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16
    return LatentCache(jnp.zeros((*shape, 512), latent), jnp.zeros(shape, jnp.float32) if dtype == "fp8" else None,
                       jnp.zeros((*shape, 64), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, context", [("fp8", 16, 8192), ("fp8", 128, 8192), ("bf16", 128, 8192),
                                                   ("fp8", 16, 1024), ("bf16", 16, 1024)])
def test_a_cache_past_the_int32_element_offsets_gives_the_bits_of_a_small_one(dtype, heads, context):
    rng = np.random.default_rng(heads + context)
    batch = 4
    pages_per_row = context // PAGE
    large = _zeros(LARGE_PAGES, dtype)
    assert large.latent.size > 2**31 - 1
    small = _zeros(batch * pages_per_row, dtype)
    first = LARGE_PAGES - batch * pages_per_row
    table_small = np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
    table_large = jnp.asarray(first + table_small)
    table_small = jnp.asarray(table_small)
    tokens = batch * context
    outliers = np.where(rng.random((tokens, 1)) < 0.01, 30.0, 1.0)
    latent = jnp.asarray(rng.standard_normal((tokens, 512)) * outliers, jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.bfloat16)
    slots = lambda table: (table[:, :, None] * PAGE + jnp.arange(PAGE)).reshape(-1)
    write = jax.jit(write_kv, donate_argnums=0)
    large = write(large, latent, rope, slots(table_large))
    small = write(small, latent, rope, slots(table_small))
    np.testing.assert_array_equal(np.asarray(large.latent[first:].astype(jnp.float32)),
                                  np.asarray(small.latent.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(large.rope[first:]), np.asarray(small.rope))
    if dtype == "fp8":
        np.testing.assert_array_equal(np.asarray(large.scale[first:]), np.asarray(small.scale))

    seq_lens = jnp.asarray([context, context - 37, 1, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, 512)), jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((batch, 1, heads, 64)), jnp.bfloat16)
    decode = jax.jit(mla_decode, static_argnames=("softmax_scale", "return_lse"))
    out_large, lse_large = decode(q, q_rope, large, table_large, seq_lens, softmax_scale=0.04, return_lse=True)
    out_small, lse_small = decode(q, q_rope, small, table_small, seq_lens, softmax_scale=0.04, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out_large.astype(jnp.float32)), np.asarray(out_small.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(lse_large), np.asarray(lse_small))
    assert np.isfinite(np.asarray(out_large.astype(jnp.float32))).all() and np.abs(np.asarray(out_large[:3], np.float32)).max() > 0
