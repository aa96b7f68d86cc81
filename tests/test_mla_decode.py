"""mla_decode: its XLA path (the kernels' math: what runs on CPU, and where no kernel serves a
call) against float64 attention, and the contract every backend shares. The Mosaic kernels
against the same math: tests/test_mla_decode_mgpu*.py.

References are float64 numpy attention over the cache's dequantized contents
(or the original unquantized latent where a test says so). Inputs are random
with per-token magnitudes spread over e^N(0,1) and a few 30x outlier tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import snapmla_jax.decode as decode_module
from snapmla_jax.cache import LatentCache
from snapmla_jax.decode import (ITEM_STEPS, MAX_SPLITS, MERGE_STEPS, choose_num_splits, choose_plan, min_tokens_per_split,
                                mla_decode, mosaic_kernel, planned_num_splits, split_cost, split_overhead, wave_cost)
from snapmla_jax.quantization import AMAX_FLOOR, FP8_E4M3_EPS, FP8_E4M3_MAX, quantize_per_token

RANK, ROPE = 512, 64
SCALE = 1.0 / math.sqrt(RANK + ROPE)  # DeepSeek's 1/sqrt(qk_head_dim)
# The FP8 rounding model: round-to-nearest errs by at most half an ulp, i.e.
# 2**-4 relative for normal e4m3 values and 2**-10 = 2**-4 * 2**-6 absolute for
# subnormals (min normal 2**-6).
HALF_ULP = FP8_E4M3_EPS / 2
FP8_MIN_NORMAL = 2.0**-6
GAMMA = 576 * 2.0**-24  # worst-case relative error of an fp32 sum of 576 products
# fp32 softmax, denominator and accumulation over a few hundred tokens, GPU exp2
# (2 ulp): relative errors ~1e-5; 1e-4 of the output scale covers them with margin.
FP32_SLACK = 1e-4


def make_latent(rng, num_pages, page_size, *, outliers=4, tiny_scale_tokens=0):
    """Random latent [P, S, 512] f32 (bf16-representable) and rope [P, S, 64]."""
    shape = (num_pages, page_size)
    mag = np.exp(rng.normal(size=(*shape, 1)))
    flat = mag.reshape(-1)
    flat[rng.choice(flat.size, outliers, replace=False)] *= 30.0
    latent = rng.normal(size=(*shape, RANK)) * mag
    rope = rng.normal(size=(*shape, ROPE)) * 2.0
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    return bf(latent), bf(rope)


def make_cache(latent, rope, dtype):
    if dtype == "fp8":
        q, scale = quantize_per_token(jnp.asarray(latent))
        return LatentCache(latent=q, scale=scale, rope=jnp.asarray(rope, jnp.bfloat16))
    return LatentCache(latent=jnp.asarray(latent, jnp.bfloat16), scale=None, rope=jnp.asarray(rope, jnp.bfloat16))


def cache_contents(cache):
    """float64 (latent [P, S, R], rope [P, S, Dr], scale [P, S] or None) as the kernels read them."""
    latent = np.asarray(cache.latent.astype(jnp.float32), np.float64)
    scale = None if cache.scale is None else np.asarray(cache.scale, np.float64)
    if scale is not None:
        latent = latent * scale[..., None]
    return latent, np.asarray(cache.rope.astype(jnp.float32), np.float64), scale


def make_queries(rng, batch, s_q, heads):
    """bf16-representable float32 queries (so no input rounding enters the comparison).

    Magnitudes vary per head; scores against ordinary tokens come out O(1) and
    against the outlier tokens O(10), like trained attention with sink tokens.
    """
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    q = bf(0.2 * rng.normal(size=(batch, s_q, heads, RANK)) * np.exp(0.5 * rng.normal(size=(1, 1, heads, 1))))
    return jnp.asarray(q), jnp.asarray(bf(0.2 * rng.normal(size=(batch, s_q, heads, ROPE))))


def scrambled_block_table(rng, batch, pages_per_row, num_pages):
    return jnp.asarray(rng.permutation(num_pages)[: batch * pages_per_row].reshape(batch, pages_per_row), jnp.int32)


def gather_tokens(x, block_table, b):
    """x [P, S, ...] -> the tokens of batch row b in order, [max_pages * S, ...]."""
    pages = np.asarray(block_table)[b]
    return x[pages].reshape(-1, *x.shape[2:])


def attention_f64(q, q_rope, latent, rope, block_table, seq_lens):
    """float64 MLA decode: (out [B, s_q, H, R], lse [B, s_q, H], weights per (b, i) [H, T])."""
    q, q_rope = np.asarray(q, np.float64), np.asarray(q_rope, np.float64)
    batch, s_q, heads, _ = q.shape
    out = np.zeros(q.shape)
    lse = np.full((batch, s_q, heads), -np.inf)
    weights = {}
    for b in range(batch):
        kv, kr = gather_tokens(latent, block_table, b), gather_tokens(rope, block_table, b)
        for i in range(s_q):
            n = int(seq_lens[b]) - s_q + i + 1
            if n <= 0:
                continue
            s = (q[b, i] @ kv[:n].T + q_rope[b, i] @ kr[:n].T) * SCALE
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            w = e / e.sum(axis=1, keepdims=True)
            out[b, i] = w @ kv[:n]
            lse[b, i] = (m[:, 0] + np.log(e.sum(axis=1)))
            weights[b, i] = w
    return out, lse, weights


def fp8_error_bound(q, q_rope, cache, block_table, seq_lens):
    """Elementwise bound [B, s_q, H, R] on |FP8 kernel - float64 attention on the dequantized cache|.

    Q rounding is deterministic (one scale per row, round to nearest), so its
    effect on score t is known: d_t = SCALE * (q_hat - q) . x_t, to which fp32
    accumulation adds <= GAMMA * SCALE * (|q|.|x_t| + |q_r|.|k_r,t|). Logits moved
    by eps_t change weight t by a factor in [e**-eps_t / Z+, e**(eps_t + eps_bar)]
    (Z+ = sum_u w_u e**eps_u, eps_bar = sum_u w_u eps_u, by Jensen), i.e. by a
    relative delta_t. P' rounding: each block's row is scaled so its max is 448,
    so a term w'_t s_t v_tj errs by at most 2**-4 * max(w'_t s_t, 2**-6 / 448 *
    max_u w'_u s_u) * |v_tj| (normal vs subnormal e4m3).
    Sum: |err_j| <= sum_t w_t delta_t |x_tj| + P' terms.
    """
    latent, rope, scale = cache_contents(cache)
    stored = np.asarray(cache.latent.astype(jnp.float32), np.float64)
    q32, qr64 = np.asarray(q, np.float32), np.asarray(q_rope, np.float64)
    q64 = q32.astype(np.float64)
    q_scale = np.maximum(np.abs(q32).max(axis=-1), AMAX_FLOOR) / np.float32(FP8_E4M3_MAX)
    q_hat = (q32 / q_scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * q_scale[..., None]
    _, _, weights = attention_f64(q, q_rope, latent, rope, block_table, seq_lens)
    bound = np.zeros(q64.shape)
    for (b, i), w in weights.items():
        n = w.shape[1]
        x, v = gather_tokens(latent, block_table, b)[:n], gather_tokens(stored, block_table, b)[:n]
        s_t, kr = gather_tokens(scale, block_table, b)[:n], gather_tokens(rope, block_table, b)[:n]
        eps = SCALE * (np.abs((q_hat[b, i] - q64[b, i]) @ x.T)
                       + GAMMA * (np.abs(q64[b, i]) @ np.abs(x).T + np.abs(qr64[b, i]) @ np.abs(kr).T))
        eps_bar = (w * eps).sum(axis=1, keepdims=True)
        z_plus = (w * np.exp(eps)).sum(axis=1, keepdims=True)
        delta = np.maximum(np.exp(eps + eps_bar) - 1, 1 - np.exp(-eps) / z_plus)
        w_hi = w * (1 + delta)
        subnormal = (w_hi * s_t).max(axis=1, keepdims=True) * FP8_MIN_NORMAL / FP8_E4M3_MAX * np.abs(v).sum(axis=0)
        bound[b, i] = ((w * delta) @ np.abs(x) + HALF_ULP * (w_hi @ np.abs(x) + subnormal)
                       + FP32_SLACK * (w @ np.abs(x)))
    return bound


def run(q, q_rope, cache, block_table, seq_lens, backend="xla", **kw):
    return mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=SCALE, backend=backend,
                      return_lse=True, **kw)


def rel_err(out, ref):
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


def norm_rel_err(out, ref):
    """Relative L2 (Frobenius) error of the whole output."""
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def paged_setup():
    """B=3 rows, ragged lengths (one partial page), pages scrambled, page_size 16."""
    rng = np.random.default_rng(0)
    latent, rope = make_latent(rng, 24, 16)
    block_table = scrambled_block_table(rng, 3, 7, 24)
    seq_lens = jnp.asarray([100, 37, 112], jnp.int32)
    q, q_rope = make_queries(rng, 3, 1, 16)
    return latent, rope, block_table, seq_lens, q, q_rope


# ---------------------------------------------------------------- numerics

def test_bf16_twin_matches_float64_reference(paged_setup):
    latent, rope, block_table, seq_lens, q, q_rope = paged_setup
    cache = make_cache(latent, rope, "bf16")
    out, lse = run(q, q_rope, cache, block_table, seq_lens)
    ref, ref_lse, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    # Q and P are rounded to bf16 (2**-9 relative each) and scores of size ~10
    # move by ~2**-9 * 10: a few 1e-3 of the output scale; 1e-2 is the bound.
    assert rel_err(out, ref) <= 1e-2
    np.testing.assert_allclose(lse, ref_lse, atol=2e-2)  # score error 2**-9 * |s| for |s| <~ 10


def test_fp8_kernel_within_rounding_bound(paged_setup):
    latent, rope, block_table, seq_lens, q, q_rope = paged_setup
    cache = make_cache(latent, rope, "fp8")
    out, _ = run(q, q_rope, cache, block_table, seq_lens)
    ref, _, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    bound = fp8_error_bound(q, q_rope, cache, block_table, seq_lens)
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= bound), f"worst err/bound {np.max(err / bound):.3g}"
    # The bound is not vacuous: typically a fraction of each output element
    # (measured: median 0.33, and the worst element reaches 0.6 of its bound).
    assert np.median(bound / np.abs(ref)) < 0.5


def test_two_query_terms_take_the_querys_rounding_out_of_the_scores(paged_setup):
    """``query_terms=2`` (the query as its e4m3 rounding plus what that leaves, rounded again) on
    the XLA path, which runs the 16-row kernel's math: every score against float64 attention on
    the same FP8 cache errs by the second rounding alone, so the lse (which a score moves by at
    most its own error) sits within that bound and well below the one-term path's error."""
    latent, rope, block_table, seq_lens, q, q_rope = paged_setup
    cache = make_cache(latent, rope, "fp8")
    contents = cache_contents(cache)
    _, ref_lse, _ = attention_f64(q, q_rope, *contents[:2], block_table, seq_lens)
    errors = {terms: np.abs(np.asarray(run(q, q_rope, cache, block_table, seq_lens, query_terms=terms)[1], np.float64)
                            - ref_lse) for terms in (1, 2)}
    table = np.asarray(block_table)
    keys = contents[0][table].reshape(table.shape[0], -1, RANK)  # [B, T, R] in token order
    rope_keys = contents[1][table].reshape(table.shape[0], -1, ROPE)
    q64, qr64 = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(q_rope, np.float64))
    visible = np.arange(keys.shape[1])[None, :] < np.asarray(seq_lens)[:, None]  # s_q = 1
    # Each feature's second rounding: at most 2^-4 of what the first left (itself at most 2^-4 of
    # the feature, or 2^-10 of the row's scale amax / 448 for a subnormal), plus a subnormal
    # step of the second term's scale: |dq_i| <= 2^-8 |q_i| + 2^-13 max|q| / 448. fp32 sums add
    # GAMMA of the products' magnitudes.
    amax = q64.max(-1, keepdims=True)
    per_token = (np.einsum("bihd,btd->biht", 2.0**-8 * q64 + 2.0**-13 * amax / FP8_E4M3_MAX, np.abs(keys))
                 + GAMMA * (np.einsum("bihd,btd->biht", q64, np.abs(keys))
                            + np.einsum("bihd,btd->biht", qr64, np.abs(rope_keys)))) * SCALE
    bound = np.where(visible[:, None, None, :], per_token, 0.0).max(-1) + FP32_SLACK
    seen = np.asarray(seq_lens) > 0
    assert np.all(errors[2][seen] <= bound[seen]), float(np.max(errors[2][seen] / bound[seen]))
    # Not vacuous: the one-term path's error (2^-4 of each feature) is many times larger.
    assert errors[2][seen].max() * 8 < errors[1][seen].max(), (errors[1].max(), errors[2].max())


def test_fp8_attends_tokens_whose_scales_differ_1000x():
    """Half the tokens are 1000x smaller yet get nearly all the attention (via the
    RoPE scores): without the per-row P' factor their P' would underflow e4m3."""
    rng = np.random.default_rng(1)
    latent, rope = make_latent(rng, 4, 16, outliers=0)
    small = np.arange(64) % 2 == 1
    latent.reshape(64, RANK)[small] *= 1e-3
    q, q_rope = make_queries(rng, 1, 1, 16)
    head0 = np.asarray(q_rope)[0, 0, 0]
    # Aligned with head 0's RoPE query so that their scores are ~ +8 (weights e**8 higher).
    rope.reshape(64, ROPE)[small] = head0 * 8.0 / (SCALE * head0 @ head0)
    rope.reshape(64, ROPE)[~small] = 0.0
    cache = make_cache(latent, rope, "fp8")
    scale = np.asarray(cache.scale).reshape(-1)
    assert np.median(scale[~small]) / np.median(scale[small]) > 300
    block_table = jnp.asarray([[2, 0, 3, 1]], jnp.int32)
    seq_lens = jnp.asarray([64], jnp.int32)
    out, _ = run(q, q_rope, cache, block_table, seq_lens)
    ref, _, weights = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    order = np.asarray(block_table)[0]
    small_tokens = small.reshape(4, 16)[order].reshape(-1)
    assert weights[0, 0][0, small_tokens].sum() > 0.99  # head 0 looks almost only at the small tokens
    bound = fp8_error_bound(q, q_rope, cache, block_table, seq_lens)
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= bound)
    # Head 0's output is made of the small tokens: it must not collapse to 0 or to the large ones.
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], ref[0, 0, 0], rtol=0, atol=0.1 * np.abs(ref[0, 0, 0]).max())


def test_fp8_error_against_bf16_attention_on_unquantized_data(paged_setup):
    latent, rope, block_table, seq_lens, q, q_rope = paged_setup
    out, _ = run(q, q_rope, make_cache(latent, rope, "fp8"), block_table, seq_lens)
    twin, _ = run(q, q_rope, make_cache(latent, rope, "bf16"), block_table, seq_lens)
    ref, _, _ = attention_f64(q, q_rope, latent.astype(np.float64), rope.astype(np.float64), block_table, seq_lens)
    fp8_err, bf16_err = norm_rel_err(out, ref), norm_rel_err(twin, ref)
    print(f"relative L2 error vs float64 on unquantized data: fp8 {fp8_err:.3g}, "
          f"bf16 twin {bf16_err:.3g}")
    # Latent, Q and P' each carry <= 2**-4 relative rounding per element (the
    # cache's own quantization included). Rounding errors of K and Q add up over
    # 512 dims to score errors of ~0.2 on the outlier tokens' O(10) scores, which
    # the softmax turns into weight errors of that relative size: measured 0.075
    # on this outlier-heavy data (bf16 twin 9e-5). 0.1 guards that level.
    assert fp8_err <= 0.1
    assert bf16_err <= 1e-2


# ---------------------------------------------------------------- structure

@pytest.mark.parametrize("page_size", [16, 24, 64, 256])  # 24: what no kernel reads (the XLA path serves it)
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_paged_cache_any_page_size(page_size, dtype):
    rng = np.random.default_rng(page_size)
    num_pages = max(3, 600 // page_size)
    latent, rope = make_latent(rng, num_pages, page_size)
    cache = make_cache(latent, rope, dtype)
    pages_per_row = num_pages // 2
    block_table = scrambled_block_table(rng, 2, pages_per_row, num_pages)
    capacity = pages_per_row * page_size
    seq_lens = jnp.asarray([capacity - page_size // 2 - 1, capacity // 3], jnp.int32)  # partial last pages
    q, q_rope = make_queries(rng, 2, 1, 16)
    out, lse = run(q, q_rope, cache, block_table, seq_lens)
    ref, ref_lse, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    if dtype == "bf16":  # as test_bf16_twin_matches_float64_reference
        assert rel_err(out, ref) <= 1e-2
        np.testing.assert_allclose(lse, ref_lse, atol=2e-2)
    else:  # the lse carries Q's e4m3 rounding, which the output's bound accounts for
        assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= fp8_error_bound(q, q_rope, cache, block_table,
                                                                                    seq_lens))


def test_ragged_seq_lens_and_empty_rows(paged_setup):
    latent, rope, block_table, _, q, q_rope = paged_setup
    cache = make_cache(latent, rope, "bf16")
    seq_lens = jnp.asarray([0, 1, 17], jnp.int32)
    out, lse = run(q, q_rope, cache, block_table, seq_lens)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(lse)[0] == -np.inf)
    ref, ref_lse, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    assert rel_err(out[1:], ref[1:]) <= 1e-2
    np.testing.assert_allclose(lse[1:], ref_lse[1:], atol=2e-2)
    # One visible token: the output is that token's latent (bf16 output rounding 2**-9).
    first = gather_tokens(cache_contents(cache)[0], block_table, 1)[0]
    np.testing.assert_allclose(np.asarray(out)[1, 0], np.broadcast_to(first, (16, RANK)), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("s_q", [2, 4])
def test_multi_token_queries_are_causal(s_q):
    rng = np.random.default_rng(10 + s_q)
    latent, rope = make_latent(rng, 12, 16)
    cache = make_cache(latent, rope, "bf16")
    block_table = scrambled_block_table(rng, 2, 6, 12)
    seq_lens = jnp.asarray([90, s_q + 3], jnp.int32)
    q, q_rope = make_queries(rng, 2, s_q, 16)
    out, lse = run(q, q_rope, cache, block_table, seq_lens)
    ref, ref_lse, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    assert rel_err(out, ref) <= 1e-2
    np.testing.assert_allclose(lse, ref_lse, atol=2e-2)
    # The attention of query i must not depend on tokens after seq_len - s_q + i.
    assert not np.allclose(np.asarray(out)[:, 0], np.asarray(out)[:, -1], atol=1e-2)


@pytest.mark.parametrize("heads,s_q", [(20, 1), (6, 2)])
def test_head_counts_and_query_lengths_of_any_size(heads, s_q):
    rng = np.random.default_rng(heads)
    latent, rope = make_latent(rng, 8, 16)
    cache = make_cache(latent, rope, "fp8")
    block_table = scrambled_block_table(rng, 2, 4, 8)
    seq_lens = jnp.asarray([60, 33], jnp.int32)
    q, q_rope = make_queries(rng, 2, s_q, heads)
    out, _ = run(q, q_rope, cache, block_table, seq_lens)
    ref, _, _ = attention_f64(q, q_rope, *cache_contents(cache)[:2], block_table, seq_lens)
    bound = fp8_error_bound(q, q_rope, cache, block_table, seq_lens)
    assert out.shape == (2, s_q, heads, RANK)
    assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= bound)


def test_layered_cache_selects_layer_by_offset():
    rng = np.random.default_rng(5)
    layers = [make_latent(rng, 6, 16) for _ in range(3)]
    caches = [make_cache(lat, rope, "fp8") for lat, rope in layers]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *caches)
    block_table = scrambled_block_table(rng, 2, 3, 6)
    seq_lens = jnp.asarray([40, 21], jnp.int32)
    q, q_rope = make_queries(rng, 2, 1, 16)
    want, _ = run(q, q_rope, caches[2], block_table, seq_lens)
    got, _ = run(q, q_rope, stacked, block_table, seq_lens, layer=2)
    np.testing.assert_array_equal(got, want)
    traced = jax.jit(lambda layer: run(q, q_rope, stacked, block_table, seq_lens, layer=layer))
    # Jitted whole, XLA fuses the sums otherwise than eagerly: float32 order (2**-24 a term).
    np.testing.assert_allclose(traced(jnp.int32(2))[0], want, rtol=0, atol=1e-5 * np.abs(np.asarray(want)).max())
    out, lse = traced(jnp.int32(7))  # out of range when traced: nothing visible
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)


def out_of_range_inputs(rng, page_size, *, num_pages=10, heads=16, s_q=2):
    """A 2-layer fp8/bf16-agnostic problem whose block table and seq_lens are out of range
    (pages num_pages + 3, -5 and 10**6; a seq_len 40 past the table's capacity), and the
    same inputs clipped as the backends clip traced ones. Returns (latents, ropes, bad
    (block_table, seq_lens), clipped (block_table, seq_lens), q, q_rope)."""
    layers = [make_latent(rng, num_pages, page_size) for _ in range(2)]
    block_table = np.array(scrambled_block_table(rng, 3, 3, num_pages))
    block_table[0, 1], block_table[1, 0], block_table[2, 2] = num_pages + 3, -5, 10**6
    capacity = 3 * page_size
    seq_lens = np.asarray([capacity - 5, 2 * page_size, capacity + 40], np.int32)
    clipped = (jnp.asarray(np.clip(block_table, 0, num_pages - 1)), jnp.asarray(np.clip(seq_lens, 0, capacity)))
    q, q_rope = make_queries(rng, 3, s_q, heads)
    return layers, (jnp.asarray(block_table), jnp.asarray(seq_lens)), clipped, q, q_rope


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("page_size", [64, 24])
def test_traced_out_of_range_pages_and_lengths_read_what_clipped_ones_read(dtype, page_size):
    """Under jit a block table and seq_lens cannot be validated. Every backend then clips page ids
    into [0, num_pages) of the selected layer and seq_lens into the table's capacity, so no read
    leaves the cache and a bad row gets the output of its clipped input (bit for bit). Layer 0 of
    two, so that an unclipped page past the end would read layer 1 and differ. The XLA path here;
    the Mosaic kernels in tests/test_mla_decode_mgpu.py (``_clip_check``)."""
    rng = np.random.default_rng(page_size + 1)
    layers, bad, clipped, q, q_rope = out_of_range_inputs(rng, page_size)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[make_cache(lat, rope, dtype) for lat, rope in layers])
    traced = jax.jit(lambda bt, lens: run(q, q_rope, stacked, bt, lens, layer=0))
    got, got_lse = traced(*bad)
    want, want_lse = traced(*clipped)  # one program for both (XLA may sum differently in another)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_lse, want_lse)
    with pytest.raises(ValueError, match="block_table"):  # concrete inputs are refused instead
        run(q, q_rope, stacked, bad[0], clipped[1], layer=0)


def test_xla_backend_is_the_cpu_default_and_lse_is_optional(paged_setup):
    latent, rope, block_table, seq_lens, q, q_rope = paged_setup
    cache = make_cache(latent, rope, "fp8")
    auto = mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=SCALE)
    xla, _ = run(q, q_rope, cache, block_table, seq_lens, backend="xla")
    np.testing.assert_array_equal(auto, xla)


def test_split_heuristic_fills_the_gpu_down_to_one_step_a_split():
    step = min_tokens_per_split("fp8")
    assert step == 128 and min_tokens_per_split("bf16") == 64  # the Mosaic twins' step: one page
    # Their fixed costs count twice in one-page steps: one-page items where B x ctx is small (the
    # counts measured faster), the 128-token counts where whole waves are full anyway.
    twin = functools.partial(choose_num_splits, num_sms=132, min_tokens=64,
                             overhead=split_overhead("bf16"))
    assert split_overhead("fp8") == 1.0 and split_overhead("bf16") == 2.0
    assert twin(batch=1, row_blocks=1, max_tokens=1024) == 16 and twin(batch=2, row_blocks=1, max_tokens=2048) == 32
    assert twin(batch=32, row_blocks=2, max_tokens=16384) == 2 and twin(batch=128, row_blocks=2, max_tokens=16384) == 1
    plan = functools.partial(choose_num_splits, num_sms=132, min_tokens=step)
    assert plan(batch=128, row_blocks=2, max_tokens=16384) == 1  # 256 CTAs: two full waves
    assert plan(batch=66, row_blocks=2, max_tokens=16384) == 1  # one full wave
    assert plan(batch=8, row_blocks=2, max_tokens=16384) == 8
    assert plan(batch=1, row_blocks=1, max_tokens=65536) == MAX_SPLITS == 128  # the cap
    assert plan(batch=1, row_blocks=2, max_tokens=4096) == 32  # one step a split
    assert plan(batch=1, row_blocks=1, max_tokens=100) == 1
    # 80 CTAs of 32 steps leave 52 SMs idle; 240 CTAs of 11 steps fill two waves.
    assert plan(batch=40, row_blocks=2, max_tokens=4096) == 3


@pytest.mark.parametrize("row_blocks, max_tokens", [(2, 16384), (1, 32768), (2, 65536)])
def test_split_count_has_no_cliff_past_a_wave(row_blocks, max_tokens):
    """At long contexts a batch one row past a wave of CTAs (B=67 at two row blocks) does not cost
    a second wave as long as the first: at every batch size the modelled time stays within 1.35x
    of the work divided over the SMs plus an item's and the merge's fixed costs (unsplit, one row
    past a wave costs ~2x), and no other split count models faster."""
    steps = max_tokens // 128
    for batch in range(1, 257):
        splits = choose_num_splits(batch, row_blocks, max_tokens, 132, 128)
        ideal = batch * row_blocks * steps / 132 + ITEM_STEPS + MERGE_STEPS
        assert split_cost(batch, row_blocks, steps, splits, 132) <= 1.35 * max(ideal, steps / MAX_SPLITS + 4), batch
        assert split_cost(batch, row_blocks, steps, splits, 132) == min(
            split_cost(batch, row_blocks, steps, s, 132) for s in range(1, min(MAX_SPLITS, steps) + 1))
    wave = 132 // row_blocks
    one_more = wave + 1
    assert split_cost(one_more, row_blocks, steps, 1, 132) > 1.9 * split_cost(wave, row_blocks, steps, 1, 132)
    chosen = choose_num_splits(one_more, row_blocks, max_tokens, 132, 128)
    assert split_cost(one_more, row_blocks, steps, chosen, 132) < 1.4 * split_cost(wave, row_blocks, steps, 1, 132)


def test_wave_plan_is_chosen_past_a_wave_of_rows_and_not_at_one():
    """H = 128 x 16k on 132 SMs (two row blocks an item, 66 items a wave): at whole waves of rows
    (B = 64, 66, 128, 132) the split plan models as fast and stays; one row past them, and at
    batches whose items leave part of a wave idle, the wave plan models faster (within the item
    and merge costs of the batch's share, where whole waves of split items lose up to 1.3x)."""
    plan = lambda batch: choose_plan(batch, 2, 16384, 132, 128)
    for batch in (32, 64, 66, 128, 132):
        assert plan(batch)[1] == 0, batch
    for batch in (67, 72, 100, 140, 200):
        splits, segments = plan(batch)
        assert segments == 66, batch
        share = batch * 2 * 128 / 132
        assert wave_cost(batch, 2, 128, 132) < 1.1 * share + 12, batch
        assert wave_cost(batch, 2, 128, 132) < split_cost(batch, 2, 128, choose_num_splits(batch, 2, 16384, 132, 128),
                                                          132)
        assert splits == -(-128 // -(-batch * 128 // 66)) + 1  # the items a full row has at most, for the merge
    assert choose_plan(67, 1, 32768, 132, 128)[1] == 132  # 16 heads: one row block, a segment an SM


def test_planned_num_splits_is_what_mla_decode_runs(paged_setup, monkeypatch):
    latent, rope, block_table, seq_lens, q, q_rope = paged_setup
    cache = make_cache(latent, rope, "fp8")
    planned = planned_num_splits(q, cache, block_table)
    block_m = mosaic_kernel(q.shape[1] * q.shape[2], "fp8", q.dtype, block_table.size * cache.page_size)[1]
    assert planned == choose_num_splits(q.shape[0], -(-(q.shape[1] * q.shape[2]) // block_m),
                                        block_table.shape[1] * cache.page_size, 132, 128)
    seen = []
    monkeypatch.setattr(decode_module, "check_interpreter_devices", lambda: None)  # the kernel is faked
    monkeypatch.setattr(decode_module, "mosaic_kernel", lambda *a: (
        lambda q_rows, *args, **kw: seen.append(kw["num_splits"]) or (q_rows, q_rows[..., 0].astype(jnp.float32)),
        block_m))
    mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=SCALE, backend="interpret")
    assert seen == [planned]


# ---------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def small_args():
    rng = np.random.default_rng(3)
    latent, rope = make_latent(rng, 4, 16, outliers=1)
    cache = make_cache(latent, rope, "fp8")
    q, q_rope = make_queries(rng, 2, 1, 4)
    return q, q_rope, cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([20, 32], jnp.int32)


@pytest.mark.parametrize("change,name", [
    (lambda a: {**a, "q_rope": a["q_rope"][:, :, :3]}, "q_rope"),
    (lambda a: {**a, "q_latent": a["q_latent"][..., :256]}, "q_latent"),
    (lambda a: {**a, "q_latent": a["q_latent"].astype(jnp.int32)}, "q_latent"),
    (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.float32)}, "seq_lens"),
    (lambda a: {**a, "seq_lens": jnp.asarray([20, 33], jnp.int32)}, "seq_lens"),  # 33 > 2 pages x 16
    (lambda a: {**a, "block_table": a["block_table"][:1]}, "block_table"),
    (lambda a: {**a, "block_table": a["block_table"].astype(jnp.float32)}, "block_table"),
    (lambda a: {**a, "block_table": jnp.asarray([[0, 1], [2, 9]], jnp.int32)}, "block_table"),  # page 9 of 4
    (lambda a: {**a, "layer": 0}, "layer"),
    (lambda a: {**a, "softmax_scale": -1.0}, "softmax_scale"),
])
def test_bad_input_raises_value_error_naming_the_argument(small_args, change, name):
    q, q_rope, cache, block_table, seq_lens = small_args
    args = dict(q_latent=q, q_rope=q_rope, cache=cache, block_table=block_table, seq_lens=seq_lens,
                softmax_scale=SCALE)
    with pytest.raises(ValueError, match=name):
        mla_decode(**change(args), backend="interpret")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("num_splits", [0, -1, 1.5, True])
def test_num_splits_that_is_not_a_positive_int_is_refused_on_every_backend(small_args, backend, num_splits):
    q, q_rope, cache, block_table, seq_lens = small_args
    with pytest.raises(ValueError, match="num_splits: expected None or a positive int"):
        mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=SCALE, backend=backend,
                   num_splits=num_splits)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("query_terms", [0, 3, 1.0, True])
def test_query_terms_other_than_1_or_2_are_refused_on_every_backend(small_args, backend, query_terms):
    q, q_rope, cache, block_table, seq_lens = small_args
    with pytest.raises(ValueError, match="query_terms: expected 1 or 2"):
        mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=SCALE, backend=backend,
                   query_terms=query_terms)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("qk_promotion", [0, 64, 384, 1024, 128.0, True])
def test_qk_promotion_other_than_128_256_or_512_is_refused_on_every_backend(small_args, backend, qk_promotion):
    q, q_rope, cache, block_table, seq_lens = small_args
    with pytest.raises(ValueError, match=r"qk_promotion: expected None or one of \(128, 256, 512\)"):
        mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=SCALE, backend=backend,
                   qk_promotion=qk_promotion)


@pytest.mark.parametrize("cache_dtype,heads,asked,passed", [
    ("fp8", 4, 128, {"qk_promotion": 128}), ("fp8", 64, 256, {"qk_promotion": 256}), ("fp8", 64, None, {}),
    ("bf16", 4, 128, {})])
def test_mla_decode_hands_qk_promotion_to_the_fp8_kernels_only(monkeypatch, cache_dtype, heads, asked, passed):
    """``qk_promotion`` goes to the FP8 kernel ``mosaic_kernel`` picks (16- or 64-row blocks), as
    given; None leaves the kernel its own, and the BF16 twins, which sum 16-bit products in
    float32, are not asked. Traced (``jax.eval_shape``) with the interpreter's kernels."""
    rng = np.random.default_rng(11)
    latent, rope = make_latent(rng, 4, 64, outliers=1)
    cache = make_cache(latent, rope, cache_dtype)
    q, q_rope = make_queries(rng, 2, 1, heads)
    calls, pick = [], decode_module.mosaic_kernel

    def recording(*args, **kw):
        kernel, rows = pick(*args, **kw)
        return (lambda *a, **k: calls.append({n: k[n] for n in ("qk_promotion",) if n in k}) or kernel(*a, **k)), rows

    monkeypatch.setattr(decode_module, "mosaic_kernel", recording)
    monkeypatch.setattr(decode_module, "check_interpreter_devices", lambda: None)  # traced, not run
    jax.eval_shape(lambda *a: mla_decode(*a, softmax_scale=SCALE, backend="interpret", qk_promotion=asked),
                   q, q_rope, cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([100, 128], jnp.int32))
    assert calls == [passed]


WITHOUT_PALLAS_TRITON = r"""
import importlib, pkgutil, sys
sys.modules["jax.experimental.pallas.triton"] = None  # what a jax without Pallas' Triton backend gives
import snapmla_jax, snapmla_jax.models
names = []
for package in (snapmla_jax, snapmla_jax.models, snapmla_jax.pallas_kernels):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
        names.append(module.name)
print(len(names))
"""


def test_every_module_imports_without_pallas_triton():
    """Pallas' Triton backend is deprecated since jax 0.11 and announced for removal: no module of
    the package, its models or its kernels imports it. Run in a fresh interpreter where that
    module cannot be imported."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", WITHOUT_PALLAS_TRITON], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and int(result.stdout.strip().splitlines()[-1]) > 40, result.stderr[-3000:]
