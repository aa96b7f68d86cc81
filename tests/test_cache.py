"""LatentCache: layout, byte accounting, pytree behaviour, argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import LatentCache, dequantize


@pytest.mark.parametrize("dtype, per_token", [("fp8", 644), ("bf16", 1152)])
def test_nbytes_per_token_matches_design(dtype, per_token):
    cache = LatentCache.create(num_pages=3, page_size=16, dtype=dtype)
    assert cache.nbytes_per_token == per_token
    assert cache.nbytes == 3 * 16 * per_token


def test_fp8_layout_shapes_and_dtypes_with_layer_axis():
    cache = LatentCache.create(num_pages=5, page_size=16, dtype="fp8", num_layers=2)
    assert cache.latent.shape == (2, 5, 16, 512) and cache.latent.dtype == jnp.float8_e4m3fn
    assert cache.scale.shape == (2, 5, 16) and cache.scale.dtype == jnp.float32
    assert cache.rope.shape == (2, 5, 16, 64) and cache.rope.dtype == jnp.bfloat16
    assert (cache.num_layers, cache.num_pages, cache.page_size, cache.num_slots) == (2, 5, 16, 80)


def test_bf16_layout_has_no_scale():
    cache = LatentCache.create(num_pages=2, page_size=32, dtype="bf16")
    assert cache.scale is None and cache.latent.dtype == jnp.bfloat16
    assert cache.dtype == "bf16" and cache.num_layers is None


def test_cache_is_a_pytree_that_survives_jit():
    cache = LatentCache.create(num_pages=2, page_size=16, dtype="fp8")
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 3
    out = jax.jit(lambda c: LatentCache(c.latent, c.scale + 1.0, c.rope))(cache)
    assert isinstance(out, LatentCache) and float(out.scale[0, 0]) == 1.0


def test_dequantize_multiplies_by_the_token_scale():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.uniform(-400, 400, (1, 4, 512)), jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.01, 2.0, (1, 4)), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.bfloat16)
    latent, rope_out = dequantize(LatentCache(q, scale, rope))
    expected = np.asarray(q, np.float64) * np.asarray(scale, np.float64)[..., None]
    # float32 product of an e4m3 value and a float32 scale: one float32 rounding.
    np.testing.assert_allclose(np.asarray(latent), expected, rtol=2**-23)
    np.testing.assert_array_equal(np.asarray(rope_out), np.asarray(rope, np.float32))


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_pages=0), "num_pages"),
    (dict(num_pages=2, page_size=-1), "page_size"),
    (dict(num_pages=2, dtype="int8"), "dtype"),
    (dict(num_pages=2, num_layers=0), "num_layers"),
    (dict(num_pages=2**20, page_size=64, num_layers=2), "num_pages"),
])
def test_create_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LatentCache.create(**kwargs)


def test_dequantize_checks_layer():
    cache = LatentCache.create(num_pages=1, page_size=16, num_layers=2)
    with pytest.raises(ValueError, match="layer"):
        dequantize(cache, layer=2)


def test_kernels_refuse_a_cache_beyond_int32_offsets():
    """A cache assembled from arrays larger than 2**31 - 1 latent elements (e.g. B=128 x 64k
    tokens of one layer) must fail with a ValueError naming
    the cache, not run off the end of the kernels' int32 offsets on the GPU.
    Checked on shapes only (eval_shape: nothing is allocated)."""
    from snapmla_jax.decode import mla_decode
    from snapmla_jax.write import write_kv

    def cache_of(pages):
        return LatentCache(latent=jax.ShapeDtypeStruct((pages, 64, 512), jnp.float8_e4m3fn),
                           scale=jax.ShapeDtypeStruct((pages, 64), jnp.float32),
                           rope=jax.ShapeDtypeStruct((pages, 64, 64), jnp.bfloat16))

    q = jax.ShapeDtypeStruct((1, 1, 16, 512), jnp.bfloat16)
    q_rope = jax.ShapeDtypeStruct((1, 1, 16, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    decode = lambda backend: lambda c, q, qr, t, n: mla_decode(q, qr, c, t, n, softmax_scale=0.1, backend=backend)
    too_big, just_fits = cache_of(2**16 + 1), cache_of(2**16 - 1)  # 2**31 elements = 2**16 pages of 64 x 512
    with pytest.raises(ValueError, match="cache: .*2\\*\\*31"):
        jax.eval_shape(decode("interpret"), too_big, q, q_rope, table, lens)
    jax.eval_shape(decode("interpret"), just_fits, q, q_rope, table, lens)
    jax.eval_shape(decode("xla"), too_big, q, q_rope, table, lens)  # XLA indexes with 64 bits
    tokens = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16), jax.ShapeDtypeStruct((3, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(ValueError, match="cache: .*2\\*\\*31"):
        jax.eval_shape(lambda c, l, r, s: write_kv(c, l, r, s, backend="interpret"), too_big, *tokens, slots)


def test_int32_limit_is_one_rule_for_create_and_the_e2e_planner():
    """``kernel_addressable`` is the int32 rule LatentCache.create and the e2e planner share:
    2**22 token slots x 512 = 2**31 elements is one too many."""
    from snapmla_jax.bench.e2e import PAGE_SIZE, V2_LITE, make_plans
    from snapmla_jax.cache import kernel_addressable

    assert kernel_addressable(2**22 - 1, 512) and not kernel_addressable(2**22, 512)
    with pytest.raises(ValueError, match="num_pages: .*2\\*\\*31"):
        LatentCache.create(num_pages=2**16, page_size=64)
    jax.eval_shape(lambda: LatentCache.create(num_pages=2**16 - 1, page_size=64))
    # B=128: 32k fits the offsets (with a page of slack per row), 64k does not.
    [plan] = [p for p in make_plans(V2_LITE, [128], [32768 - 2 * PAGE_SIZE, 65536], 8, None) if p.kv_cache == "fp8"]
    assert plan.contexts == (32768 - 2 * PAGE_SIZE,) and plan.too_big == (65536,)
