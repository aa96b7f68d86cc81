"""The Mosaic kernels' launcher inputs in one launch (pallas_kernels/mgpu_decode_inputs.py):
quantized query rows and step-ordered token scales."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.pallas_kernels.fp8 import fp8_round_trip_np
from snapmla_jax.backend import lower_for_cuda
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import (PAGE, SCALE_FLOOR, STEP, bf16_rows_and_plan, decode_inputs,
                                                           decode_inputs_and_plan, decode_inputs_reference, even_steps,
                                                           pad_rows, scale_steps, step_scales)
from snapmla_jax.pallas_kernels.split_plan import balanced_plan


def expected_step_scales(scale: np.ndarray, block_table: np.ndarray, layer_offset: int,
                         page_size: int = PAGE) -> np.ndarray:
    """Token scales in step order, one token at a time: within each 128-token step the even
    tokens first, then the odd ones; positions past the table read its last page."""
    batch, max_pages = block_table.shape
    steps = -(-max_pages * page_size // STEP)
    out = np.zeros((batch, steps * STEP), np.float32)
    for b in range(batch):
        for step in range(steps):
            order = list(range(0, STEP, 2)) + list(range(1, STEP, 2))
            for c, offset in enumerate(order):
                token = step * STEP + offset
                page = block_table[b, min(token // page_size, max_pages - 1)]
                row = min(max(layer_offset + page * page_size + token % page_size, 0), scale.shape[0] - 1)
                out[b, step * STEP + c] = scale[row]
    return out


def assert_same_inputs(got, want):
    """Two ``DecodeInputs`` equal bit for bit (their plans aside), fields absent in both."""
    for name in ("q8", "q_scale", "scales", "q_rope"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                          err_msg=name)


def random_inputs(seed: int, batch: int, rows: int, max_pages: int, layers: int = 2, page_size: int = PAGE):
    """Query rows with an outlier row (1000x) and a tiny one; a layered cache's token scales
    (all distinct) and a block table of shuffled pages; layer 1 selected."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, rows, 512)).astype(np.float32)
    q[0, 1] *= 1000.0
    q[-1, -1] *= 1e-3
    pages = batch * max_pages + 3
    scale = rng.uniform(0.5, 2.0, layers * pages * page_size).astype(np.float32)
    block_table = rng.permutation(pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    return q, scale, block_table, np.array([pages * page_size], np.int32)


# (batch, rows, max_pages): odd batch; an odd page count (the last step half past the
# table); a table long enough for several gathering programs.
SHAPES = [(3, 16, 5), (1, 64, 64), (2, 32, 33)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_inputs_match_their_definitions(shape):
    q, scale, block_table, offset = random_inputs(sum(shape), *shape)
    q8, q_scale, scales, q_rope, plan = decode_inputs(jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale),
                                                      jnp.asarray(block_table), jnp.asarray(offset), interpret=True)
    assert q_rope is None and plan is None  # neither asked for
    q_bf16 = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    # The gather moves values: exact.
    np.testing.assert_array_equal(np.asarray(scales), expected_step_scales(scale, block_table, int(offset[0])))
    # The scale is the row's amax / 448 (float32 math on bf16 inputs: exact to an ulp).
    np.testing.assert_allclose(np.asarray(q_scale), np.abs(q_bf16).max(-1) / 448.0, rtol=2e-7)
    # Q8 rounds q / scale to e4m3: equal to the float64 round trip's value up to float32
    # ties, and within half an e4m3 ulp of q (2**-4 relative; 2**-10 of the scale absolute
    # below e4m3's normal range, whose spacing is 2**-9).
    q_scale64 = np.asarray(q_scale).astype(np.float64)
    dequantized = np.asarray(q8.astype(jnp.float32)).astype(np.float64) * q_scale64[..., None]
    want = fp8_round_trip_np(q_bf16, q_scale64)
    assert np.mean(dequantized == want) > 0.999
    assert np.all(np.abs(dequantized - q_bf16) <= 2.0 ** -4 * np.abs(q_bf16) + 2.0 ** -10 * q_scale64[..., None])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_jnp_reference(shape):
    q, scale, block_table, offset = random_inputs(sum(shape) + 1, *shape)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    assert_same_inputs(decode_inputs(*args, interpret=True), decode_inputs_reference(*args))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_scale_planes_match_their_definition(shape):
    """With ``scale_planes`` each step's 128 scales are followed by their base-2 logarithms and
    their reciprocals ([B, steps, 3, 128]), of the scales floored at ``SCALE_FLOOR``: a zero scale
    (a slot never written) and a tiny one (an all-zero latent row) have -60 and 2^60."""
    q, scale, block_table, offset = random_inputs(sum(shape) + 3, *shape)
    scale[offset[0] + block_table[0, 0] * PAGE + 2] = 0.0  # layer 1, row 0's token 2: step row 1
    scale[offset[0] + block_table[0, 0] * PAGE + 4] = 1e-30 / 448  # token 4: step row 2
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    planes = decode_inputs(*args, scale_planes=True, interpret=True).scales
    want = expected_step_scales(scale, block_table, int(offset[0]))
    steps = want.shape[1] // STEP
    assert planes.shape == (shape[0], steps, 3, STEP)
    np.testing.assert_array_equal(np.asarray(planes[:, :, 0]).reshape(want.shape), want)
    logs = np.asarray(planes[:, :, 1]).reshape(want.shape)
    inverses = np.asarray(planes[:, :, 2]).reshape(want.shape)
    assert np.all(inverses[0, 1:3] == 2.0 ** 60)
    floored = np.maximum(want.astype(np.float64), SCALE_FLOOR)
    # float32 log2 against float64's: within an ulp of the result (2**-18 at 60: XLA's log2 of
    # 2**-60 is -59.999996) or of its argument's logarithm (2**-23 absolute at |log2| <= 1); the
    # reciprocal correctly rounded.
    np.testing.assert_allclose(logs, np.log2(floored), rtol=2.0 ** -23, atol=2.0 ** -23)
    np.testing.assert_allclose(inverses, 1.0 / floored, rtol=2.0 ** -24, atol=0)
    want_planes = decode_inputs_reference(*args, scale_planes=True).scales
    np.testing.assert_array_equal(np.asarray(planes), np.asarray(want_planes))


SMALL_PAGE_SHAPES = pytest.mark.parametrize("shape", [(3, 16, 3), (1, 64, 72), (2, 32, 33)],
                                            ids=lambda s: "x".join(map(str, s)))


def _check_small_page_scales(shape, page_size: int, interpret: bool) -> None:
    """The step-ordered scales of pages of ``page_size`` tokens as the token-at-a-time definition
    gives them, with their planes; the cache's last page in the table, whose copy of two pages
    (at 16 tokens) runs past the plane. Interpreted, the query outputs as the jnp reference's
    bits."""
    q, scale, block_table, offset = random_inputs(sum(shape) + page_size, *shape, page_size=page_size)
    block_table[-1, -1] = scale.shape[0] // page_size - 1 - int(offset[0]) // page_size
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    run = lambda **kw: jax.jit(functools.partial(decode_inputs, page_size=page_size, interpret=interpret, **kw))(*args)
    got, planes = run(), run(scale_planes=True)
    want_scales = expected_step_scales(scale, block_table, int(offset[0]), page_size)
    np.testing.assert_array_equal(np.asarray(got.scales), want_scales)
    np.testing.assert_array_equal(np.asarray(planes.scales[:, :, 0]).reshape(want_scales.shape), want_scales)
    if interpret:
        assert_same_inputs(got, decode_inputs_reference(*args, page_size=page_size))
    # The logarithms and reciprocals of the floored scales: interpreted, XLA's float32 log2 within
    # an ulp (2**-23 here, |log2| <= 1: jax 0.12's CPU log2 moved one value of a [1, 6, 3, 128]
    # plane by an ulp against the same log2 of another shape) and the reciprocal correctly rounded;
    # compiled, the GPU's log2 and approximate division within 2 ulps
    # (``test_compiled_inputs_match_the_reference``).
    log_tol, inverse_tol = (2.0 ** -23, 2.0 ** -24) if interpret else (2.0 ** -22, 2.0 ** -22)
    floored = np.maximum(np.asarray(planes.scales[:, :, 0]).astype(np.float64), SCALE_FLOOR)
    np.testing.assert_allclose(np.asarray(planes.scales[:, :, 1]), np.log2(floored), rtol=log_tol, atol=log_tol)
    np.testing.assert_allclose(np.asarray(planes.scales[:, :, 2]), 1.0 / floored, rtol=inverse_tol, atol=0)


@pytest.mark.parametrize("page_size", [16, 32])
@SMALL_PAGE_SHAPES
def test_scales_of_small_pages_match_their_definition(shape, page_size):
    """Pages of 32 or 16 tokens, 4 or 8 a step, each page's scales a copy of its own (of two pages
    at 16 tokens: the page and the next): a table of less than a step, an odd step count, several
    scale CTAs a row; 8-token pages refused."""
    _check_small_page_scales(shape, page_size, interpret=True)
    q, scale, block_table, offset = random_inputs(0, *shape, page_size=16)
    with pytest.raises(ValueError, match="page_size: expected one of"):
        decode_inputs(jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table),
                      jnp.asarray(offset), page_size=8, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32])
@SMALL_PAGE_SHAPES
def test_compiled_scales_of_small_pages_match_their_definition(shape, page_size):
    _check_small_page_scales(shape, page_size, interpret=False)


def test_scale_ctas_cover_the_steps_in_pairs():
    """A scale CTA stores two steps at a time: the steps it fills are the table's, rounded up to an
    even count (the extra one sliced off), and each CTA's share divides them."""
    for pages in (1, 2, 3, 16, 17, 1024, 1026):
        steps = even_steps(pages)
        assert steps % 2 == 0 and steps * STEP >= pages * PAGE > (steps - 2) * STEP
        block = scale_steps(steps)
        assert steps % block == 0 and block % 2 == 0


@pytest.mark.parametrize("batch,rows,max_pages,items,rope,page_size", [
    (3, 16, 5, 6, "float32", 64), (130, 16, 3, 390, None, 64), (1, 128, 1024, None, "bfloat16", 64),
    (2, 20, 7, 40, None, 64), (3, 16, 20, 6, None, 32), (2, 64, 9, None, "bfloat16", 32),
    (2, 16, 17, 4, None, 16)])
def test_launch_lowers_for_cuda(batch, rows, max_pages, items, rope, page_size):
    """Mosaic GPU lowering on the CPU (layouts, SMEM, the strided SMEM view of the scale CTAs, no
    interpreter path): a plan of 3 W < 128 values, B >= 128 (seq_lens in windows), an odd step
    count, RoPE rows to convert, rows padded to whole blocks first, pages of 32 and 16 tokens."""
    S = jax.ShapeDtypeStruct
    args = (S((batch, rows, 512), jnp.bfloat16), S((2 * batch * max_pages * page_size,), jnp.float32),
            S((batch, max_pages), jnp.int32), S((1,), jnp.int32), S((batch,), jnp.int32))
    q_rope = None if rope is None else S((batch, rows, 64), rope)

    def run(q, scale, table, offset, lens, q_rope_rows):
        kw = dict(q_rope_rows=q_rope_rows, padded_rows=-(-rows // 64) * 64, scale_planes=True, page_size=page_size)
        if items is None:
            return decode_inputs(q, scale, table, offset, **kw)
        return decode_inputs_and_plan(q, scale, table, offset, lens, num_items=items, **kw)

    assert "snapmla_mgpu_decode_inputs" in lower_for_cuda(run, *args, q_rope).as_text()
    if rope is not None:
        twin = lower_for_cuda(functools.partial(bf16_rows_and_plan, padded_rows=-(-rows // 64) * 64,
                                                num_items=items, capacity=None if items is None else max_pages * PAGE),
                              args[0], q_rope, args[4] if items else None)
        assert "snapmla_mgpu_bf16_rows" in twin.as_text()


def test_scale_plane_of_partial_pages_is_refused():
    q, scale, block_table, offset = random_inputs(9, 1, 16, 2)
    with pytest.raises(ValueError, match="scale"):
        decode_inputs(jnp.asarray(q), jnp.asarray(scale[:-1]), jnp.asarray(block_table), jnp.asarray(offset),
                      interpret=True)


def test_step_scales_reference_matches_the_loop():
    q, scale, block_table, offset = random_inputs(5, 2, 16, 7)
    np.testing.assert_array_equal(np.asarray(step_scales(jnp.asarray(scale), jnp.asarray(block_table),
                                                         jnp.asarray(offset))),
                                  expected_step_scales(scale, block_table, int(offset[0])))


# (batch, rows, max_pages, seq_lens, items): ragged rows (seq_len 0, a partial page, the full
# table); an odd batch; a batch past 16 rows; budgets of 1 to 3 items a row.
PLAN_CASES = [(3, 16, 5, [0, 200, 320], 6), (1, 64, 4, [256], 3), (17, 16, 3, list(range(0, 17 * 11, 11)), 51)]


@pytest.mark.parametrize("batch,rows,max_pages,seq_lens,items", PLAN_CASES)
def test_inputs_and_plan_in_one_launch_are_both_exact(batch, rows, max_pages, seq_lens, items):
    """The fused launch's inputs are ``decode_inputs``' bit for bit, its plan the jnp
    ``balanced_plan``'s (integer arithmetic: exact)."""
    q, scale, block_table, offset = random_inputs(batch + rows, batch, rows, max_pages)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    lens = jnp.asarray(seq_lens, jnp.int32)
    inputs = decode_inputs_and_plan(*args, lens, num_items=items, scale_planes=True, interpret=True)
    assert_same_inputs(inputs, decode_inputs(*args, scale_planes=True, interpret=True))
    plan = inputs.plan
    want = balanced_plan(lens, num_items=items, step_tokens=STEP, capacity=max_pages * PAGE)
    for got_part, want_part in zip(plan[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))


def test_fused_plan_checks_its_arguments():
    q, scale, block_table, offset = random_inputs(7, 2, 16, 2)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    with pytest.raises(ValueError, match="num_items"):
        decode_inputs_and_plan(*args, jnp.asarray([1, 2], jnp.int32), num_items=2, interpret=True)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_inputs_and_plan(*args, jnp.asarray([1.0, 2.0]), num_items=4, interpret=True)


# (batch, rows, padded rows): rows short of one 16-row program, a block of 64 with a partial
# program (H = 20), s_q = 2 x H = 16 in a 64-row block, and 16 rows already whole (no padding).
PAD_CASES = [(3, 8, 16), (2, 20, 64), (1, 32, 64), (2, 16, 16)]


@pytest.mark.parametrize("batch,rows,padded", PAD_CASES)
def test_rows_are_padded_in_the_launch(batch, rows, padded):
    """Query rows padded in the launch are ``jnp.pad``'s then quantized, bit for bit (zero rows:
    q8 0 and the quantizer's floor scale); the RoPE rows come back padded with zeros, in bf16;
    the real rows are those of the unpadded call."""
    q, scale, block_table, offset = random_inputs(batch * rows + padded, batch, rows, 5)
    q_rope = np.random.default_rng(rows).standard_normal((batch, rows, 64)).astype(np.float32)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    got = decode_inputs(*args, q_rope_rows=jnp.asarray(q_rope), padded_rows=padded, scale_planes=True,
                        interpret=True)
    want = decode_inputs_reference(*args, q_rope_rows=jnp.asarray(q_rope), padded_rows=padded, scale_planes=True)
    assert got.q8.shape == (batch, padded, 512) and got.q_rope.shape == (batch, padded, 64)
    assert got.q_rope.dtype == jnp.bfloat16
    assert_same_inputs(got, want)
    np.testing.assert_array_equal(np.asarray(got.q_rope[:, rows:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(got.q8[:, rows:].astype(jnp.float32)), 0.0)
    np.testing.assert_array_equal(np.asarray(got.q_rope[:, :rows], np.float32),
                                  np.asarray(jnp.asarray(q_rope, jnp.bfloat16), np.float32))
    if rows % 16 == 0:  # the real rows as an unpadded launch gives them
        unpadded = decode_inputs(*args, scale_planes=True, interpret=True)
        np.testing.assert_array_equal(np.asarray(got.q8[:, :rows].astype(jnp.float32)),
                                      np.asarray(unpadded.q8.astype(jnp.float32)))


def test_padding_arguments_are_checked():
    q, scale, block_table, offset = random_inputs(6, 1, 20, 2)
    args = jnp.asarray(q), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    with pytest.raises(ValueError, match="padded_rows"):
        decode_inputs(*args, padded_rows=16, interpret=True)  # fewer than the rows
    with pytest.raises(ValueError, match="padded_rows"):
        decode_inputs(*args, padded_rows=40, interpret=True)  # not whole 16-row programs
    with pytest.raises(ValueError, match="q_rope_rows"):
        decode_inputs(*args, q_rope_rows=jnp.zeros((1, 16, 64)), padded_rows=32, interpret=True)
    # Rows not given a padding are rounded up to whole programs.
    assert decode_inputs(*args, interpret=True).q8.shape == (1, 32, 512)


# (batch, rows, padded rows, seq_lens or None (no plan), items): the BF16 twin's launch.
TWIN_CASES = [(3, 48, 64, [0, 200, 320], 6), (2, 32, 64, None, None), (17, 16, 64, list(range(0, 17 * 11, 11)), 51),
              (1, 8, 16, None, None)]


def _twin_rows(batch, rows, seed, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, rows, 512)).astype(np.float32)
    q[0, 0] *= 1e4  # an outlier row: copied, not scaled
    q_rope = rng.standard_normal((batch, rows, 64)).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(q_rope, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch,rows,padded,seq_lens,items", TWIN_CASES)
def test_twin_rows_and_plan_in_one_launch(batch, rows, padded, seq_lens, items, dtype):
    """The BF16 twin's rows: ``jnp.pad`` of the bf16 rows, bit for bit (zero padding rows;
    float32 queries rounded to bf16 as ``astype`` does), and the jnp ``balanced_plan``."""
    q, q_rope = _twin_rows(batch, rows, batch + rows, dtype)
    lens = None if seq_lens is None else jnp.asarray(seq_lens, jnp.int32)
    capacity = 5 * PAGE
    got = bf16_rows_and_plan(q, q_rope, lens, padded_rows=padded, num_items=items,
                             capacity=None if items is None else capacity, interpret=True)
    assert got.q.dtype == got.q_rope.dtype == jnp.bfloat16
    for have, want in ((got.q, pad_rows(q, padded)), (got.q_rope, pad_rows(q_rope, padded))):
        np.testing.assert_array_equal(np.asarray(have, np.float32),
                                      np.asarray(want.astype(jnp.bfloat16), np.float32))
    if items is None:
        assert got.plan is None
        return
    want = balanced_plan(lens, num_items=items, step_tokens=STEP, capacity=capacity)
    for got_part, want_part in zip(got.plan[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))


def test_twin_rows_check_their_arguments():
    q, q_rope = _twin_rows(2, 20, 0, "bfloat16")
    with pytest.raises(ValueError, match="padded_rows"):
        bf16_rows_and_plan(q, q_rope, padded_rows=24, interpret=True)
    with pytest.raises(ValueError, match="q_rope_rows"):
        bf16_rows_and_plan(q, q_rope[:, :16], padded_rows=32, interpret=True)
    with pytest.raises(ValueError, match="num_items"):  # a plan without its capacity
        bf16_rows_and_plan(q, q_rope, jnp.asarray([1, 2], jnp.int32), padded_rows=32, num_items=4, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compiled_inputs_match_the_reference(shape):
    q, scale, block_table, offset = random_inputs(sum(shape) + 2, *shape)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    q8, q_scale, scales, _, _ = jax.jit(decode_inputs)(*args)
    want_q8, want_scale, want_scales, _, _ = decode_inputs_reference(*args)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
    np.testing.assert_allclose(np.asarray(q_scale), np.asarray(want_scale), rtol=2e-7)
    # The GPU's float32 division may differ from XLA's by an ulp, moving a rare value that
    # sits on an e4m3 rounding tie by one e4m3 step: allow that, nothing more.
    got, want = np.asarray(q8.astype(jnp.float32)), np.asarray(want_q8.astype(jnp.float32))
    assert np.mean(got == want) > 0.999
    np.testing.assert_allclose(got, want, rtol=2.0 ** -3, atol=2.0 ** -9)
    # The logarithms' and reciprocals' planes: the GPU's log2 may differ from XLA's by an ulp
    # (2**-23 here, |log2| <= 1), its division (``div.full``, approximate) by 2 ulps.
    planes = jax.jit(functools.partial(decode_inputs, scale_planes=True))(*args).scales
    scales64 = np.maximum(np.asarray(planes[:, :, 0]).astype(np.float64), SCALE_FLOOR)
    np.testing.assert_array_equal(np.asarray(planes[:, :, 0]).reshape(want_scales.shape), np.asarray(want_scales))
    np.testing.assert_allclose(np.asarray(planes[:, :, 1]), np.log2(scales64), rtol=2.0 ** -22, atol=2.0 ** -22)
    np.testing.assert_allclose(np.asarray(planes[:, :, 2]), 1.0 / scales64, rtol=2.0 ** -22, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,rows,max_pages,seq_lens,items", PLAN_CASES)
def test_compiled_inputs_and_plan_match_the_separate_launches(batch, rows, max_pages, seq_lens, items):
    q, scale, block_table, offset = random_inputs(batch + rows + 1, batch, rows, max_pages)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    lens = jnp.asarray(seq_lens, jnp.int32)
    inputs = jax.jit(functools.partial(decode_inputs_and_plan, num_items=items, scale_planes=True))(*args, lens)
    assert_same_inputs(inputs, jax.jit(functools.partial(decode_inputs, scale_planes=True))(*args))
    plan = inputs.plan
    want = balanced_plan(lens, num_items=items, step_tokens=STEP, capacity=max_pages * PAGE)
    for got_part, want_part in zip(plan[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,rows,padded", PAD_CASES)
def test_compiled_padding_matches_the_reference(batch, rows, padded):
    q, scale, block_table, offset = random_inputs(batch * rows + padded + 1, batch, rows, 5)
    q_rope = np.random.default_rng(rows + 1).standard_normal((batch, rows, 64)).astype(np.float32)
    args = jnp.asarray(q, jnp.bfloat16), jnp.asarray(scale), jnp.asarray(block_table), jnp.asarray(offset)
    run = functools.partial(decode_inputs, padded_rows=padded, scale_planes=True)
    got = jax.jit(run)(*args, q_rope_rows=jnp.asarray(q_rope))
    want = decode_inputs_reference(*args, q_rope_rows=jnp.asarray(q_rope), padded_rows=padded)
    np.testing.assert_array_equal(np.asarray(got.q_rope, np.float32), np.asarray(want.q_rope, np.float32))
    # The padding rows exactly; the real rows' quantization as test_compiled_inputs_match_the_reference.
    np.testing.assert_array_equal(np.asarray(got.q8[:, rows:].astype(jnp.float32)), 0.0)
    np.testing.assert_array_equal(np.asarray(got.q_scale[:, rows:]), np.asarray(want.q_scale[:, rows:]))
    np.testing.assert_allclose(np.asarray(got.q_scale), np.asarray(want.q_scale), rtol=2e-7)
    g, w = np.asarray(got.q8.astype(jnp.float32)), np.asarray(want.q8.astype(jnp.float32))
    assert np.mean(g == w) > 0.999
    np.testing.assert_allclose(g, w, rtol=2.0 ** -3, atol=2.0 ** -9)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,rows,padded,seq_lens,items", TWIN_CASES)
def test_compiled_twin_rows_and_plan(batch, rows, padded, seq_lens, items):
    q, q_rope = _twin_rows(batch, rows, batch + rows + 1, "float32")
    lens = None if seq_lens is None else jnp.asarray(seq_lens, jnp.int32)
    capacity = None if items is None else 5 * PAGE
    got = jax.jit(functools.partial(bf16_rows_and_plan, padded_rows=padded, num_items=items,
                                    capacity=capacity))(q, q_rope, lens)
    for have, want in ((got.q, pad_rows(q, padded)), (got.q_rope, pad_rows(q_rope, padded))):
        np.testing.assert_array_equal(np.asarray(have, np.float32),
                                      np.asarray(want.astype(jnp.bfloat16), np.float32))
    if items is not None:
        want = balanced_plan(lens, num_items=items, step_tokens=STEP, capacity=capacity)
        for got_part, want_part in zip(got.plan[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))
