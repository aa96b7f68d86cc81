"""The block-scaled FP8 GEMM (pallas_kernels/fp8_gemm_mgpu.py) and ``fp8_matmul``'s use of it,
against float64 on fresh random operands with outlier rows and channels; interpreted on CPU,
compiled under ``pytest -m gpu``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.fp8_weights import (KERNEL_MAX_TOKENS, dequantize_weight, fp8_grouped_matmul, fp8_matmul,
                                     quantize_activations, quantize_blocks, tiles_run)
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import (BLOCK, GemmConfig, choose_splits, fp8_gemm_mgpu,
                                                      fp8_grouped_gemm_mgpu, kernel_takes, pad_tokens,
                                                      pipeline_depth, scale_slot_tokens)


def _operands(seed: int, m: int, n: int, k: int):
    """x [m, k] f32 with one outlier row and an outlier channel block; W [n, k] block-FP8."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k))
    x[0] *= 50.0
    x[:, BLOCK:2 * BLOCK] *= 0.01
    w = rng.standard_normal((n, k)) * 0.05
    w[:, :3] *= 40.0
    return jnp.asarray(x, jnp.float32), quantize_blocks(jnp.asarray(w, jnp.float32))


def _quantized_f64(x8, x_scales, w):
    """The kernel's operands as float64: x8 * x_scale, w8 * w_scale."""
    m, k = x8.shape
    xs = np.repeat(np.asarray(x_scales, np.float64).T, BLOCK, axis=1)[:, :k]
    x = np.asarray(x8.astype(jnp.float32), np.float64) * xs
    return x, np.asarray(dequantize_weight(w, jnp.float32), np.float64)


def _activation_rounding_bound(x64, w64, spec, rel_bound):
    """What quantizing x [..., M, K] per row and 128 channels may cost a product ``spec`` with w64,
    plus ``rel_bound`` of the terms' size (the kernel's sums): e4m3 keeps 3 mantissa bits, so a
    normal value rounds by at most 2^-4 of itself, a subnormal one (below 2^-6 of the block's 448
    units) by at most 2^-10 of the block's amax / 448."""
    k = x64.shape[-1]
    scales = np.abs(x64.reshape(*x64.shape[:-1], k // BLOCK, BLOCK)).max(-1) / 448.0
    x_err = 2.0**-4 * np.abs(x64) + 2.0**-10 * np.repeat(scales, BLOCK, axis=-1)
    return np.einsum(spec, x_err, np.abs(w64)) + rel_bound * np.einsum(spec, np.abs(x64), np.abs(w64))


def _check_kernel(m, n, k, config, interpret, rel_bound):
    x, w = _operands(m + n + k, m, n, k)
    x8, x_scales = quantize_activations(x)
    y = fp8_gemm_mgpu(x8, x_scales, w.values, w.scales, config=config, num_sms=4, interpret=interpret)
    xq, wq = _quantized_f64(x8, x_scales, w)
    want = xq @ wq.T
    # Per output, the error is a fraction of sum_k |x_k w_k| (the size of the terms summed).
    size = np.abs(xq) @ np.abs(wq).T
    err = np.abs(np.asarray(y, np.float64) - want)
    assert (err <= rel_bound * size + 1e-30).all(), float((err / (size + 1e-30)).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("m, n, k, config", [
    (16, 192, 512, GemmConfig()),  # 192 rows: the last 128-row scale block cropped
    (32, 64, 1024, GemmConfig(kb_per_step=1, depth=3, splits=4)),  # split K, partials summed
    (64, 128, 768, GemmConfig(kb_per_step=3, depth=2)),
    (48, 128, 384, GemmConfig()),  # one block a step: 48 tokens' scales padded to 64 a slot
])
def test_the_kernel_matches_float64_on_its_quantized_operands(m, n, k, config):
    # Interpreted: float32 sums of each block's 128 products, scaled and added over the blocks:
    # ~(128 + K / 128) roundings of 2^-24 relative to the terms' size; 2^-15 leaves room.
    _check_kernel(m, n, k, config, interpret=True, rel_bound=2.0**-15)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(16, 192, 512), (64, 1024, 7168), (48, 7168, 2048),
                                     (48, 2048, 1408)])  # 48 tokens, one block a step: padded scale slots
def test_the_compiled_kernel_matches_float64_on_its_quantized_operands(m, n, k):
    # Hopper's FP8 wgmma adds each 32-channel slice with ~14 significant bits: four slices a block,
    # then float32: 2^-10 of the terms' size bounds it.
    _check_kernel(m, n, k, GemmConfig(), interpret=False, rel_bound=2.0**-10)


@pytest.mark.parametrize("lead, n", [((1,), 192), ((2,), 192), ((3, 5), 192), ((2, 16), 192), ((3, 50), 256),
                                     ((600,), 128)])
def test_fp8_matmul_through_the_kernel_is_within_the_activation_rounding(lead, n):
    """Rows padded to the kernels' tiles and cut back: up to 64 rows (1, 2, 15, 32) the kernel of
    few tokens (multiples of 16), above (150, 600) the tiled kernel (multiples of 128); one row is
    XLA's where the weight is whole 128-blocks (``fp8_weights.XLA_MAX_ROWS``,
    tests/test_fp8_weights.py), the kernel's for these 192 rows (1.5 blocks). The error
    against float64 x times the dequantized W comes from quantizing x to e4m3 only."""
    k = 512
    rows = int(np.prod(lead))
    assert tiles_run(quantize_blocks(jnp.zeros((n, k))), rows, "interpret") == (rows > 64)
    x, w = _operands(rows, rows, n, k)
    x = x.reshape(*lead, k)
    y = fp8_matmul(x, w, backend="interpret")
    assert y.shape == (*lead, n) and y.dtype == x.dtype
    x64 = np.asarray(x, np.float64).reshape(rows, k)
    w64 = np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    want = x64 @ w64.T
    bound = _activation_rounding_bound(x64, w64, "mk,nk->mn", 2.0**-15)
    err = np.abs(np.asarray(y, np.float64).reshape(rows, n) - want)
    assert (err <= bound).all(), float((err / bound).max())
    # Not XLA's unquantized product: the kernel ran (its activation rounding shows).
    assert not np.array_equal(np.asarray(y), np.asarray(fp8_matmul(x, w, backend="xla")))


def test_fp8_matmul_keeps_xla_where_the_kernel_does_not_take_the_shape():
    x, w = _operands(0, KERNEL_MAX_TOKENS + 8, 192, 256)  # prefill-sized, out not whole 128-blocks
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x, w, backend="interpret")),
                                  np.asarray(fp8_matmul(x, w, backend="xla")))
    x, w = _operands(1, 4, 96, 256)  # N = 96: not whole 64-row tiles
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x, w, backend="interpret")),
                                  np.asarray(fp8_matmul(x, w, backend="xla")))
    assert not kernel_takes(16, 100, 512) and kernel_takes(64, 128, 512) and kernel_takes(128, 128, 384)
    assert not kernel_takes(16, 128, 200)  # K not whole 128-channel blocks
    assert [pad_tokens(m) for m in (1, 16, 17, 64, 65, 200)] == [16, 16, 32, 64, 128, 256]
    # 128-token tiles of 256 channels: 4 slots of 49 KB (the output tile staged in them); 5 would overflow.
    assert pipeline_depth(GemmConfig(), 128, 2, 128) == 4 and pipeline_depth(GemmConfig(), 64, 2, 64) == 4


def _group_operands(seed, groups, matrices, m, n, k):
    """x [groups, m, k] f32 (an outlier row and a quiet channel block in each group), a block-FP8
    stack [matrices, n, k] whose matrices differ in scale by 1000x, and inside each its 128 x 128
    blocks by 100x along K and 25x along N (a scale read from the wrong block shows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((groups, m, k))
    x[:, 0] *= 50.0
    x[:, :, :BLOCK] *= 0.01
    w = rng.standard_normal((matrices, n, k)) * np.geomspace(1e-2, 10.0, matrices)[:, None, None]
    w *= np.repeat(rng.permutation(np.geomspace(0.1, 10.0, k // BLOCK)), BLOCK)
    w *= np.repeat(np.geomspace(0.2, 5.0, -(-n // BLOCK)), BLOCK)[:n, None]
    return jnp.asarray(x, jnp.float32), quantize_blocks(jnp.asarray(w, jnp.float32))


def _quantized_stack_f64(x8, x_scales, w):
    """x8 [G, M, K] with x_scales [G, K / 128, M], and the stack w, as float64."""
    xs = np.repeat(np.swapaxes(np.asarray(x_scales, np.float64), -1, -2), BLOCK, axis=-1)
    return np.asarray(x8.astype(jnp.float32), np.float64) * xs, np.asarray(dequantize_weight(w, jnp.float32), np.float64)


# Each mode of the grouped launch (``fp8_grouped_gemm_mgpu``): (groups of tokens, matrices, M, N, K,
# chosen matrices, summed). 256 tokens: two token tiles; K = 384: one-block pipeline steps.
GROUPED_CASES = [
    ("per-group tokens", 3, 3, 16, 128, 512, None, False),
    ("shared tokens, chosen matrices repeated", 1, 4, 32, 192, 256, [3, 0, 3, 1, 2], False),
    ("summed over the groups", 5, 5, 16, 64, 384, None, True),
    ("two token tiles", 1, 2, 256, 64, 256, None, False),
    ("chunks, negative ids skipped", 4, 3, 16, 128, 256, [2, -1, 0, -1], False),
]


def _check_grouped(case, interpret, rel_bound, config=GemmConfig()):
    _, groups, matrices, m, n, k, chosen, summed = case
    x, w = _group_operands(m + n + k + groups, groups, matrices, m, n, k)
    x8, x_scales = quantize_activations(x)
    ids = None if chosen is None else jnp.asarray(chosen, jnp.int32)
    y = fp8_grouped_gemm_mgpu(x8, x_scales, w.values, w.scales, ids, sum_groups=summed, config=config,
                              num_sms=4, interpret=interpret)
    xq, wq = _quantized_stack_f64(x8, x_scales, w)
    wq = wq if chosen is None else wq[np.asarray(chosen)]
    if groups == 1:
        xq = np.broadcast_to(xq, (wq.shape[0], m, k))
    spec = "gmk,gnk->mn" if summed else "gmk,gnk->gmn"
    want = np.einsum(spec, xq, wq, optimize=True)
    size = np.einsum(spec, np.abs(xq), np.abs(wq), optimize=True)  # the size of the terms summed, per output
    assert y.shape == want.shape
    if chosen is not None:  # a skipped group's rows are left unwritten: only the others are compared
        kept = np.asarray(chosen) >= 0
        y, want, size = np.asarray(y)[kept], want[kept], size[kept]
    err = np.abs(np.asarray(y, np.float64) - want)
    assert (err <= rel_bound * size + 1e-30).all(), float((err / (size + 1e-30)).max())


@pytest.mark.parametrize("case", GROUPED_CASES, ids=[c[0] for c in GROUPED_CASES])
def test_the_grouped_launch_matches_float64_on_its_quantized_operands(case):
    # Interpreted: the bound of the one-product test (float32 sums of 128-channel blocks, scaled and
    # added over the blocks and, summed, over the groups: ~(128 + K / 128 + G) roundings of 2^-24).
    _check_grouped(case, interpret=True, rel_bound=2.0**-15)


def test_the_grouped_launch_reads_its_grid_in_the_order_past_cuda_z_cap(monkeypatch):
    """Where groups x weight tiles pass CUDA's z cap (``launch_grid``: V3's sorted down projection at
    8192 tokens) the weight tiles go to x; the kernel indexes its grid by name, so the sorted
    dispatch's chunks (negative ids skipped) still match float64 (cap lowered to take that order
    here: 4 groups x 2 tiles > 5)."""
    import snapmla_jax.pallas_kernels.fp8_gemm_mgpu as module
    monkeypatch.setattr(module, "GRID_YZ_MAX", 5)
    orders = []
    launch_grid = module.launch_grid
    monkeypatch.setattr(module, "launch_grid", lambda *a: orders.append(launch_grid(*a)) or orders[-1])
    _check_grouped(GROUPED_CASES[-1], interpret=True, rel_bound=2.0**-15, config=GemmConfig(splits=1))
    assert [names for _, names in orders] == [("g", "s", "m", "n")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GROUPED_CASES + [("V2-Lite experts, summed down", 64, 64, 64, 2048, 1408, None, True),
                                                  ("V3 experts, chosen", 1, 8, 16, 2048, 7168, [5, 1, 5, 7], False)],
                         ids=lambda c: c[0])
def test_the_compiled_grouped_launch_matches_float64_on_its_quantized_operands(case):
    # The FP8 wgmma's ~14-bit accumulation of four 32-channel slices a block, as the one-product test.
    _check_grouped(case, interpret=False, rel_bound=2.0**-10)


def _check_quantizing(case, dtype, interpret, rel_bound):
    """A GROUPED_CASES launch given its tokens unquantized (``x_scales`` None): against float64 x
    (as ``dtype`` holds it) times the dequantized matrices, within x's e4m3 rounding."""
    _, groups, matrices, m, n, k, chosen, summed = case
    x, w = _group_operands(m + n + k + groups + 1, groups, matrices, m, n, k)
    x = x.astype(dtype)
    ids = None if chosen is None else jnp.asarray(chosen, jnp.int32)
    y = fp8_grouped_gemm_mgpu(x, None, w.values, w.scales, ids, sum_groups=summed, num_sms=4, interpret=interpret)
    assert y.shape[-2] == pad_tokens(m)  # whole token tiles; the rows past m are the TMA's zeros
    y = y[..., :m, :]
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    w64 = w64 if chosen is None else w64[np.asarray(chosen)]
    x64 = np.broadcast_to(x64, (w64.shape[0], m, k))
    spec = "gmk,gnk->mn" if summed else "gmk,gnk->gmn"
    want = np.einsum(spec, x64, w64)
    bound = _activation_rounding_bound(x64, w64, spec, rel_bound)
    y = np.asarray(y, np.float64)
    if chosen is not None:  # a skipped group's rows are left unwritten
        kept = np.asarray(chosen) >= 0
        y, want, bound = y[kept], want[kept], bound[kept]
    assert y.shape == want.shape
    err = np.abs(y - want)
    assert (err <= bound).all(), float((err / bound).max())
    return y, want


# Token counts the kernel reads in tiles past their end (no pad before the launch): one token, 11,
# and 100 in a 128-token tile, summed and with chosen matrices.
RAGGED_TOKEN_CASES = [
    ("one token", 2, 2, 1, 128, 256, None, False),
    ("11 tokens, chosen matrices", 1, 3, 11, 64, 512, [2, 0], False),
    ("100 tokens summed", 3, 3, 100, 64, 256, None, True),
]


@pytest.mark.parametrize("case", GROUPED_CASES + RAGGED_TOKEN_CASES, ids=[c[0] for c in GROUPED_CASES + RAGGED_TOKEN_CASES])
def test_the_launch_quantizes_bf16_tokens_itself_within_their_e4m3_rounding(case):
    """Without ``x_scales`` each mode of the grouped launch quantizes its bf16 tokens per token and
    128 channels in the kernel (``quantize_tile``); interpreted, the sums add 2^-15 of the terms'
    size as in the tests above."""
    y, want = _check_quantizing(case, jnp.bfloat16, interpret=True, rel_bound=2.0**-15)
    # The rounding shows: the tokens were quantized (an unquantized product is ~2^-15 from float64).
    assert np.abs(y - want).max() > 2.0**-12 * np.abs(want).max()


def test_the_kernel_quantizes_float32_tokens_and_two_stacks_share_them():
    """f32 tokens quantized in the kernel (one product, the module's one-group launch), and a MoE's
    gate and up in one launch quantizing the tokens they share: each stack's product within the
    activation rounding of float64."""
    x, w = _operands(5, 32, 192, 512)
    y = fp8_gemm_mgpu(x, None, w.values, w.scales, num_sms=4, interpret=True)
    x64, w64 = np.asarray(x, np.float64), np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    err = np.abs(np.asarray(y, np.float64) - x64 @ w64.T)
    assert (err <= _activation_rounding_bound(x64, w64, "mk,nk->mn", 2.0**-15)).all()
    xs, gate = _group_operands(13, 1, 3, 16, 128, 256)
    _, up = _group_operands(14, 1, 3, 16, 128, 256)
    xs = xs.astype(jnp.bfloat16)
    ys = fp8_grouped_gemm_mgpu(xs, None, (gate.values, up.values), (gate.scales, up.scales), jnp.asarray([2, 0, 2]),
                               num_sms=4, interpret=True)
    x64 = np.asarray(xs[0].astype(jnp.float32), np.float64)
    for y, stack in zip(ys, (gate, up)):
        w64 = np.asarray(dequantize_weight(stack, jnp.float32), np.float64)[[2, 0, 2]]
        err = np.abs(np.asarray(y, np.float64) - np.einsum("mk,gnk->gmn", x64, w64))
        assert (err <= _activation_rounding_bound(x64, w64, "mk,gnk->gmn", 2.0**-15)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", GROUPED_CASES + RAGGED_TOKEN_CASES + [
    ("V2-Lite experts, summed down", 64, 64, 64, 2048, 1408, None, True),
    ("V3 experts, chosen, 5 tokens", 1, 8, 5, 2048, 7168, [5, 1, 5, 7], False)], ids=lambda c: c[0])
def test_the_compiled_launch_quantizes_bf16_tokens_itself_within_their_e4m3_rounding(case):
    # The FP8 wgmma's ~14-bit accumulation of four 32-channel slices a block: 2^-10 of the terms' size.
    _check_quantizing(case, jnp.bfloat16, interpret=False, rel_bound=2.0**-10)


@pytest.mark.parametrize("chosen, interpret", [(None, True), ([2, 0, 2], True),
                                               pytest.param([2, 0, 2], False, marks=pytest.mark.gpu)])
def test_two_stacks_in_one_launch_each_match_their_own_product(chosen, interpret):
    """A MoE's gate and up as one launch (a tuple of stacks): each stack's result is its own
    product against float64, at the bound of the one-stack tests (interpreted 2^-15, compiled
    2^-10 of the terms' size)."""
    m, n, k = 16, 128, 256
    x, gate = _group_operands(11, 1, 3, m, n, k)
    _, up = _group_operands(12, 1, 3, m, n, k)
    x8, x_scales = quantize_activations(x)
    ids = None if chosen is None else jnp.asarray(chosen, jnp.int32)
    ys = fp8_grouped_gemm_mgpu(x8, x_scales, (gate.values, up.values), (gate.scales, up.scales), ids, num_sms=4,
                               interpret=interpret)
    assert isinstance(ys, tuple) and len(ys) == 2
    for y, w in zip(ys, (gate, up)):
        xq, wq = _quantized_stack_f64(x8, x_scales, w)
        wq = wq if chosen is None else wq[np.asarray(chosen)]
        want = np.einsum("mk,gnk->gmn", xq[0], wq)
        size = np.einsum("mk,gnk->gmn", np.abs(xq[0]), np.abs(wq))
        err = np.abs(np.asarray(y, np.float64) - want)
        assert (err <= (2.0**-15 if interpret else 2.0**-10) * size + 1e-30).all()


@pytest.mark.parametrize("chosen, m, quantized, out_dtype, interpret", [
    (None, 16, True, jnp.float32, True), ([2, -1, 0, 2], 11, False, jnp.bfloat16, True),
    ([1, 0], 100, True, jnp.float32, True),  # two token tiles
    pytest.param([2, -1, 0, 2], 64, True, jnp.bfloat16, False, marks=pytest.mark.gpu),
    pytest.param(None, 5, False, jnp.float32, False, marks=pytest.mark.gpu)])
def test_a_gated_launch_writes_silu_of_gate_times_up_within_the_roundings_of_float64(chosen, m, quantized, out_dtype,
                                                                                     interpret):
    """``gated=True``: each CTA multiplies its token tile by both stacks' rows and writes
    silu(gate) * up, here against float64 x (as given: float32, or bf16 the kernel quantizes as it
    arrives) times the dequantized matrices. Each product is off by x's e4m3 rounding and its sums'
    (interpreted 2^-15, compiled 2^-10 of the terms' size: ``_activation_rounding_bound``); silu's
    slope is at most 1.1, so silu(g) * u is off by at most 1.1 |dg| (|u| + |du|) + |silu(g)| |du|;
    then one rounding to the output's dtype (bfloat16: 2^-9 of the value) and float32's own exp
    and products (2^-20)."""
    k, n = 256, 128
    x, gate = _group_operands(31, 1, 3, m, n, k)
    _, up = _group_operands(32, 1, 3, m, n, k)
    ids = None if chosen is None else jnp.asarray(chosen, jnp.int32)
    if quantized:
        x8, x_scales = quantize_activations(jnp.pad(x, ((0, 0), (0, pad_tokens(m) - m), (0, 0))))
        h = fp8_grouped_gemm_mgpu(x8, x_scales, (gate.values, up.values), (gate.scales, up.scales), ids, gated=True,
                                  out_dtype=out_dtype, num_sms=4, interpret=interpret)
    else:  # the kernel quantizes the tokens itself
        x = x.astype(jnp.bfloat16)
        h = fp8_grouped_gemm_mgpu(x, None, (gate.values, up.values), (gate.scales, up.scales), ids, gated=True,
                                  out_dtype=out_dtype, num_sms=4, interpret=interpret)
    assert h.dtype == out_dtype and h.shape == (3 if chosen is None else len(chosen), pad_tokens(m), n)
    kept = np.ones(h.shape[0], bool) if chosen is None else np.asarray(chosen) >= 0
    matrices = np.arange(3) if chosen is None else np.asarray(chosen)[kept]
    rel = 2.0**-15 if interpret else 2.0**-10
    x64 = np.broadcast_to(np.asarray(x.astype(jnp.float32), np.float64), (len(matrices), m, k))
    products = []
    for w in (gate, up):
        w64 = np.asarray(dequantize_weight(w, jnp.float32), np.float64)[matrices]
        products.append((np.einsum("gmk,gnk->gmn", x64, w64),
                         _activation_rounding_bound(x64, w64, "gmk,gnk->gmn", rel)))
    (g, g_err), (u, u_err) = products
    silu = g * 0.5 * (1.0 + np.tanh(0.5 * g))  # g * sigmoid(g), without exp's overflow
    want = silu * u
    out_rel = 2.0**-9 if out_dtype == jnp.bfloat16 else 2.0**-20
    bound = 1.1 * g_err * (np.abs(u) + u_err) + np.abs(silu) * u_err + out_rel * np.abs(want) + 1e-30
    err = np.abs(np.asarray(h[kept], np.float64)[:, :m] - want)
    assert (err <= bound).all(), float((err / bound).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("m, backend", [(11, "interpret"), (100, "interpret"), (11, "xla")])
def test_fp8_grouped_matmul_gated_is_silu_of_its_two_products_on_every_path(m, backend):
    """``fp8_grouped_matmul(..., gated=True)`` on the kernel of few tokens (11), the tiled kernel
    (100) and XLA: silu(gate) * up of the same call's two products, within one rounding of the
    output (bfloat16, 2^-8 of the value where both sides round) and float32's exp (2^-20)."""
    x, gate = _group_operands(41, 1, 2, m, 128, 256)
    _, up = _group_operands(42, 1, 2, m, 128, 256)
    g, u = fp8_grouped_matmul(x, (gate, up), transposed=True, backend=backend)
    h = fp8_grouped_matmul(x, (gate, up), transposed=True, gated=True, out_dtype=jnp.bfloat16, backend=backend)
    want = np.asarray(jax.nn.silu(g) * u, np.float64)
    assert h.shape == want.shape and h.dtype == jnp.bfloat16
    err = np.abs(np.asarray(h, np.float64) - want)
    assert (err <= 2.0**-8 * np.abs(want) + 2.0**-20 * np.abs(want).max()).all()


def test_a_gated_product_refuses_one_stack_a_split_k_and_an_integer_output():
    x, gate = _group_operands(43, 1, 2, 16, 128, 256)
    x8, x_scales = quantize_activations(x)
    two = ((gate.values, gate.values), (gate.scales, gate.scales))
    with pytest.raises(ValueError, match="w8: a gated product takes two stacks"):
        fp8_grouped_gemm_mgpu(x8, x_scales, gate.values, gate.scales, gated=True, interpret=True)
    with pytest.raises(ValueError, match="config: a gated product runs K whole"):
        fp8_grouped_gemm_mgpu(x8, x_scales, *two, gated=True, config=GemmConfig(splits=2), interpret=True)
    with pytest.raises(ValueError, match="out_dtype: expected float32, bfloat16 or float16"):
        fp8_grouped_gemm_mgpu(x8, x_scales, *two, out_dtype=jnp.int32, interpret=True)
    with pytest.raises(ValueError, match="w: a gated product takes a tuple of two stacks"):
        fp8_grouped_matmul(x, gate, gated=True, backend="interpret")


@pytest.mark.parametrize("summed, chosen, m", [(False, None, 11), (False, [1, 1, 0], 11), (True, None, 11),
                                               (False, [1, -1, 0], 100), (True, None, 100)])
def test_fp8_grouped_matmul_through_the_kernel_is_within_the_activation_rounding(summed, chosen, m):
    """11 tokens padded to 16 (the kernel of few tokens) or 100 padded to 128 (the tiled kernel,
    but for summed groups) and cut back; against float64 x times the dequantized matrices, the
    error is x's e4m3 rounding (the bound of the one-product test, per group)."""
    groups, n, k = 2, 128, 512
    assert tiles_run(_group_operands(0, 1, groups, 1, n, k)[1], m, "interpret") == (m > 64)
    x, w = _group_operands(7, groups if chosen is None else 1, groups, m, n, k)
    ids = None if chosen is None else jnp.asarray(chosen)
    y = fp8_grouped_matmul(x, w, matrices=ids, sum_groups=summed, backend="interpret")
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    kept = slice(None) if chosen is None else np.asarray(chosen) >= 0  # a negative id: the group is skipped
    w64 = w64 if chosen is None else w64[np.asarray(chosen)][kept]
    x64 = np.broadcast_to(x64, (w64.shape[0], m, k))
    spec = "gmk,gnk->mn" if summed else "gmk,gnk->gmn"
    want = np.einsum(spec, x64, w64)
    bound = _activation_rounding_bound(x64, w64, spec, 2.0**-15)
    y = y if summed else y[kept]
    err = np.abs(np.asarray(y, np.float64) - want)
    assert y.shape == want.shape and (err <= bound).all(), float((err / bound).max())
    if chosen is not None and min(chosen) < 0:
        return  # XLA's fallback takes no skipped groups
    fallback = fp8_grouped_matmul(x, w, matrices=ids, sum_groups=summed, backend="xla")
    assert not np.array_equal(np.asarray(y), np.asarray(fallback))  # the kernel ran: x's rounding shows
    np.testing.assert_allclose(np.asarray(fallback, np.float64), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("summed, m, backend, out_dtype", [
    (False, 11, "interpret", jnp.float32), (True, 11, "interpret", jnp.float32), (False, 100, "interpret", jnp.float32),
    (False, 11, "xla", jnp.float32), (True, 11, "xla", jnp.float32),
    (False, 37, "interpret", jnp.bfloat16), (True, 11, "interpret", jnp.float16),
    pytest.param(False, 48, "pallas", jnp.bfloat16, marks=pytest.mark.gpu),
    pytest.param(False, 16, "pallas", jnp.float16, marks=pytest.mark.gpu)])
def test_a_transposed_grouped_product_is_the_same_numbers_out_by_tokens(summed, m, backend, out_dtype):
    """``transposed=True`` ([G, out, T]) on every path (the kernel of few tokens, the tiled kernel at
    100 tokens, XLA): bit for bit the usual result with its last two axes swapped, tokens cut back.
    A 16-bit result of one split leaves the kernel of few tokens token-major (transposed stores
    into its staging tile) unless ``transposed``: the two layouts hold the same bits."""
    x, w = _group_operands(3, 2, 2, m, 128, 256)
    plain = fp8_grouped_matmul(x, w, sum_groups=summed, out_dtype=out_dtype, backend=backend)
    flipped = fp8_grouped_matmul(x, w, sum_groups=summed, transposed=True, out_dtype=out_dtype, backend=backend)
    assert plain.dtype == flipped.dtype == out_dtype
    np.testing.assert_array_equal(np.asarray(flipped), np.swapaxes(np.asarray(plain), -1, -2))
    assert np.abs(np.asarray(plain, np.float64)).max() > 0


def test_under_kernel_quantization_the_products_hand_the_kernel_their_tokens_unquantized(monkeypatch):
    """``kernel_quantization(64)``: ``fp8_matmul`` (15 rows, padded to 16) and a MoE's gate and up
    through ``fp8_grouped_matmul`` give the kernel of few tokens x itself (x_scales None), past 64
    rows XLA's quantization; the results stay within x's e4m3 rounding of float64."""
    import snapmla_jax.fp8_weights as fp8_weights

    library_setting = fp8_weights.KERNEL_QUANTIZES_MAX_ROWS
    given = []
    for name in ("fp8_gemm_mgpu", "fp8_grouped_gemm_mgpu"):
        kernel = getattr(fp8_weights, name)
        monkeypatch.setattr(fp8_weights, name,
                            lambda x, xs, *a, _kernel=kernel, **kw: given.append((x.dtype, xs is None)) or _kernel(x, xs, *a, **kw))
    x, w = _operands(21, 15, 192, 512)
    x = x.astype(jnp.bfloat16)
    with fp8_weights.kernel_quantization(64):
        y = fp8_matmul(x, w, backend="interpret")
        xg, gate = _group_operands(22, 1, 3, 40, 128, 256)
        _, up = _group_operands(23, 1, 3, 40, 128, 256)
        ys = fp8_grouped_matmul(xg.astype(jnp.bfloat16), (gate, up), backend="interpret")
    assert fp8_weights.KERNEL_QUANTIZES_MAX_ROWS == library_setting  # restored
    assert given == [(jnp.bfloat16, True), (jnp.bfloat16, True)]
    x64, w64 = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(dequantize_weight(w, jnp.float32), np.float64)
    want = x64 @ w64.T  # fp8_matmul returns x's bf16: its rounding, 2^-9 of the value, on top
    bound = _activation_rounding_bound(x64, w64, "mk,nk->mn", 2.0**-15) + 2.0**-9 * np.abs(want)
    assert (np.abs(np.asarray(y, np.float64) - want) <= bound).all()
    x64 = np.asarray(xg.astype(jnp.bfloat16).astype(jnp.float32), np.float64)[0]
    for y, stack in zip(ys, (gate, up)):
        w64 = np.asarray(dequantize_weight(stack, jnp.float32), np.float64)
        err = np.abs(np.asarray(y, np.float64) - np.einsum("mk,gnk->gmn", x64, w64))
        assert (err <= _activation_rounding_bound(x64, w64, "mk,gnk->gmn", 2.0**-15)).all()
    given.clear()
    with fp8_weights.kernel_quantization(8):  # 15 rows: past it
        fp8_matmul(x, w, backend="interpret")
    assert given == [(jnp.float8_e4m3fn, False)]
    given.clear()  # the library's settings: one row of a grouped product in the kernel, two by XLA;
    _, whole = _operands(24, 1, 256, 512)
    fp8_matmul(x[:1], whole, backend="interpret")  # a one-row product with whole 128-blocks is XLA's (no launch)
    fp8_matmul(x[:1], w, backend="interpret")  # 192 rows (1.5 blocks): the kernel's, which quantizes the row
    fp8_grouped_matmul(xg[:, :1].astype(jnp.bfloat16), (gate, up), backend="interpret")
    fp8_grouped_matmul(xg[:, :2].astype(jnp.bfloat16), (gate, up), backend="interpret")
    assert library_setting == 1 and fp8_weights.XLA_MAX_ROWS == 1
    assert given == [(jnp.bfloat16, True), (jnp.bfloat16, True), (jnp.float8_e4m3fn, False)]


def test_fp8_grouped_matmul_refuses_what_it_cannot_run_naming_the_argument():
    x, w = _group_operands(0, 1, 2, 4, 64, 256)
    with pytest.raises(ValueError, match="x: expected"):
        fp8_grouped_matmul(x[0], w, backend="xla")
    with pytest.raises(ValueError, match="matrices: a summed product"):
        fp8_grouped_matmul(x, w, matrices=jnp.zeros(2, jnp.int32), sum_groups=True, backend="xla")
    with pytest.raises(ValueError, match="x: expected 1 or 2 groups"):
        x8, xs = quantize_activations(jnp.ones((3, 16, 256), jnp.float32))
        fp8_grouped_gemm_mgpu(x8, xs, w.values, w.scales, interpret=True)


def test_the_depth_keeps_every_cta_resident_else_two_an_sm():
    """The measured cases of ``pipeline_depth``'s rule (132 SMs; a CTA's SMEM is its slots, the
    output tile staged in them after the last step)."""
    # 18432 x 7168 at 16 tokens, 288 CTAs: depth 4 holds two CTAs an SM (264 < 288), depth 3 three.
    assert pipeline_depth(GemmConfig(), 16, 2, 32) == 4
    assert pipeline_depth(GemmConfig(), 16, 2, 32, ctas=288, num_sms=132) == 3
    # At 64 tokens (slots of 33 KB): three an SM at depth 2, all 288 resident.
    assert pipeline_depth(GemmConfig(), 64, 2, 64, ctas=288, num_sms=132) == 2
    # 2816 CTAs: never one wave; depth 3 holds two an SM, 4 one.
    assert pipeline_depth(GemmConfig(), 64, 2, 64, ctas=2816, num_sms=132) == 3
    # V2-Lite's gated gate and up at 64 tokens (two weight tiles a slot, 1408 CTAs): two an SM at 2.
    assert pipeline_depth(GemmConfig(), 64, 2, 64, ctas=1408, num_sms=132, weight_tiles=2) == 2
    # Their down projection (K = 1408: one block a step), 512 CTAs: four an SM at depth 3.
    assert pipeline_depth(GemmConfig(), 64, 1, 64, ctas=512, num_sms=132) == 3
    assert pipeline_depth(GemmConfig(), 16, 1, 32, ctas=512, num_sms=132) == 4  # already resident
    # A launch of few CTAs keeps the configured depth; a depth of 1 stays 1.
    assert pipeline_depth(GemmConfig(), 64, 2, 64, ctas=40, num_sms=132) == 4
    assert pipeline_depth(GemmConfig(depth=1), 64, 2, 64, ctas=2816, num_sms=132) == 1
    # 128-token tiles (slots of 49 KB): two an SM at depth 2.
    assert pipeline_depth(GemmConfig(), 128, 2, 128, ctas=1000, num_sms=132) == 2


def test_splits_fill_two_ctas_an_sm_and_divide_the_steps():
    assert choose_splits(n_tiles=288, steps=28, num_sms=132) == 1  # 288 CTAs already
    assert choose_splits(n_tiles=112, steps=72, num_sms=132) == 3  # 336 CTAs
    assert choose_splits(n_tiles=32, steps=28, num_sms=132) == 14  # 7 would give 224 < 264
    assert choose_splits(n_tiles=1, steps=6, num_sms=132) == 6  # all it can


def test_splits_stop_at_one_cta_an_sm_where_their_partials_outweigh_the_weight():
    """split_share = 8 M / K (``fp8_gemm_mgpu.partials_share``): a split's float32 partials,
    written and read back, over the e4m3 weight's bytes. Past PARTIALS_MAX_SHARE in all, the
    fewest splits that give FILL_SHARE of a CTA an SM."""
    assert choose_splits(32, 28, 132, split_share=8 * 64 / 7168) == 4  # 2048 x 7168, 64 tokens: 128 CTAs
    assert choose_splits(32, 28, 132, split_share=8 * 16 / 7168) == 4  # 14 splits' partials: 0.25
    assert choose_splits(112, 8, 132, split_share=8 * 64 / 2048) == 1  # 7168 x 2048: 112 CTAs fill enough
    assert choose_splits(9, 28, 132, split_share=8 * 16 / 7168) == 14  # 576 x 7168: 126 CTAs, not 252
    assert choose_splits(171, 8, 132, split_share=8 * 16 / 2048) == 2  # partials 0.125: two an SM
    assert choose_splits(112, 72, 132, split_share=8 * 64 / 18432) == 3  # long K: partials 0.08
    assert choose_splits(288, 28, 132, split_share=1.0) == 1  # no split, no partials


@pytest.mark.parametrize("kb_per_step", [1, 2, 3])
def test_every_slot_of_scales_starts_on_a_128_byte_boundary(kb_per_step):
    """The slots lie end to end and a TMA writes shared memory at 128-byte aligned addresses: each
    slot's kb_per_step x scale_tokens float32 is whole 128-byte units, and holds every token."""
    for tokens in (16, 32, 48, 64, 128):
        scale_tokens = scale_slot_tokens(tokens, kb_per_step)
        assert scale_tokens >= tokens and (4 * kb_per_step * scale_tokens) % 128 == 0
        assert scale_tokens - tokens < 32  # no more than one unit of padding
    assert scale_slot_tokens(48, 1) == 64 and scale_slot_tokens(48, 2) == 48 and scale_slot_tokens(16, 2) == 16


def test_quantize_activations_puts_each_blocks_amax_on_448():
    x, _ = _operands(3, 16, 64, 512)
    x8, scales = quantize_activations(x)
    assert scales.shape == (4, 16)
    top = np.abs(np.asarray(x8.astype(jnp.float32))).reshape(16, 4, BLOCK).max(-1)
    np.testing.assert_array_equal(top, np.full((16, 4), 448.0))
    zero8, zero_scales = quantize_activations(jnp.zeros((16, 256), jnp.float32))
    assert not np.asarray(zero8.astype(jnp.float32)).any() and not np.asarray(zero_scales).any()


def test_a_shape_the_kernel_does_not_take_is_refused_naming_it():
    x8, xs = quantize_activations(jnp.ones((8, 256), jnp.float32))
    w = quantize_blocks(jnp.ones((64, 256), jnp.float32))
    with pytest.raises(ValueError, match="x, w8: the FP8 GEMM takes M a multiple of 16"):
        fp8_gemm_mgpu(x8, xs, w.values, w.scales, interpret=True)
    x8, xs = quantize_activations(jnp.ones((96, 256), jnp.float32))  # past 64: whole tiles of 64
    with pytest.raises(ValueError, match="of 128 above"):
        fp8_gemm_mgpu(x8, xs, w.values, w.scales, interpret=True)


@pytest.mark.parametrize("m, n, k, x_dtype", [(64, 18432, 7168, jnp.float8_e4m3fn), (16, 2048, 7168, jnp.float8_e4m3fn),
                                              (64, 18432, 7168, jnp.bfloat16), (32, 2048, 1408, jnp.float32),
                                              (5, 2048, 7168, jnp.bfloat16)])
def test_the_kernel_lowers_for_cuda_within_shared_memory_at_the_largest_tokens(m, n, k, x_dtype):
    """Lowered on CPU for an H100 (layout inference, the pipeline's SMEM: 4 slots of 64 x 256
    weight bytes and m x 256 token bytes); 256 tokens overflowed shared memory on the GPU. Tokens
    unquantized (bf16, f32): the kernel's quantization lowers, 5 tokens in a 16-token tile too, and
    64 bf16 tokens fit in 3 slots beside its e4m3 tile (4 came to 32 bytes past a CTA's SMEM)."""
    from snapmla_jax.backend import lower_for_cuda

    quantized = x_dtype == jnp.float8_e4m3fn
    x = jax.ShapeDtypeStruct((m, k), x_dtype)
    x_scales = jax.ShapeDtypeStruct((k // BLOCK, m), jnp.float32) if quantized else None
    w = (jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((-(-n // BLOCK), k // BLOCK), jnp.float32))
    text = lower_for_cuda(lambda x, x_scales, *w: fp8_gemm_mgpu(x, x_scales, *w), x, x_scales, *w).as_text()
    assert "snapmla_fp8_gemm" in text
    if not quantized:
        assert pipeline_depth(GemmConfig(), 64, 2, 0, x_itemsize=2) == 4


def test_the_grouped_launch_quantizing_its_tokens_lowers_for_cuda_at_v3_expert_shapes():
    """A V3 MoE's gate and up (two stacks of 256 experts, chosen matrices) and its summed down
    projection, 16 bf16 tokens quantized in the kernel, lowered on CPU for an H100."""
    from snapmla_jax.backend import lower_for_cuda

    stack = lambda n, k: (jax.ShapeDtypeStruct((256, n, k), jnp.float8_e4m3fn),
                          jax.ShapeDtypeStruct((256, n // BLOCK, k // BLOCK), jnp.float32))
    (gate, gate_s), (up, up_s) = stack(2048, 7168), stack(2048, 7168)
    x = jax.ShapeDtypeStruct((1, 16, 7168), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    lower_for_cuda(lambda x, g, gs, u, us, ids: fp8_grouped_gemm_mgpu(x, None, (g, u), (gs, us), ids),
                   x, gate, gate_s, up, up_s, ids)
    down, down_s = stack(7168, 2048)
    hidden = jax.ShapeDtypeStruct((256, 16, 2048), jnp.float32)
    lower_for_cuda(lambda h, d, ds: fp8_grouped_gemm_mgpu(h, None, d, ds, sum_groups=True), hidden, down, down_s)


def test_the_products_quantize_x_in_one_mosaic_launch_with_xlas_bits(monkeypatch):
    """Where the kernels run, ``fp8_matmul`` and ``fp8_grouped_matmul`` quantize x with the Mosaic
    GPU quantizer (``quantize_activations_mgpu``: the scales for the kernel of few tokens as wide as
    its slots, the tiled kernel's as its rows); with ``mosaic_quantization(False)`` XLA's launches do.
    Interpreted, both give the same bits (the quantizer's division is XLA's:
    tests/test_quantize_activations_mgpu.py)."""
    from snapmla_jax import fp8_weights

    calls = []
    quantizer = fp8_weights.quantize_activations_mgpu
    monkeypatch.setattr(fp8_weights, "quantize_activations_mgpu",
                        lambda x, rows, scale_rows, **kw: calls.append((x.shape, rows, scale_rows))
                        or quantizer(x, rows, scale_rows, **kw))
    x, w = _operands(5, 150, 256, 384)  # K = 3 blocks: the kernel of few tokens' one-block slots
    xs, stack = _group_operands(6, 3, 3, 11, 128, 256)

    def products():
        return (fp8_matmul(x[:11], w, backend="interpret"), fp8_matmul(x, w, backend="interpret"),
                fp8_grouped_matmul(xs, stack, backend="interpret"))

    mosaic = products()
    assert calls == [((11, 384), 16, 32), ((150, 384), 256, 256), ((3, 11, 256), 16, 16)]
    with fp8_weights.mosaic_quantization(False):
        xla = products()
    assert len(calls) == 3  # XLA quantized the second time
    for got, want in zip(mosaic, xla):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_x_scales_of_another_shape_are_refused_naming_them():
    x8, xs = quantize_activations(jnp.ones((16, 256), jnp.float32))
    w = quantize_blocks(jnp.ones((64, 256), jnp.float32))
    with pytest.raises(ValueError, match=r"x_scales: expected \[1, 2, 16\] \(or 16 columns"):
        fp8_gemm_mgpu(x8, xs[:, :8], w.values, w.scales, interpret=True)
