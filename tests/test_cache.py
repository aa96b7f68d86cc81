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
    (dict(num_pages=2**24, page_size=64, num_layers=2), "num_pages"),  # 2**31 token slots
])
def test_create_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LatentCache.create(**kwargs)


def test_dequantize_checks_layer():
    cache = LatentCache.create(num_pages=1, page_size=16, num_layers=2)
    with pytest.raises(ValueError, match="layer"):
        dequantize(cache, layer=2)


def _abstract_cache(pages: int, dtype: str = "fp8") -> LatentCache:
    """A one-layer cache of ``pages`` pages of 64 tokens, as shapes only (nothing allocated)."""
    latent = jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16
    return LatentCache(latent=jax.ShapeDtypeStruct((pages, 64, 512), latent),
                       scale=jax.ShapeDtypeStruct((pages, 64), jnp.float32) if dtype == "fp8" else None,
                       rope=jax.ShapeDtypeStruct((pages, 64, 64), jnp.bfloat16))


def test_a_cache_past_2_31_latent_elements_is_taken_and_past_2_31_token_slots_refused(monkeypatch):
    """A cache of more than 2**31 - 1 latent elements (B=128 x 64k tokens of one layer): the
    decode kernels, XLA and write_kv index token rows and take it. Past 2**31 - 1 token slots no
    kernel can name a row: a ValueError naming the cache. Shapes only."""
    from snapmla_jax import decode as decode_module
    from snapmla_jax.decode import mla_decode
    from snapmla_jax.write import write_kv

    monkeypatch.setattr(decode_module, "check_interpreter_devices", lambda: None)  # shapes only: nothing runs
    q = jax.ShapeDtypeStruct((1, 1, 16, 512), jnp.bfloat16)
    q_rope = jax.ShapeDtypeStruct((1, 1, 16, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    decode = lambda backend: lambda c, q, qr, t, n: mla_decode(q, qr, c, t, n, softmax_scale=0.1, backend=backend)
    too_big = _abstract_cache(2**16 + 1)  # 2**31 elements = 2**16 pages
    jax.eval_shape(decode("interpret"), too_big, q, q_rope, table, lens)
    jax.eval_shape(decode("xla"), too_big, q, q_rope, table, lens)
    tokens = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16), jax.ShapeDtypeStruct((3, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    write = lambda c, l, r, s: write_kv(c, l, r, s, backend="interpret")
    jax.eval_shape(write, too_big, *tokens, slots)
    too_many_rows = _abstract_cache(2**25 + 1)
    with pytest.raises(ValueError, match="cache: .*token slots.*2\\*\\*31 - 1"):
        jax.eval_shape(decode("interpret"), too_many_rows, q, q_rope, table, lens)
    with pytest.raises(ValueError, match="cache: .*token slots.*2\\*\\*31 - 1"):
        jax.eval_shape(write, too_many_rows, *tokens, slots)


def test_the_int32_rules_are_one_for_create_and_the_e2e_planner():
    """``kernel_addressable`` is the rule LatentCache.create and the e2e planner share: 2**31 - 1
    token slots in one array."""
    from snapmla_jax.bench.e2e import V2_LITE, make_plans
    from snapmla_jax.cache import kernel_addressable

    assert kernel_addressable(2**31 - 1) and not kernel_addressable(2**31)
    with pytest.raises(ValueError, match="num_pages: .*2\\*\\*31 - 1 token slots"):
        LatentCache.create(num_pages=2**25, page_size=64)
    jax.eval_shape(lambda: LatentCache.create(num_pages=2**16 + 1, page_size=64))
    # B=128 x 64k (2**33 elements) is planned: the compiled kernels take it.
    [plan] = [p for p in make_plans(V2_LITE, [128], [65536], 8, None) if p.kv_cache == "fp8"]
    assert plan.contexts == (65536,) and plan.too_big == ()
