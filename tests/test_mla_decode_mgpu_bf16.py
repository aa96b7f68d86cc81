"""The BF16 twins on Mosaic GPU (pallas_kernels/mla_decode_mgpu_bf16.py in 64-row blocks,
mla_decode_mgpu_bf16_small.py in 16-row blocks), through ``mla_decode``.

CPU: the kernel lowers for CUDA (layout inference, SMEM within an H100's 227 KB), and the
interpreter runs it against float64 attention over the bf16 cache. The interpreter takes no
wgmma operand from registers and has no pre-initialised accumulators, so there P goes
through SMEM and each step's P.V into a fresh accumulator; the GPU tests (``-m gpu``) run the
same cases compiled, with P in registers and P.V accumulated in place.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import mla_decode_mgpu_bf16
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16_small import mla_decode_mgpu_bf16_small
from snapmla_jax.backend import lower_for_cuda
from snapmla_jax.cache import LatentCache
from snapmla_jax import decode
from snapmla_jax.decode import SMALL_BLOCKS_MAX_TOKENS, mla_decode, mosaic_kernel
from test_mla_decode import SCALE, attention_f64, make_latent, make_queries, rel_err, scrambled_block_table
from test_mla_decode_mgpu import _in_subprocess, _nan_past_seq_lens

PAGE = 64

# (heads, s_q, seq_lens, layer, splits, query dtype): every case has a row of length 0 (or 3) and
# partial pages; masked steps hold NaN past seq_len.
CASES = pytest.mark.parametrize("heads,s_q,seq_lens,layer,splits,dtype", [
    (64, 1, [100, 300, 0], None, 1, "float32"),   # ragged; 5 steps: both ring slots reused
    (128, 1, [129, 64, 1], 1, 1, "float32"),      # two row blocks, a 1-token last step, layer 1 of 2
    (64, 1, [320, 257, 0], None, 3, "float32"),   # split-KV: splits of 2 steps, a 1-token one, empty ones
    (24, 2, [200, 2, 0], None, 1, "float32"),     # s_q = 2 (causal rule), 48 rows padded to 64
    (16, 4, [129, 4, 0], 1, 2, "bfloat16"),       # s_q = 4: masked steps in a row; bf16 queries and output
    # splits None: mla_decode's balanced plan (``split_plan``): the long row in one-step items
    # merged by ``combine_items``, the others one item each written directly, unused items.
    (64, 1, [384, 40, 0], None, None, "float32"),
    (16, 2, [380, 65, 3], 1, None, "bfloat16"),   # 32 rows of a small problem: the 16-row twin, two blocks
    # The 16-row twin (bf16 queries, at most 16 rows a batch row: ``mosaic_kernel``).
    (16, 1, [100, 300, 0], None, 1, "bfloat16"),  # ragged; 5 steps: both ring slots reused
    (8, 2, [200, 2, 0], 1, 1, "bfloat16"),        # s_q = 2 (causal rule), layer 1 of 2
    (16, 1, [320, 257, 0], None, 3, "bfloat16"),  # split-KV: splits of 2 steps, a 1-token one, empty ones
    (4, 4, [129, 4, 0], 1, 2, "bfloat16"),        # s_q = 4: masked steps in a row
    (8, 1, [380, 65, 3], 1, None, "bfloat16"),    # 8 rows padded to 16 in the launch that plans (balanced)
    (16, 1, [384, 40, 0], None, None, "bfloat16"),  # balanced plan from the plan-only launch
])


# Pages of 16 and 32 tokens (several a 64-token step of the twins), each twin: (heads, s_q,
# seq_lens, layer, splits, query dtype, page_size); partial pages, a row of length 0 (or 3).
SMALL_PAGE_CASES = pytest.mark.parametrize("heads,s_q,seq_lens,layer,splits,dtype,page_size", [
    (64, 1, [100, 300, 0], 1, 1, "float32", 16),       # the 64-row twin, layer 1 of 2, 4 pages a step
    (24, 2, [200, 2, 0], None, 3, "float32", 32),      # s_q = 2, split-KV
    (64, 1, [384, 40, 0], None, None, "float32", 16),  # balanced plan, a row at the table's capacity
    (16, 1, [100, 300, 0], 1, 2, "bfloat16", 16),      # the 16-row twin, layer 1, split-KV
    (8, 2, [380, 65, 3], None, None, "bfloat16", 32),  # rows padded in the launch that plans
    (16, 2, [200, 2, 0], 1, 1, "bfloat16", 32),        # 32 rows of a small problem: two 16-row blocks
])


def _layered_bf16_cache(rng, pages: int, layers: int | None, seq_lens, block_table, page_size: int = PAGE):
    """A bf16 LatentCache of ``pages`` pages of ``page_size`` (a layer axis if ``layers``), random
    latent with outlier tokens, NaN in every slot of a row's pages past its seq_len
    (``_nan_past_seq_lens``)."""
    latent, rope = (np.stack(parts)
                    for parts in zip(*(make_latent(rng, pages, page_size) for _ in range(layers or 1))))
    if layers is None:
        latent, rope = latent[0], rope[0]
    latent, _, rope = _nan_past_seq_lens(jnp.asarray(latent, jnp.bfloat16), None, jnp.asarray(rope, jnp.bfloat16),
                                         block_table, seq_lens)
    return LatentCache(latent=latent, scale=None, rope=rope)


def _check(heads, s_q, seq_lens, layer, splits, dtype, backend="interpret", seed=0, page_size=PAGE,
           wave=False) -> list:
    """``mla_decode`` (a Mosaic BF16 twin) over a bf16 cache of ``page_size``-token pages (384
    tokens of table a row) vs float64 attention on the same cache contents. Returns [max error /
    max |ref| over rows that see a token, max lse error, whether rows that see none give out 0
    and lse -inf]. ``wave``: splits None then takes a wave plan (``decode.choose_plan`` made to
    prefer it at any size)."""
    if wave:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decode, "UNIFORM_PLAN_MAX_TOKENS", 0)
            patch.setattr(decode, "WAVE_PLAN_STEPS", -1e9)
            return _check(heads, s_q, seq_lens, layer, splits, dtype, backend, seed, page_size)
    rng = np.random.default_rng(seed)
    batch, pages_per_row = len(seq_lens), 6 * PAGE // page_size
    pages = batch * pages_per_row + 2
    block_table = scrambled_block_table(rng, batch, pages_per_row, pages)
    cache = _layered_bf16_cache(rng, pages, None if layer is None else 2, seq_lens, block_table, page_size)
    q, q_rope = make_queries(rng, batch, s_q, heads)
    q, q_rope = q.astype(dtype), q_rope.astype(dtype)
    lens = jnp.asarray(seq_lens, jnp.int32)
    out, lse = mla_decode(q, q_rope, cache, block_table, lens, softmax_scale=SCALE, layer=layer, backend=backend,
                          return_lse=True, num_splits=splits)
    one = cache.layer_arrays(layer)
    contents = [np.asarray(a.astype(jnp.float32), np.float64) for a in (one.latent, one.rope)]
    ref, ref_lse, _ = attention_f64(np.asarray(q, np.float32), np.asarray(q_rope, np.float32), *contents,
                                    block_table, seq_lens)
    seen = np.isfinite(ref_lse)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    empty_ok = bool(np.all(out[~seen] == 0) and np.all(np.isneginf(lse[~seen])))
    return [rel_err(out[seen], ref[seen]), float(np.max(np.abs(lse[seen] - ref_lse[seen]))), empty_ok]


def _assert_close(err, lse_err, empty_ok, dtype):
    # P is rounded to bf16 (2**-9 relative a weight) before the P.V product, against float64
    # exact attention: a few 1e-4 of the output scale measured with float32 queries; a bf16
    # output adds its own 2**-9 (and with splits its bf16 partials, ``partial_dtype``, as much
    # again: the bf16 split case measured 2.8e-3 with either partials). 2e-3 / 6e-3 leave ~2-3x
    # margin; the bound is 1e-2, and a wrong page, mask or rescale moves outputs by O(1).
    assert err < (2e-3 if dtype == "float32" else 6e-3), err
    assert lse_err < 1e-4, lse_err  # fp32 scores of size ~10, an fp32 log-sum-exp (measured ~3e-6)
    assert empty_ok


@pytest.mark.parametrize("s_q,splits,dtype", [(1, 1, "bfloat16"), (2, 3, "bfloat16"), (1, 1, "float32"),
                                              (1, 2, "float32")])
def test_bf16_kernel_lowers_for_cuda(s_q, splits, dtype):
    """Layout inference, SMEM allocation within an H100's 227 KB, lowering to MLIR, without a GPU."""
    rows, batch = 64, 2
    q = jnp.ones((batch, rows, 512), dtype)
    cache = (jnp.ones((6 * PAGE, 512), jnp.bfloat16), jnp.ones((6 * PAGE, 64), jnp.bfloat16))
    call = lambda q, qr, lat, rope, bt, n: mla_decode_mgpu_bf16(
        q, qr, (lat, rope), bt, n, jnp.zeros((1,), jnp.int32), softmax_scale=0.1, page_size=PAGE, s_q=s_q,
        num_heads=rows // s_q, num_splits=splits)
    lower_for_cuda(call, q, jnp.ones((batch, rows, 64), dtype), *cache, jnp.zeros((batch, 3), jnp.int32),
                   jnp.asarray([100, 0], jnp.int32))


@CASES
def test_bf16_kernel_interpreted_matches_float64(heads, s_q, seq_lens, layer, splits, dtype):
    """Paging, the unmasked and masked loops with NaN past seq_len, s_q > 1, a layer offset,
    split-KV (uniform and balanced plans) and its merge, the ring and both warpgroups on the same
    rows, rows padded in the launch; the 64-row twin and the 16-row one."""
    _assert_close(*_in_subprocess(f"_check({heads}, {s_q}, {seq_lens!r}, {layer!r}, {splits}, {dtype!r})",
                                  module="test_mla_decode_mgpu_bf16"), dtype)


# (heads, s_q, seq_lens, layer, query dtype) under a wave plan: the 64-row twin and the 16-row one.
WAVE_CASES = pytest.mark.parametrize("heads,s_q,seq_lens,layer,dtype", [
    (64, 1, [384, 40, 0], None, "float32"), (8, 2, [380, 65, 3], 1, "bfloat16")])


@WAVE_CASES
def test_bf16_kernels_interpreted_under_a_wave_plan(heads, s_q, seq_lens, layer, dtype):
    """mla_decode's wave plan (``split_plan.wave_plan``): items of one-step segments launched out of
    row order, each taking its own steps, merged."""
    _assert_close(*_in_subprocess(f"_check({heads}, {s_q}, {seq_lens!r}, {layer!r}, None, {dtype!r}, wave=True)",
                                  module="test_mla_decode_mgpu_bf16"), dtype)


@pytest.mark.gpu
@WAVE_CASES
def test_bf16_kernels_under_a_wave_plan(heads, s_q, seq_lens, layer, dtype):
    _assert_close(*_check(heads, s_q, seq_lens, layer, None, dtype, backend="pallas", wave=True), dtype)


@pytest.mark.gpu
@CASES
def test_bf16_kernel_matches_float64(heads, s_q, seq_lens, layer, splits, dtype):
    _assert_close(*_check(heads, s_q, seq_lens, layer, splits, dtype, backend="pallas"), dtype)


@SMALL_PAGE_CASES
def test_bf16_kernels_interpreted_read_pages_of_16_and_32_tokens(heads, s_q, seq_lens, layer, splits, dtype,
                                                                 page_size):
    """Several pages a step (each its own TMA boxes into the slot), the table's columns past its
    end clamped, a layer offset in small pages; both twins."""
    _assert_close(*_in_subprocess(f"_check({heads}, {s_q}, {seq_lens!r}, {layer!r}, {splits}, {dtype!r}, "
                                  f"page_size={page_size})", module="test_mla_decode_mgpu_bf16"), dtype)


@pytest.mark.gpu
@SMALL_PAGE_CASES
def test_bf16_kernels_read_pages_of_16_and_32_tokens(heads, s_q, seq_lens, layer, splits, dtype, page_size):
    _assert_close(*_check(heads, s_q, seq_lens, layer, splits, dtype, backend="pallas", page_size=page_size), dtype)


@pytest.mark.parametrize("page_size", [16, 32])
def test_bf16_kernels_lower_for_cuda_with_small_pages(page_size):
    """Both twins over 16- and 32-token pages: the step's boxes into row slices of the ring's
    slots lower, and the SMEM is as at 64-token pages, without a GPU."""
    batch, pages = 2, 6 * PAGE // page_size
    cache = (jnp.ones((pages * page_size, 512), jnp.bfloat16), jnp.ones((pages * page_size, 64), jnp.bfloat16))
    for kernel, rows in ((mla_decode_mgpu_bf16, 64), (mla_decode_mgpu_bf16_small, 16)):
        q = jnp.ones((batch, rows, 512), jnp.bfloat16)
        call = lambda q, qr, lat, rope, bt, n, kernel=kernel, rows=rows: kernel(
            q, qr, (lat, rope), bt, n, jnp.zeros((1,), jnp.int32), softmax_scale=0.1, page_size=page_size, s_q=1,
            num_heads=rows, num_splits=2, balanced=True)
        lower_for_cuda(call, q, jnp.ones((batch, rows, 64), jnp.bfloat16), *cache,
                       jnp.zeros((batch, pages // 2), jnp.int32), jnp.asarray([100, 0], jnp.int32))


@pytest.mark.parametrize("rows,balanced", [(16, False), (32, True), (8, True)])
def test_bf16_small_kernel_lowers_for_cuda(rows, balanced):
    """The 16-row twin: layout inference (P and the output through transposed stores, V^T and P^T
    as transposed wgmma operands), SMEM within 227 KB, lowering, without a GPU; rows of whole
    blocks (two at 32), or padded in the launch that plans."""
    batch = 2
    q = jnp.ones((batch, rows, 512), jnp.bfloat16)
    cache = (jnp.ones((6 * PAGE, 512), jnp.bfloat16), jnp.ones((6 * PAGE, 64), jnp.bfloat16))
    call = lambda q, qr, lat, rope, bt, n: mla_decode_mgpu_bf16_small(
        q, qr, (lat, rope), bt, n, jnp.zeros((1,), jnp.int32), softmax_scale=0.1, page_size=PAGE, s_q=1,
        num_heads=rows, num_splits=2, balanced=balanced)
    lower_for_cuda(call, q, jnp.ones((batch, rows, 64), jnp.bfloat16), *cache, jnp.zeros((batch, 3), jnp.int32),
                   jnp.asarray([100, 0], jnp.int32))


def test_bf16_cache_routes_to_the_bf16_twins():
    """bf16 queries of at most 16 rows, and 17-32 rows of small problems: the 16-row twin (in two
    blocks past 16); float32 ones (a float32 output) and more rows: the 64-row twin."""
    assert mosaic_kernel(16, "bf16") == mosaic_kernel(1, "bf16") == (mla_decode_mgpu_bf16_small, 16)
    assert mosaic_kernel(16, "bf16", jnp.float32) == mosaic_kernel(17, "bf16") == (mla_decode_mgpu_bf16, 64)
    assert mosaic_kernel(256, "bf16") == (mla_decode_mgpu_bf16, 64)
    small, large = SMALL_BLOCKS_MAX_TOKENS, SMALL_BLOCKS_MAX_TOKENS + 64
    assert mosaic_kernel(32, "bf16", jnp.bfloat16, small) == (mla_decode_mgpu_bf16_small, 16)
    assert mosaic_kernel(17, "bf16", jnp.bfloat16, small) == (mla_decode_mgpu_bf16_small, 16)
    assert mosaic_kernel(32, "bf16", jnp.bfloat16, large) == (mla_decode_mgpu_bf16, 64)
    assert mosaic_kernel(33, "bf16", jnp.bfloat16, small) == (mla_decode_mgpu_bf16, 64)
    assert mosaic_kernel(32, "bf16", jnp.float32, small) == (mla_decode_mgpu_bf16, 64)


def test_small_bf16_problems_lower_to_the_16_row_twin_and_no_triton(monkeypatch):
    """``mla_decode``'s default routing on Hopper (faked), bf16 cache, H = 16: the 16-row twin,
    behind the plan-only launch of a balanced plan at 8 x 4k (32k tokens of capacity), merged on
    Mosaic GPU; nothing lowers through Pallas' Triton backend (what each lowers to, without a GPU)."""
    import snapmla_jax.decode as decode

    monkeypatch.setattr(decode, "_on_hopper", lambda: True)
    monkeypatch.setattr(decode, "resolve_backend", lambda backend: "pallas")  # lowered for CUDA here
    cache = LatentCache.create(8 * 64 + 2, page_size=64, dtype="bf16")
    found = {}
    for batch in (1, 8):
        q, q_rope = jnp.zeros((batch, 1, 16, 512), jnp.bfloat16), jnp.zeros((batch, 1, 16, 64), jnp.bfloat16)
        table = jnp.zeros((batch, 64), jnp.int32)  # 4096 tokens of capacity a row
        call = lambda q, qr, t: decode.mla_decode(q, qr, cache, t, jnp.full((t.shape[0],), 100, jnp.int32),
                                                  softmax_scale=0.1, backend="pallas")
        text = lower_for_cuda(call, q, q_rope, table).as_text()
        found[batch] = ("snapmla_decode_bf16_mgpu_small" in text, "snapmla_split_plan" in text,
                        "triton" in text.lower())
    assert found == {1: (True, False, False), 8: (True, True, False)}, found


def test_bf16_kernel_refuses_what_it_cannot_run():
    q, cache = jnp.ones((1, 64, 512), jnp.bfloat16), (jnp.ones((64, 512), jnp.bfloat16),
                                                       jnp.ones((64, 64), jnp.bfloat16))
    args = (jnp.zeros((1, 1), jnp.int32), jnp.asarray([10], jnp.int32), jnp.zeros((1,), jnp.int32))
    kw = dict(softmax_scale=0.1, s_q=1, num_heads=64)
    with pytest.raises(ValueError, match="page_size 16 or 32 or 64, .* got page_size 48"):
        mla_decode_mgpu_bf16(q, q[..., :64], cache, *args, page_size=48, **kw)
    with pytest.raises(ValueError, match="q_rope_rows: expected shape"):  # rows of q_rows: any (padded inside)
        mla_decode_mgpu_bf16(q[:, :48], q[:, :32, :64], cache, *args, page_size=64, **kw)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode_mgpu_bf16(q, q[..., :64], cache, *args, page_size=64, num_splits=0, **kw)
    small = q[:, :16]
    with pytest.raises(ValueError, match="q_rows: mla_decode_mgpu_bf16_small takes bfloat16"):
        mla_decode_mgpu_bf16_small(small.astype(jnp.float32), small[..., :64], cache, *args, page_size=64, **kw)
    with pytest.raises(ValueError, match="page_size 16 or 32 or 64"):
        mla_decode_mgpu_bf16_small(small, small[..., :64], cache, *args, page_size=8, **kw)
