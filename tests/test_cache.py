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


def test_the_triton_kernels_refuse_a_cache_beyond_their_int32_element_offsets():
    """A cache of more than 2**31 - 1 latent elements (B=128 x 64k tokens of one layer) must not
    reach a Triton kernel (an illegal address on the GPU): a ValueError naming the cache and the
    way out. The Mosaic kernels, XLA and write_kv index token rows and take it. Shapes only."""
    from snapmla_jax.decode import mla_decode
    from snapmla_jax.pallas_kernels.mla_decode import MOSAIC_CONFIG
    from snapmla_jax.write import write_kv

    q = jax.ShapeDtypeStruct((1, 1, 16, 512), jnp.bfloat16)
    q_rope = jax.ShapeDtypeStruct((1, 1, 16, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)

    def decode(backend, config=None):
        return lambda c, q, qr, t, n: mla_decode(q, qr, c, t, n, softmax_scale=0.1, backend=backend, config=config)

    too_big, just_fits = _abstract_cache(2**16 + 1), _abstract_cache(2**16 - 1)  # 2**31 elements = 2**16 pages
    # Off Hopper the default kernel is the Triton one.
    with pytest.raises(ValueError, match="cache: .*Triton.*2\\*\\*31 - 1 latent elements.*Mosaic"):
        jax.eval_shape(decode("interpret"), too_big, q, q_rope, table, lens)
    jax.eval_shape(decode("interpret"), just_fits, q, q_rope, table, lens)
    jax.eval_shape(decode("interpret", MOSAIC_CONFIG), too_big, q, q_rope, table, lens)
    jax.eval_shape(decode("xla"), too_big, q, q_rope, table, lens)
    tokens = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16), jax.ShapeDtypeStruct((3, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    write = lambda c, l, r, s: write_kv(c, l, r, s, backend="interpret")
    jax.eval_shape(write, too_big, *tokens, slots)
    # Past 2**31 - 1 token slots no kernel can name a row.
    too_many_rows = _abstract_cache(2**25 + 1)
    with pytest.raises(ValueError, match="cache: .*token slots.*2\\*\\*31 - 1"):
        jax.eval_shape(decode("interpret", MOSAIC_CONFIG), too_many_rows, q, q_rope, table, lens)
    with pytest.raises(ValueError, match="cache: .*token slots.*2\\*\\*31 - 1"):
        jax.eval_shape(write, too_many_rows, *tokens, slots)


def test_a_cache_too_large_for_triton_goes_to_a_mosaic_kernel(monkeypatch):
    """On a Hopper GPU (faked) every cache with 64-token pages runs a Mosaic kernel, one past the
    Triton kernels' offsets included; the interpreter keeps the Triton kernels' config (which
    ``mla_decode`` refuses for such a cache); ``max_token_slots`` says what each backend takes."""
    from snapmla_jax import decode
    from snapmla_jax.pallas_kernels.mla_decode import BF16_CONFIG, FP8_CONFIG, MOSAIC_CONFIG

    monkeypatch.setattr(decode, "_on_hopper", lambda: True)
    monkeypatch.setattr(decode, "resolve_backend", lambda backend: backend)  # "pallas" without a GPU
    for dtype, triton in (("fp8", FP8_CONFIG), ("bf16", BF16_CONFIG)):
        small, large = _abstract_cache(2**16 - 1, dtype), _abstract_cache(2**16 + 1, dtype)
        assert decode.default_config(small, "pallas") == decode.default_config(large, "pallas") == MOSAIC_CONFIG
        assert decode.default_config(large, "interpret") == triton  # refused by mla_decode
    assert decode.max_token_slots(512, 64, "pallas") == decode.max_token_slots(512, 64, "xla") == 2**31 - 1
    assert decode.max_token_slots(512, 24, "pallas") == decode.max_token_slots(512, 64, "interpret") == 2**22 - 1
    # Pages of any multiple of 16 tokens run the Mosaic kernels.
    for page_size in (16, 32, 48):
        for dtype in ("fp8", "bf16"):
            assert decode.max_token_slots(512, page_size, "pallas", dtype) == 2**31 - 1


def test_the_int32_rules_are_one_for_create_and_the_e2e_planner():
    """``kernel_addressable`` is the rule LatentCache.create and the e2e planner share: 2**31 - 1
    token slots in one array, and 2**31 - 1 latent elements for the Triton kernels."""
    from snapmla_jax.bench.e2e import V2_LITE, make_plans
    from snapmla_jax.cache import kernel_addressable

    assert kernel_addressable(2**31 - 1, 512) and not kernel_addressable(2**31, 512)
    assert kernel_addressable(2**22 - 1, 512, triton=True) and not kernel_addressable(2**22, 512, triton=True)
    with pytest.raises(ValueError, match="num_pages: .*2\\*\\*31 - 1 token slots"):
        LatentCache.create(num_pages=2**25, page_size=64)
    jax.eval_shape(lambda: LatentCache.create(num_pages=2**16 + 1, page_size=64))
    # B=128 x 64k (2**33 elements) is planned: the compiled kernels take it.
    [plan] = [p for p in make_plans(V2_LITE, [128], [65536], 8, None) if p.kv_cache == "fp8"]
    assert plan.contexts == (65536,) and plan.too_big == ()
