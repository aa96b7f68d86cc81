"""write_kv: fused per-token FP8 quantize + paged cache write.

The Mosaic GPU kernel (pallas_kernels/write_kv.py; the Mosaic GPU interpreter here, compiled
under -m gpu) must write the same bytes as the jnp reference, reconstruct within FP8 rounding
of a float64 computation, write exactly the named slots, and reject bad input by name. On the
CPU the compiled path is also lowered for CUDA (no GPU needed).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from snapmla_jax import LatentCache, dequantize, write_kv
from snapmla_jax.backend import lower_for_cuda, mosaic_module_texts
from snapmla_jax.pallas_kernels.fp8 import FP8_E4M3_MAX_RECIPROCAL
from snapmla_jax.pallas_kernels.write_kv import WriteKVConfig, write_kv_pallas, write_kv_reference
from snapmla_jax.write import _flat_arrays

POISON_LATENT = -3.0  # an e4m3- and bf16-exact value no write produces at these scales
POISON_SCALE = -1.0


def _poisoned(dtype, num_pages=5, page_size=16, num_layers=None):
    cache = LatentCache.create(num_pages, page_size, dtype=dtype, num_layers=num_layers)
    scale = None if cache.scale is None else jnp.full_like(cache.scale, POISON_SCALE)
    return LatentCache(jnp.full_like(cache.latent, POISON_LATENT), scale, jnp.full_like(cache.rope, POISON_LATENT))


def _tokens(rng, t, dtype=jnp.bfloat16):
    """Fresh latents with outlier tokens, an all-zero token and a wide-range RoPE part."""
    latent = rng.standard_normal((t, 512)) * rng.uniform(0.01, 3.0, (t, 1))
    latent[rng.integers(0, t)] *= 1000.0  # an outlier token: its own scale, others unaffected
    latent[rng.integers(0, t), rng.integers(0, 512)] = 250.0  # a single outlier channel
    latent[rng.integers(0, t)] = 0.0  # all-zero token: scale floor, no NaN
    rope = rng.standard_normal((t, 64)) * 40.0
    return jnp.asarray(latent, dtype), jnp.asarray(rope, dtype)


def _slots(rng, t, num_slots, n_pad=3):
    """Distinct slots scattered over pages (partial pages), with -1 padding entries."""
    slots = rng.choice(num_slots, t, replace=False).astype(np.int32)
    slots[rng.choice(t, n_pad, replace=False)] = -1
    return jnp.asarray(slots)


def _np(a):
    return np.asarray(a.astype(jnp.float32) if a.dtype == jnp.float8_e4m3fn else a)


def _assert_same_bytes(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def _flat(dtype, num_pages=5, page_size=16, num_layers=None):
    return _flat_arrays(_poisoned(dtype, num_pages, page_size, num_layers))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("t", [1, 37])  # one token; several blocks with a ragged last one
def test_interpret_kernel_writes_the_same_bytes_as_reference(dtype, t):
    rng = np.random.default_rng(t)
    latent, rope = _tokens(rng, t)
    slots = _slots(rng, t, 80, n_pad=min(3, t - 1))
    ref = write_kv(_poisoned(dtype), latent, rope, slots, backend="xla")
    out = write_kv(_poisoned(dtype), latent, rope, slots, backend="interpret")
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# Token counts against the CTA's block (config): one token, a block less one, a block, a block
# and one (the last block's window overlaps the first), several blocks with a ragged last one.
@pytest.mark.parametrize("t", [1, 31, 32, 33, 70])
@pytest.mark.parametrize("config", [WriteKVConfig(), WriteKVConfig(block_tokens=64, group_rows=16),
                                    WriteKVConfig(stores_by_warps=False)])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_kernel_matches_reference_for_token_counts_around_the_block(t, config, dtype):
    rng = np.random.default_rng(t)
    latent, rope = _tokens(rng, t)
    rows = _slots(rng, t, 80, n_pad=min(3, t - 1))
    got = write_kv_pallas(_flat(dtype), latent, rope, rows, interpret=True, config=config)
    _assert_same_bytes(got, write_kv_reference(_flat(dtype), latent, rope, rows))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.float16])
def test_kernel_converts_float32_and_float16_inputs_like_the_reference(dtype, in_dtype):
    # float32: amax and x / s of the unrounded values; float16 passes through float32 exactly.
    rng = np.random.default_rng(3)
    latent, rope = _tokens(rng, 37, dtype=jnp.float32)
    latent, rope = latent.astype(in_dtype), (rope / 8).astype(in_dtype)  # RoPE within float16's range
    rows = _slots(rng, 37, 80)
    got = write_kv_pallas(_flat(dtype), latent, rope, rows, interpret=True)
    _assert_same_bytes(got, write_kv_reference(_flat(dtype), latent, rope, rows))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_all_rows_minus_one_write_nothing(dtype):
    latent, rope = _tokens(np.random.default_rng(4), 40)
    got = write_kv_pallas(_flat(dtype), latent, rope, jnp.full((40,), -1, jnp.int32), interpret=True)
    _assert_same_bytes(got, _flat(dtype))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_rows_at_the_last_slot_of_the_last_layer_are_written(dtype):
    # The flat arrays' last rows: the end of every cache array, no store past it.
    latent, rope = _tokens(np.random.default_rng(8), 3)
    before = _poisoned(dtype, num_layers=3)
    slots = jnp.array([79, 0, 78], jnp.int32)
    got = write_kv(before, latent, rope, slots, layer=2, backend="interpret")
    _assert_same_bytes(got, write_kv(before, latent, rope, slots, layer=2, backend="xla"))


def test_outlier_and_zero_tokens_keep_their_own_scales():
    latent = np.random.default_rng(9).standard_normal((6, 512)).astype(np.float32)
    latent[1] *= 1e4  # an outlier token
    latent[2] = 0.0  # all zeros: the floor scale, zeros stored
    latent[3, 7] = -3e4  # one outlier channel
    latent[4] = 1e-30  # amax at the floor
    latent = jnp.asarray(latent, jnp.bfloat16)
    rope = jnp.full((6, 64), 300.0, jnp.bfloat16)
    rows = jnp.arange(6, dtype=jnp.int32)
    got = write_kv_pallas(_flat("fp8"), latent, rope, rows, interpret=True)
    want = write_kv_reference(_flat("fp8"), latent, rope, rows)
    _assert_same_bytes(got, want)
    scale = np.asarray(got[1])[:6]
    assert np.all(np.asarray(got[0].astype(jnp.float32))[2] == 0)
    assert scale[2] == np.float32(1e-30) * FP8_E4M3_MAX_RECIPROCAL
    assert np.all(np.isfinite(np.asarray(got[0].astype(jnp.float32))[:6]))
    assert scale[1] > 1e3 * scale[0]


def test_widths_the_kernel_does_not_take_run_the_xla_scatter():
    # kv_lora_rank 16, rope_dim 8 (tiny test models): write_kv writes the reference's bytes under
    # every backend; the kernel itself refuses them by name.
    cache = LatentCache.create(2, 16, kv_lora_rank=16, rope_dim=8)
    latent, rope = jnp.ones((3, 16), jnp.float32), jnp.ones((3, 8), jnp.float32)
    slots = jnp.array([0, 5, -1], jnp.int32)
    _assert_same_bytes(write_kv(cache, latent, rope, slots, backend="interpret"),
                       write_kv(cache, latent, rope, slots, backend="xla"))
    with pytest.raises(ValueError, match="multiples of 64"):
        write_kv_pallas(_flat_arrays(cache), latent, rope, slots)


@pytest.mark.parametrize("config", [dict(block_tokens=0), dict(block_tokens=48), dict(group_rows=6),
                                    dict(block_tokens=32, group_rows=64)])
def test_config_rejects_blocks_the_kernel_cannot_launch(config):
    with pytest.raises(ValueError, match="block_tokens|group_rows"):
        WriteKVConfig(**config)


@pytest.mark.parametrize("dtype, in_dtype, t", [("fp8", jnp.bfloat16, 4103), ("fp8", jnp.float32, 5),
                                                ("bf16", jnp.bfloat16, 1), ("bf16", jnp.float32, 70)])
def test_compiled_kernel_lowers_for_cuda(dtype, in_dtype, t):
    """Lowering on the CPU: layouts, SMEM, TMA copies; the cache arrays aliased to the outputs."""
    arrays = jax.eval_shape(lambda: _flat_arrays(LatentCache.create(64 * 2, 64, dtype=dtype)))
    tokens = (jax.ShapeDtypeStruct((t, 512), in_dtype), jax.ShapeDtypeStruct((t, 64), in_dtype),
              jax.ShapeDtypeStruct((t,), jnp.int32))
    lowered = lower_for_cuda(write_kv_pallas, arrays, *tokens)
    [module] = mosaic_module_texts(lowered)
    # Whole-row bulk copies in both directions, no tensor maps.
    assert "cp.async.bulk.global.shared::cta.bulk_group" in module
    assert "cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes" in module
    assert "cp.async.bulk.tensor" not in module
    assert ("cvt.rn.satfinite.e4m3x2.f32" in module) == (dtype == "fp8")
    assert lowered.as_text().count("output_operand_alias<") == len(arrays)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_fp8_write_is_within_half_an_e4m3_ulp_of_float64(backend):
    rng = np.random.default_rng(7)
    latent, rope = _tokens(rng, 40, dtype=jnp.float32)
    slots = _slots(rng, 40, 80)
    cache = write_kv(_poisoned("fp8"), latent, rope, slots, backend=backend)
    deq_latent, deq_rope = dequantize(cache)
    x = np.asarray(latent, np.float64)
    keep = np.asarray(slots) >= 0
    s = np.asarray(slots)[keep]
    got = np.asarray(deq_latent, np.float64).reshape(80, 512)[s]
    x = x[keep]
    amax = np.abs(x).max(-1)
    scale64 = np.maximum(amax, 1e-30) / 448.0
    stored_scale = np.asarray(cache.scale).reshape(80)[s]
    # The float32 scale is the float64 one rounded once (2**-24 relative).
    np.testing.assert_allclose(stored_scale, scale64, rtol=2**-23)
    # e4m3 spacing at |v| (in units of the scale): 2**(floor(log2|v|) - 3) for
    # normal values (|v| >= 2**-6), 2**-9 below; rounding errs by half of it,
    # plus float32 roundings of x / s and q * s (a few 2**-24 relative).
    v = np.abs(x) / stored_scale[:, None]
    ulp = np.where(v >= 2**-6, 2.0 ** (np.floor(np.log2(np.maximum(v, 2**-6))) - 3), 2.0**-9)
    bound = (0.5 * ulp + v * 2**-22) * stored_scale[:, None]
    assert np.all(np.abs(got - x) <= bound)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(np.asarray(deq_rope).reshape(80, 64)[s],
                                  np.asarray(rope).astype(ml_dtypes.bfloat16).astype(np.float32)[keep])


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_saturates_at_448_and_zero_token_gets_floor_scale(backend):
    latent = jnp.zeros((2, 512), jnp.float32).at[0].set(jnp.linspace(-5.0, 7.0, 512)).at[1].set(0.0)
    rope = jnp.ones((2, 64), jnp.float32)
    cache = write_kv(_poisoned("fp8", num_pages=1), latent, rope, jnp.array([3, 4], jnp.int32), backend=backend)
    q = np.asarray(cache.latent.astype(jnp.float32))[0]
    assert q[3].max() == 448.0 and q[3].min() == pytest.approx(-5.0 / 7.0 * 448.0, rel=2**-3)
    assert np.all(q[4] == 0.0) and np.asarray(cache.scale)[0, 4] == np.float32(1e-30) / np.float32(448.0)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_only_named_slots_of_the_named_layer_change(dtype, backend):
    rng = np.random.default_rng(11)
    latent, rope = _tokens(rng, 21)
    slots = _slots(rng, 21, 80)
    before = _poisoned(dtype, num_layers=3)
    after = write_kv(before, latent, rope, slots, layer=1, backend=backend)
    written = np.zeros((3, 80), bool)
    written[1, np.asarray(slots)[np.asarray(slots) >= 0]] = True
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
        a = _np(a).reshape(3, 80, -1)
        b = _np(b).reshape(3, 80, -1)
        np.testing.assert_array_equal(a[~written], b[~written])
        assert (a[written] != b[written]).any(-1).all()  # every named row was written


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_traced_layer_under_jit_with_donated_cache(backend):
    rng = np.random.default_rng(5)
    latent, rope = _tokens(rng, 9)
    slots = _slots(rng, 9, 80, n_pad=1)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, layer):
        return write_kv(cache, latent, rope, slots, layer=layer, backend=backend)

    got = step(_poisoned("fp8", num_layers=2), jnp.int32(1))
    want = write_kv(_poisoned("fp8", num_layers=2), latent, rope, slots, layer=1, backend="xla")
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_traced_out_of_range_layer_writes_nothing():
    rng = np.random.default_rng(6)
    latent, rope = _tokens(rng, 4)
    before = _poisoned("fp8", num_layers=2)
    after = jax.jit(lambda c, l: write_kv(c, latent, rope, jnp.arange(4, dtype=jnp.int32), layer=l,
                                          backend="interpret"))(before, jnp.int32(2))
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(_np(a), _np(b))


@pytest.mark.parametrize("change, name", [
    (dict(latent=np.ones((4, 256))), "latent"),
    (dict(latent=np.ones((4,))), "latent"),
    (dict(k_rope=np.ones((4, 32))), "k_rope"),
    (dict(k_rope=np.ones((3, 64))), "k_rope"),
    (dict(slot_mapping=np.arange(4, dtype=np.float32)), "slot_mapping"),
    (dict(slot_mapping=np.arange(5, dtype=np.int32)), "slot_mapping"),
    (dict(slot_mapping=np.array([0, 1, 2, 80], np.int32)), "slot_mapping"),
    (dict(slot_mapping=np.array([0, -2, 1, 2], np.int32)), "slot_mapping"),
    (dict(latent=np.ones((4, 512), np.int32)), "latent"),
    (dict(layer=0), "layer"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_raises_value_error_naming_the_argument(change, name):
    args = dict(latent=np.ones((4, 512), np.float32), k_rope=np.ones((4, 64), np.float32),
                slot_mapping=np.arange(4, dtype=np.int32), layer=None, backend="xla")
    args.update(change)
    with pytest.raises(ValueError, match=name):
        write_kv(_poisoned("fp8"), jnp.asarray(args["latent"]), jnp.asarray(args["k_rope"]),
                 jnp.asarray(args["slot_mapping"]), layer=args["layer"], backend=args["backend"])


@pytest.mark.parametrize("dtype", [np.int64, np.uint16, np.int16])
def test_other_integer_slot_ids_are_converted(dtype):
    # np.arange gives int64: the same bytes as int32 ids, eagerly and under jit.
    latent, rope = jnp.ones((4, 512), jnp.float32), jnp.ones((4, 64), jnp.float32)
    want = write_kv(_poisoned("fp8"), latent, rope, jnp.arange(4, dtype=jnp.int32), backend="xla")
    got = write_kv(_poisoned("fp8"), latent, rope, np.arange(4).astype(dtype), backend="xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(_np(a), _np(b))
    traced = jax.jit(lambda c, s: write_kv(c, latent, rope, s, backend="xla"))(_poisoned("fp8"),
                                                                                 jnp.arange(4, dtype=jnp.int16))
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(want)):
        np.testing.assert_array_equal(_np(a), _np(b))


@pytest.mark.parametrize("slots, message", [
    (np.array([0, 1, 2, 2**40]), r"slot_mapping: expected slots in \[-1, \d+\) .* got 1099511627776 at index 3"),
    (np.array([0, 1, 2, -2]), r"slot_mapping: expected slots in"),
    (np.arange(4, dtype=np.float64), r"slot_mapping: expected integer slot ids"),
    (np.array([True, False, True, False]), r"slot_mapping: expected integer slot ids"),
])
def test_int64_slot_ids_are_range_checked_before_conversion_and_floats_refused(slots, message):
    with pytest.raises(ValueError, match=message):
        write_kv(_poisoned("fp8"), jnp.ones((4, 512), jnp.float32), jnp.ones((4, 64), jnp.float32), slots,
                 backend="xla")


def test_layered_cache_rejects_missing_or_out_of_range_layer():
    cache = _poisoned("bf16", num_layers=2)
    latent, rope = jnp.ones((1, 512)), jnp.ones((1, 64))
    slot = jnp.zeros((1,), jnp.int32)
    for layer in (None, 2, -1):
        with pytest.raises(ValueError, match="layer"):
            write_kv(cache, latent, rope, slot, layer=layer, backend="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("t", [1, 37, 1000, 4096 + 5])
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_kernel_writes_the_same_bytes_as_the_xla_path(dtype, t, in_dtype):
    rng = np.random.default_rng(t)
    latent, rope = _tokens(rng, t, dtype=in_dtype)
    slots = _slots(rng, t, 128 * 64, n_pad=min(50, t - 1))
    make = lambda: _poisoned(dtype, num_pages=128, page_size=64, num_layers=2)
    gpu = write_kv(make(), latent, rope, slots, layer=1, backend="pallas")
    _assert_same_bytes(gpu, write_kv(make(), latent, rope, slots, layer=1, backend="xla"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_compiled_kernel_matches_interpret_bytes(dtype):
    rng = np.random.default_rng(99)
    latent, rope = _tokens(rng, 1000)
    slots = _slots(rng, 1000, 64 * 64, n_pad=50)
    make = lambda: _poisoned(dtype, num_pages=64, page_size=64, num_layers=2)
    gpu = write_kv(make(), latent, rope, slots, layer=1, backend="pallas")
    cpu = jax.device_put(write_kv(jax.device_put(make(), jax.devices("cpu")[0]),
                                  *jax.device_put((latent, rope, slots), jax.devices("cpu")[0]),
                                  layer=1, backend="interpret"), jax.devices("cpu")[0])
    _assert_same_bytes(gpu, cpu)


@pytest.mark.gpu
def test_compiled_kernel_writes_a_donated_cache_in_place():
    rng = np.random.default_rng(12)
    latent, rope = _tokens(rng, 300)
    slots = _slots(rng, 300, 64 * 64)
    cache = _poisoned("fp8", num_pages=64, page_size=64)
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(cache)]
    step = jax.jit(lambda c: write_kv(c, latent, rope, slots, backend="pallas"), donate_argnums=0)
    after = step(cache)
    assert [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(after)] == pointers
