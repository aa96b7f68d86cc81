"""The Mosaic decode kernels' launcher-side inputs and split plan, in one Mosaic GPU launch.

The Mosaic FP8 kernels (mla_decode_mgpu.py, mla_decode_mgpu_small.py) take

  q8      [B, rows, 512] e4m3 and q_scale [B, rows] f32: the query content rows
          quantized per row (``quantize_per_token``), and
  scales  [B, steps * 128] f32: each batch row's token scales in step order
          (``step_token_order``: a TMA cannot read every other float, so they are
          gathered per batch row before the kernel; 8 B a token against the cache's 644 B),
          or with ``scale_planes`` [B, steps, 3, 128]: each step's scales, then their
          base-2 logarithms, then their reciprocals (both of the scales floored at
          ``SCALE_FLOOR``; the 64-row kernel's softmax runs on
          score + log2 k_scale and sums P' / k_scale: ``mla_decode_mgpu.softmax_frame``;
          computed here once a token, 8 B more, instead of 16 ``lg2`` and 16 divisions a
          thread a step on the kernel's path);

and a balanced split plan (``split_plan.balanced_plan``) where a call's rows differ in length.
The BF16 twin takes its query rows padded to whole blocks and the same plan. The 16-row FP8
kernel on bf16 rows of whole blocks needs none of this but the plan: it quantizes its query and
reads the cache's scales itself (``mla_decode_mgpu_small.runs_query_in_kernel``), and a balanced
plan comes from the plan alone (``balanced_plan_kernel``).

Why one launch. In jnp XLA runs these as four launches (the row maxima, the scales, the
quantized rows, the gather) and the plan as three to five more, ~1 us each on an H100 whatever
their size: at short contexts a fifth of a decode call (B=1 x 1k x 16 heads: ~4.6 of 17.6 us;
scripts/profile_decode_launches.py). Here each job is a kind of CTA of one warpgroup in one
1-D grid, in this order:

- plan CTAs (``decode_inputs_and_plan``, ``bf16_rows_and_plan`` with a plan,
  ``balanced_plan_kernel``): the rows' steps and item counts a thread a row, their running sum
  by a scan in SMEM, then each CTA fills a window of 128 values of the plan's items [3 W] (one
  a thread; the last window ends at 3 W, overlapping the one before with the same values) by a
  walk over the rows' ends; the first also stores item_start and item_count [B]. Where 3 W <
  128 one CTA stores the items one at a time.
- row CTAs, a block of 16 query rows each: one bulk TMA copy of the rows to SMEM, then either
  quantized 8 rows at a time (``write_kv.row_layout``: the cache write's registers and math)
  and stored to the padded rows by TMA with their scales, or (the BF16 twin) cast to bf16 and
  stored; the RoPE rows, when asked for, copied along. Blocks past a row's queries store zeros.
- scale CTAs (the FP8 inputs), ``SCALE_STEPS`` steps of a batch row each: one bulk TMA copy a
  page of its 64 token scales (the page id read from the block table), then two steps at a
  time the even and the odd tokens loaded from SMEM through a strided view ([2 steps, 2 pages,
  32 tokens] of one parity: the step order), their logarithms and reciprocals computed, and all
  stored to global memory.

What the launch needs of its inputs: a scale plane of whole 64-token pages and ``layer_offset``
a multiple of 64 (the Mosaic decode kernels' own requirement); query rows that are not whole
16-row blocks are padded by ``jnp.pad`` first (a launch of its own; 16 | s_q x H in the models
served). Block-table entries and the pages they select are clamped into the cache, never read
past it.

Backend: Pallas Mosaic GPU (``plgpu``); interpret mode on the CPU. The references are
``decode_inputs_reference`` and ``split_plan.balanced_plan``, which the tests compare bit for
bit (in interpret mode; on the GPU up to the float32 division's and log2's last bits).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, quantize_per_token, saturate_to_e4m3, scale_of_amax
from snapmla_jax.pallas_kernels.mla_decode_reference import resolve_num_pages
from snapmla_jax.pallas_kernels.split_plan import SplitPlan
from snapmla_jax.pallas_kernels.write_kv import row_layout

PAGE = 64  # the Mosaic kernels' page size
# Page sizes the FP8 kernels take: a step holds STEP / page_size pages.
FP8_PAGE_SIZES = (16, 32, PAGE)
# A page's token scales arrive by a copy of their own, and Pallas' copies move a multiple of 128
# bytes (each of a warpgroup's threads arrives on the barrier with its share): 32 floats. A
# 16-token page's copy takes the next page's 16 scales with its own (``scale_copy_pages``), into
# an SMEM slot of 32 whose first half the readers use.
SCALE_COPY = 32
STEP = 128  # their tokens a step: two pages, even tokens first, then the odd ones
WARPGROUP = 128  # threads of a CTA; values of a plan window
# Rows a plan CTA's thread-a-row arrays hold: seq_lens are read in windows of 128 where B >= 128,
# else one scalar at a time.
WINDOW = WARPGROUP
Q_ROWS = 16  # query rows a row CTA takes
GROUP_ROWS = 8  # rows quantized at a time: 32 values a thread of 512
# Steps a scale CTA gathers at most (16 copies of 64-token pages): on an H200 2 and 16 steps were
# slower than 8 at all seven FP8 shapes probed (B = 64 x 16k x 128 rows: 10.6 and 9.1 us against 8.4).
SCALE_STEPS = 8
# Floor on the token scales behind the logarithm and reciprocal planes (``with_scale_planes``).
# The 64-row kernel's softmax sums P' / k_scale with P' = 2^(score + log2 k_scale - frame + log2
# 448). A slot never written holds scale 0: log2 -inf, 1 / 0 = inf, and 0 * inf = NaN in every
# output row that reads it. Floored, its P' is 2^(score - 60 - frame + log2 448), a normal
# float32 (so its softmax weight counts, as the reference's does) and rounds to 0 in e4m3 beside
# a zero latent. A scale below the floor but not 0 (``quantize_per_token``'s own floor gives
# 2^-108 to an all-zero latent) then carries its value 2^-60 / scale too large: at most
# 2^-60 x 448 in absolute terms. The scales' own plane (the scores' dequantization) stays exact.
SCALE_FLOOR = 2.0 ** -60


def step_token_order(num_tokens: int) -> jax.Array:
    """Token offset held by each SMEM row of a step, for ``num_tokens`` = k * STEP positions.

    Within a step, rows 0..63 hold the even tokens and rows 64..127 the odd ones
    (row c < 64: token 2c; row c >= 64: token 2(c - 64) + 1).
    """
    return _token_at(jnp.arange(num_tokens))


def _token_at(position):
    """The token at step-order ``position`` (any int array): see ``step_token_order``."""
    c = position % STEP
    return position - c + jnp.where(c < STEP // 2, 2 * c, 2 * (c - STEP // 2) + 1)


def num_step_tokens(max_pages: int, page_size: int = PAGE) -> int:
    """Step-ordered positions of a block table with ``max_pages`` pages: whole steps."""
    return pl.cdiv(max_pages * page_size, STEP) * STEP


def step_scales(scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array,
                num_pages: int | None = None, page_size: int = PAGE) -> jax.Array:
    """Token scales [B, steps * 128] f32 of each batch row's pages, in step order (jnp).

    scale [N] f32 (flat cache rows), block_table [B, max_pages] int32 (pages of ``page_size``
    tokens), layer_offset [1] int32, num_pages: pages in one layer (None: N / page_size).
    Positions past the table read its last page (the kernels mask them); page ids are clipped
    into [0, num_pages) and cache rows into [0, N).
    """
    max_pages = block_table.shape[1]
    num_pages = resolve_num_pages(num_pages, scale.shape[0], page_size)
    positions = step_token_order(num_step_tokens(max_pages, page_size))
    columns = jnp.minimum(positions // page_size, max_pages - 1)
    pages = jnp.clip(jnp.take(block_table, columns, axis=1), 0, num_pages - 1)
    return jnp.take(scale, layer_offset[0] + pages * page_size + positions % page_size, mode="clip")


def with_scale_planes(scales: jax.Array) -> jax.Array:
    """Step-ordered scales [B, steps * 128] -> [B, steps, 3, 128]: each step's scales, then
    the base-2 logarithms and the reciprocals of the scales floored at ``SCALE_FLOOR``."""
    by_step = scales.reshape(scales.shape[0], -1, 1, STEP)
    floored = jnp.maximum(by_step, SCALE_FLOOR)
    return jnp.concatenate([by_step, jnp.log2(floored), 1.0 / floored], axis=2)


class DecodeInputs(NamedTuple):
    """The Mosaic FP8 kernels' inputs from one launch (``decode_inputs``), query rows padded to
    P = ``padded_rows`` (the padding rows zero, as ``jnp.pad`` would leave them).

    q8 [B, P, 512] e4m3 and q_scale [B, P] f32: the query rows quantized per row;
    scales [B, steps * 128] f32, or [B, steps, 3, 128] with their base-2 logarithms and
    reciprocals (``scale_planes``): the token scales in step order;
    q_rope [B, P, 64] bf16: the RoPE rows padded, when they were passed (else None);
    plan: the balanced ``SplitPlan``, when ``num_items`` was given (else None).
    """
    q8: jax.Array
    q_scale: jax.Array
    scales: jax.Array
    q_rope: jax.Array | None = None
    plan: SplitPlan | None = None


def pad_rows(rows: jax.Array, padded_rows: int) -> jax.Array:
    """[B, rows, D] -> [B, padded_rows, D], zero rows appended (jnp)."""
    return jnp.pad(rows, [(0, 0), (0, padded_rows - rows.shape[1]), (0, 0)])


def decode_inputs_reference(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array,
                            layer_offset: jax.Array, num_pages: int | None = None, *,
                            scale_planes: bool = False, q_rope_rows: jax.Array | None = None,
                            padded_rows: int | None = None, page_size: int = PAGE) -> DecodeInputs:
    """``decode_inputs`` in jnp (no plan): q_rows [B, rows, 512] (bf16/f32), scale [N] f32,
    block_table [B, max_pages] int32, layer_offset [1] int32, num_pages and page_size
    (``step_scales``), q_rope_rows [B, rows, 64] or None, padded_rows (None: rows) ->
    ``DecodeInputs``."""
    padded_rows = q_rows.shape[1] if padded_rows is None else padded_rows
    q8, q_scale = quantize_per_token(pad_rows(q_rows, padded_rows).astype(jnp.float32))
    scales = step_scales(scale, block_table, layer_offset, num_pages, page_size)
    q_rope = None if q_rope_rows is None else pad_rows(q_rope_rows, padded_rows).astype(jnp.bfloat16)
    return DecodeInputs(q8, q_scale, with_scale_planes(scales) if scale_planes else scales, q_rope)


# ---------------------------------------------------------------------------------------------
# The launch's parts


class Parts(NamedTuple):
    """What one launch computes (static): ``num_items`` (the plan's W, or None), ``rows`` ("quantize":
    the FP8 kernels' q8 and q_scale; "copy": the twin's bf16 rows; None), ``rope`` (copy the
    RoPE rows too), ``scales`` (None, "flat" or "planes")."""
    num_items: int | None
    rows: str | None
    rope: bool
    scales: str | None


def _cdiv(a, b):
    """ceil(a / b) of non-negative int32 a (scalar or array) and positive b."""
    return lax.div(a + (b - 1), jnp.asarray(b, jnp.int32))


def scale_steps(num_steps: int) -> int:
    """Steps a scale CTA gathers: the largest power of two up to ``SCALE_STEPS`` dividing
    ``num_steps`` (even)."""
    block = SCALE_STEPS
    while num_steps % block:
        block //= 2
    return block


def scale_copy_pages(page_size: int) -> int:
    """Pages of scales one copy of a page's scales moves (``SCALE_COPY``): 2 for 16-token pages
    (the page and the next, whose scales are not read), else 1."""
    return max(SCALE_COPY // page_size, 1)


def even_steps(max_pages: int, page_size: int = PAGE) -> int:
    """Steps the scale CTAs fill for a table of ``max_pages`` pages of ``page_size`` tokens: whole
    steps, rounded up to an even count (a CTA stores two steps at a time)."""
    steps = pl.cdiv(max_pages * page_size, STEP)
    return steps + steps % 2


def plan_windows(num_items: int) -> int:
    """Plan CTAs of a plan of W items: 128-value windows of its [3 W] items, or one CTA storing
    them one at a time where 3 W < 128."""
    return pl.cdiv(3 * num_items, WARPGROUP) if 3 * num_items >= WARPGROUP else 1


# ---------------------------------------------------------------------------------------------
# The plan


def _seq_lens_chunks(seq_lens_ref, lens_s, iota, zeros) -> list:
    """seq_lens [B] int32 (global) as thread-a-row arrays of 128 rows (values past B unset): from
    SMEM lens_s [Bp] filled by windows of 128 (the last one ending at B) where B >= 128, else
    gathered in registers one scalar load and select a row."""
    batch = seq_lens_ref.shape[0]
    if batch < WINDOW:
        lens = zeros
        for b in range(batch):
            lens = jnp.where(iota == b, zeros + seq_lens_ref[b], lens)
        return [lens]
    layout = plgpu.Layout.WG_STRIDED((WINDOW,), 1)
    for c in range(pl.cdiv(batch, WINDOW)):
        start = min(c * WINDOW, batch - WINDOW)
        lens_s[pl.ds(start, WINDOW)] = plgpu.load(seq_lens_ref.at[pl.ds(start, WINDOW)], layout=layout)
    plgpu.commit_smem()  # the windows' stores before the chunks' loads (no automatic barriers)
    return [lens_s[pl.ds(c * WINDOW, WINDOW)] for c in range(pl.cdiv(batch, WINDOW))]


def _unroll(n: int) -> int:
    """Iterations of a loop of ``n`` unrolled together: Mosaic GPU unrolls by divisors only."""
    return next(u for u in (8, 4, 2, 1) if n % u == 0)


def _plan_cta(seq_lens_ref, items_ref, start_ref, count_ref, lens_s, scan_s, end_s, count_s, cta, *,
              num_items: int, capacity: int, step_tokens: int):
    """Plan CTA ``cta``: items_ref [3 W] (row, split, count planes), start_ref and count_ref [B]
    int32 (CTA 0), seq_lens_ref [B] int32. SMEM: lens_s, end_s and count_s [Bp] int32 (B rounded
    up to 128), scan_s [256] int32. The rule of ``split_plan.balanced_plan``: the rows' steps and
    counts a thread a row, their running sum by a scan in SMEM, then each item's row found by a
    walk over the rows' ends."""
    batch = seq_lens_ref.shape[0]
    chunks = pl.cdiv(batch, WINDOW)
    layout = plgpu.Layout.WG_STRIDED((WINDOW,), 1)
    iota = plgpu.broadcasted_iota(jnp.int32, (WINDOW,), 0, layout=layout)
    zeros = plgpu.layout_cast(jnp.zeros((WINDOW,), jnp.int32), layout)
    lens = _seq_lens_chunks(seq_lens_ref, lens_s, iota, zeros)
    real = [iota + c * WINDOW < batch for c in range(chunks)]  # rows past B: no steps, no items
    steps = [jnp.where(real[c], _cdiv(jnp.clip(lens[c], 0, capacity), step_tokens), zeros) for c in range(chunks)]
    total = jnp.int32(0)
    for c in range(chunks):
        total = total + jnp.sum(steps[c])
        plgpu.commit_smem()  # the reduction's scratch read by all before the next one writes it
    per_item = jnp.maximum(1, _cdiv(total, num_items - batch))
    scan_s[pl.ds(0, WINDOW)] = zeros  # the scan reads up to 64 values before the first
    carry = jnp.int32(0)
    for c in range(chunks):
        count = jnp.where(real[c], jnp.maximum(1, _cdiv(steps[c], per_item)), zeros)
        running = count  # Hillis-Steele: after round r each value sums the 2^(r+1) up to it
        for r in range(7):
            scan_s[pl.ds(WINDOW, WINDOW)] = running
            plgpu.commit_smem()
            running = running + scan_s[pl.ds(WINDOW - 2 ** r, WINDOW)]
            plgpu.commit_smem()  # every read done before the next round's stores
        end_s[pl.ds(c * WINDOW, WINDOW)] = running + carry
        count_s[pl.ds(c * WINDOW, WINDOW)] = count
        carry = carry + jnp.sum(count)
        plgpu.commit_smem()

    @pl.when(cta == 0)
    def _():
        if batch >= WINDOW:
            for c in range(chunks):
                rows = pl.ds(min(c * WINDOW, batch - WINDOW), WINDOW)
                start_ref[rows] = end_s[rows] - count_s[rows]
                count_ref[rows] = count_s[rows]
        else:
            for b in range(batch):
                start_ref[b] = end_s[b] - count_s[b]
                count_ref[b] = count_s[b]

    flat = 3 * num_items
    if flat < WARPGROUP:
        _store_items_one_at_a_time(items_ref, end_s, count_s, batch=batch, num_items=num_items)
        return
    window = jnp.minimum(cta * WARPGROUP, flat - WARPGROUP)
    position = window + iota
    plane = lax.div(position, jnp.int32(num_items))
    item = position - plane * num_items

    def row(b, carry):  # the carried arrays keep one layout and signedness: scalars enter as zeros + scalar
        row_of, split_of, count_of_item = carry
        end, count = end_s[b], count_s[b]
        start = end - count
        mine = (item >= start) & (item < end)
        return (jnp.where(mine, zeros + b, row_of), jnp.where(mine, item - start, split_of),
                jnp.where(mine, zeros + count, count_of_item))

    row_of, split_of, count_of_item = lax.fori_loop(0, batch, row, (zeros, zeros, zeros), unroll=_unroll(batch))
    items_ref[pl.ds(window, WARPGROUP)] = jnp.where(plane == 0, row_of, jnp.where(plane == 1, split_of,
                                                                                   count_of_item))


def _store_items_one_at_a_time(items_ref, end_s, count_s, *, batch: int, num_items: int) -> None:
    """The items of a plan of 3 W < 128 values, stored one scalar at a time: each row's run, then
    zeros in the unused items."""
    def row(b, carry):
        end, count = end_s[b], count_s[b]

        def item(j, carry):
            items_ref[end - count + j] = b
            items_ref[num_items + end - count + j] = j
            items_ref[2 * num_items + end - count + j] = count
            return carry

        lax.fori_loop(0, count, item, None)
        return carry

    lax.fori_loop(0, batch, row, None)

    def unused(w, carry):
        for plane in range(3):
            items_ref[plane * num_items + w] = 0
        return carry

    lax.fori_loop(end_s[batch - 1], num_items, unused, None)


# ---------------------------------------------------------------------------------------------
# Query rows


def by_row(scale, shape, layout, interpret: bool):
    """scale [rows] broadcast along the rows of ``shape`` in ``layout``. The interpreter's is
    ``fp8.quantize_with_scale``'s ``scale[..., None]``: XLA on the CPU turns x / layout_cast(
    broadcast(scale)) into x * (1 / scale), one float32 rounding off the division's (a q8 value
    at an e4m3 rounding midpoint then rounds the other way)."""
    if interpret:
        return scale[:, None]
    return plgpu.layout_cast(lax.broadcast_in_dim(scale, shape, [0]), layout)


def quantized_rows(chunks: list, layout, interpret: bool) -> tuple:
    """Rows quantized per row, ``fp8.quantize_per_token``'s math in registers: chunks, float32
    [rows, W] each in ``layout``, together a row's values -> (their e4m3 values chunk for chunk,
    a generator: each is computed when the caller takes it, as it stores them; the rows' scales
    [rows]). A row's amax is exact whatever the chunking."""
    scale = scale_of_amax(functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1) for x in chunks]))
    return (saturate_to_e4m3(x / by_row(scale, x.shape, layout, interpret)) for x in chunks), scale


def _row_cta(q_ref, qr_ref, q_out_ref, qsc_ref, qr_out_ref, q_s, q8_s, qsc_s, qr_s, qr_stage, bar, b, j, *,
             num_rows: int, padded_rows: int, quantize: bool, interpret: bool):
    """Rows [16 j, 16 j + 16) of batch row b: q_ref [B * rows, 512] (whole) -> q_out_ref [B * P,
    512] (e4m3 with ``quantize``, else bf16) and qsc_ref [B * P] f32; with qr_ref [B * rows, 64],
    qr_out_ref [B * P, 64] bf16. Blocks from rows / 16 on are padding: zero rows (q_scale the
    quantizer's floor scale, as for any zero row)."""
    real = j * Q_ROWS < num_rows
    source = pl.ds(b * num_rows + jnp.minimum(j, num_rows // Q_ROWS - 1) * Q_ROWS, Q_ROWS)
    target = pl.ds(b * padded_rows + j * Q_ROWS, Q_ROWS)
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # whole rows: one bulk copy, no tensor map

    @pl.when(real)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[source], q_s, bar, oob_mode=in_bounds)
        if qr_ref is not None:
            plgpu.copy_gmem_to_smem(qr_ref.at[source], qr_s, bar, oob_mode=in_bounds)
        plgpu.barrier_wait(bar)

    @pl.when(jnp.logical_not(real))
    def _():
        q_s[...] = jnp.zeros(q_s.shape, q_s.dtype)
        if qr_ref is not None:
            qr_s[...] = jnp.zeros(qr_s.shape, qr_s.dtype)
        plgpu.commit_smem()  # the zeros before the loads of other threads

    layout = row_layout(q_s.shape[1], q_s.dtype)
    for g in range(Q_ROWS // GROUP_ROWS):
        rows = pl.ds(g * GROUP_ROWS, GROUP_ROWS)
        x = plgpu.load(q_s.at[rows], layout=layout).astype(jnp.float32)
        if quantize:
            (q8,), scale = quantized_rows([x], layout, interpret)
            q8_s[rows, :] = q8
            qsc_s[rows] = scale
        else:
            q8_s[rows, :] = x.astype(q8_s.dtype)
    if qr_stage is not None:
        qr_stage[...] = qr_s[...].astype(jnp.float32).astype(qr_stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q8_s, q_out_ref.at[target], commit_group=False)
    if quantize:
        plgpu.copy_smem_to_gmem(qsc_s, qsc_ref.at[target], commit_group=False)
    if qr_ref is not None:
        plgpu.copy_smem_to_gmem(qr_s if qr_stage is None else qr_stage, qr_out_ref.at[target], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads


# ---------------------------------------------------------------------------------------------
# Token scales


def _scale_cta(scale_ref, bt_ref, off_ref, steps_ref, in_s, bar, b, block, *, num_steps: int, num_pages: int,
               interpret: bool):
    """Steps [n i, n i + n) of batch row b, n = ``num_steps`` (even), i = ``block``, over pages of
    S tokens (S = 16, 32 or 64; k = 128 / S of them a step).

    scale_ref [N / S, S] f32: the scale plane by page; bt_ref [B, max_pages] int32; off_ref
    [1] int32 (a multiple of S); steps_ref [B, steps, 2, k, S / 2]
    (parity, page, token pair: the step order) or [B, steps, 3, 2, k, S / 2] (each step's scales,
    their base-2 logarithms and their reciprocals, both of the scales floored at
    ``SCALE_FLOOR``); in_s: SMEM [n, k, c, S] f32 (step, page, copied page, token: c =
    ``scale_copy_pages``, the first the page's own); bar: its barrier (k n arrivals).
    ``interpret``: the parities taken apart from a whole load (the interpreter does not reshape
    refs)."""
    max_pages, page_size = bt_ref.shape[1], scale_ref.shape[1]
    per_step, copied = STEP // page_size, scale_copy_pages(page_size)
    first_page = lax.div(off_ref[0], jnp.int32(page_size))
    last_page = scale_ref.shape[0] - 1
    for k in range(per_step * num_steps):
        index = jnp.minimum(block * per_step * num_steps + k, max_pages - 1)
        page = jnp.clip(first_page + jnp.clip(bt_ref[b, index], 0, num_pages - 1), 0, last_page)
        # The last page's copy of two runs past the plane: the copy stops at its end.
        plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(page, copied)], in_s.at[k // per_step, k % per_step], bar,
                                oob_mode=plgpu.OOBFillMode.ZEROS if copied > 1 else
                                plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
    plgpu.barrier_wait(bar)
    pairs = page_size // 2
    layout = plgpu.Layout.WG_STRIDED((2, per_step, pairs), 1)
    # [step, page, copied page, pair, parity]
    by_parity = None if interpret else in_s.reshape(num_steps, per_step, copied, pairs, 2)
    planes = steps_ref.ndim == 6
    for pair in range(num_steps // 2):
        steps = pl.ds(block * num_steps + 2 * pair, 2)
        for parity in range(2):
            if interpret:
                values = in_s[pl.ds(2 * pair, 2)][:, :, 0].reshape(2, per_step, pairs, 2)[..., parity]
            else:
                values = plgpu.load(by_parity.at[pl.ds(2 * pair, 2), :, 0, :, parity], layout=layout)
            if not planes:
                steps_ref[b, steps, parity] = values
                continue
            floored = jnp.maximum(values, SCALE_FLOOR)
            steps_ref[b, steps, 0, parity] = values
            steps_ref[b, steps, 1, parity] = jnp.log2(floored)
            steps_ref[b, steps, 2, parity] = 1.0 / floored


# ---------------------------------------------------------------------------------------------
# The launch


def _kernel_name(parts: Parts) -> str:
    """The launch's name in profiles: the FP8 inputs, the twin's rows, or the plan alone."""
    if parts.rows == "quantize" or parts.scales:
        return "snapmla_mgpu_decode_inputs"
    return "snapmla_mgpu_bf16_rows" if parts.rows else "snapmla_split_plan"


class Outputs(NamedTuple):
    """A launch's outputs (None where its ``Parts`` leave them out): q8 [B, P, 512] (e4m3, or bf16
    rows of the twin), q_scale [B, P] f32, scales [B, steps, 128] or [B, steps, 3, 128] f32,
    q_rope [B, P, 64] bf16, and the plan's items [3, W], item_start and item_count [B] int32."""
    q8: jax.Array | None
    q_scale: jax.Array | None
    scales: jax.Array | None
    q_rope: jax.Array | None
    items: jax.Array | None
    item_start: jax.Array | None
    item_count: jax.Array | None


def _launch(parts: Parts, *, q_rows=None, q_rope_rows=None, scale=None, block_table=None, layer_offset=None,
            seq_lens=None, padded_rows: int = 0, num_pages: int = 0, page_size: int = PAGE, capacity: int = 0,
            step_tokens: int = STEP, interpret: bool = False) -> Outputs:
    """One launch of ``parts``: q_rows [B, rows, 512] (rows a multiple of 16) and q_rope_rows [B,
    rows, 64] any float dtype, padded to ``padded_rows``; scale [N] f32 (N a multiple of
    ``page_size``), block_table [B, max_pages] int32, layer_offset [1] int32 (a multiple of
    ``page_size``), ``num_pages`` pages a layer; seq_lens [B] int32, the table's ``capacity`` in
    tokens and the plan's ``step_tokens`` for the plan. Shapes are checked by the public launches
    below."""
    batch = (q_rows if q_rows is not None else seq_lens).shape[0]
    plan_ctas = plan_windows(parts.num_items) if parts.num_items is not None else 0
    row_ctas = padded_rows // Q_ROWS if parts.rows else 0
    num_steps = even_steps(block_table.shape[1], page_size) if parts.scales else 0
    cta_steps = scale_steps(num_steps) if parts.scales else 0
    scale_ctas = num_steps // cta_steps if parts.scales else 0

    quantize = parts.rows == "quantize"
    rope_stage = parts.rope and q_rope_rows.dtype != jnp.bfloat16
    operands, out_type, scratch = [], [], []
    if parts.num_items is not None:
        operands.append(seq_lens)
        out_type += [jax.ShapeDtypeStruct((3 * parts.num_items,), jnp.int32),
                     jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)]
        rows_padded = pl.cdiv(batch, WINDOW) * WINDOW
        scratch += [plgpu.SMEM((rows_padded,), jnp.int32), plgpu.SMEM((2 * WINDOW,), jnp.int32),
                    plgpu.SMEM((rows_padded,), jnp.int32), plgpu.SMEM((rows_padded,), jnp.int32)]
    if parts.rows:
        num_rows = q_rows.shape[1]
        operands.append(q_rows.reshape(batch * num_rows, -1))
        out_dtype = FP8_DTYPE if quantize else jnp.bfloat16
        out_type.append(jax.ShapeDtypeStruct((batch * padded_rows, q_rows.shape[2]), out_dtype))
        if quantize:
            out_type.append(jax.ShapeDtypeStruct((batch * padded_rows,), jnp.float32))
        scratch += [plgpu.SMEM((Q_ROWS, q_rows.shape[2]), q_rows.dtype),
                    plgpu.SMEM((Q_ROWS, q_rows.shape[2]), out_dtype), plgpu.SMEM((Q_ROWS,), jnp.float32)]
        if parts.rope:
            operands.append(q_rope_rows.reshape(batch * num_rows, -1))
            out_type.append(jax.ShapeDtypeStruct((batch * padded_rows, q_rope_rows.shape[2]), jnp.bfloat16))
            scratch.append(plgpu.SMEM((Q_ROWS, q_rope_rows.shape[2]), q_rope_rows.dtype))
            if rope_stage:  # RoPE rows cast to bf16 before their store
                scratch.append(plgpu.SMEM((Q_ROWS, q_rope_rows.shape[2]), jnp.bfloat16))
        scratch.append(plgpu.Barrier(num_arrivals=2 if parts.rope else 1))
    if parts.scales:
        per_step = STEP // page_size
        operands += [scale.reshape(-1, page_size), block_table, layer_offset]
        planes = (3,) if parts.scales == "planes" else ()
        out_type.append(jax.ShapeDtypeStruct((batch, num_steps, *planes, 2, per_step, page_size // 2), jnp.float32))
        scratch += [plgpu.SMEM((cta_steps, per_step, scale_copy_pages(page_size), page_size), jnp.float32),
                    plgpu.Barrier(num_arrivals=per_step * cta_steps)]

    def body(*refs):
        refs = list(refs)
        ins = [refs.pop(0) for _ in operands]
        outs = [refs.pop(0) for _ in out_type]
        cta = lax.axis_index("cta")
        if parts.num_items is not None:
            seq_lens_ref = ins.pop(0)
            items_ref, start_ref, count_ref = outs[:3]
            del outs[:3]
            plan_s = refs[:4]
            del refs[:4]

            @pl.when(cta < plan_ctas)
            def _():
                _plan_cta(seq_lens_ref, items_ref, start_ref, count_ref, *plan_s, cta, num_items=parts.num_items,
                          capacity=capacity, step_tokens=step_tokens)
        if parts.rows:
            q_ref = ins.pop(0)
            q_out_ref = outs.pop(0)
            qsc_ref = outs.pop(0) if quantize else None
            q_s, q8_s, qsc_s = refs[:3]
            del refs[:3]
            qr_ref = qr_out_ref = qr_s = qr_stage = None
            if parts.rope:
                qr_ref, qr_out_ref, qr_s = ins.pop(0), outs.pop(0), refs.pop(0)
                qr_stage = refs.pop(0) if rope_stage else None
            bar = refs.pop(0)
            index = cta - plan_ctas

            @pl.when((index >= 0) & (index < batch * row_ctas))
            def _():
                _row_cta(q_ref, qr_ref, q_out_ref, qsc_ref, qr_out_ref, q_s, q8_s, qsc_s, qr_s, qr_stage, bar,
                         lax.div(index, row_ctas), lax.rem(index, row_ctas), num_rows=num_rows,
                         padded_rows=padded_rows, quantize=quantize, interpret=interpret)
        if parts.scales:
            scale_ref, bt_ref, off_ref = ins
            (steps_ref,) = outs
            in_s, bar = refs
            index = cta - plan_ctas - batch * row_ctas

            @pl.when(index >= 0)
            def _():
                _scale_cta(scale_ref, bt_ref, off_ref, steps_ref, in_s, bar, lax.div(index, scale_ctas),
                           lax.rem(index, scale_ctas), num_steps=cta_steps, num_pages=num_pages,
                           interpret=interpret)

    grid = plan_ctas + batch * (row_ctas + scale_ctas)
    results = list(plgpu.kernel(body, out_type=tuple(out_type), scratch_types=tuple(scratch), grid=(grid,),
                                grid_names=("cta",), kernel_name=_kernel_name(parts),
                                # Lane semantics: the layouts above are given, not inferred. No
                                # automatic barriers (one before and after every store, scalar
                                # ones included): ``commit_smem`` where a thread reads what
                                # another stored to SMEM.
                                compiler_params=plgpu.CompilerParams(
                                    lowering_semantics=plgpu.LoweringSemantics.Lane,
                                    unsafe_no_auto_barriers=True),
                                interpret=plgpu.InterpretGPUParams() if interpret else None)(*operands))
    items = start = count = q8 = q_scale = q_rope = scales = None
    if parts.num_items is not None:
        items, start, count = results[:3]
        items = items.reshape(3, parts.num_items)
        del results[:3]
    if parts.rows:
        q8 = results.pop(0).reshape(batch, padded_rows, -1)
        q_scale = results.pop(0).reshape(batch, padded_rows) if quantize else None
        if parts.rope:
            q_rope = results.pop(0).reshape(batch, padded_rows, -1)
    if parts.scales:
        real_steps = pl.cdiv(block_table.shape[1] * page_size, STEP)
        scales = results.pop(0).reshape(batch, num_steps, *((3,) if parts.scales == "planes" else ()), STEP)
        if real_steps != num_steps:  # an odd step count: the last pair's second step is not the table's
            scales = scales[:, :real_steps]
        if parts.scales == "flat":
            scales = scales.reshape(batch, real_steps * STEP)
    return Outputs(q8, q_scale, scales, q_rope, items, start, count)


# ---------------------------------------------------------------------------------------------
# The launches callers make


def _check_rows(q_rows, q_rope_rows, padded_rows: int) -> None:
    batch, num_rows, rank = q_rows.shape
    if num_rows < 1:
        raise ValueError(f"q_rows: expected at least one query row, got shape {q_rows.shape}")
    if padded_rows < num_rows or padded_rows % Q_ROWS:
        raise ValueError(f"padded_rows: expected a multiple of {Q_ROWS} of at least q_rows' {num_rows} rows, "
                         f"got {padded_rows}")
    if q_rope_rows is not None and (q_rope_rows.ndim != 3 or q_rope_rows.shape[:2] != (batch, num_rows)):
        raise ValueError(f"q_rope_rows: expected shape ({batch}, {num_rows}, D) like q_rows, got {q_rope_rows.shape}")


def _check_plan(seq_lens, num_items: int) -> None:
    if seq_lens is None or seq_lens.ndim != 1 or seq_lens.dtype != jnp.int32:
        got = None if seq_lens is None else f"{seq_lens.dtype}{list(seq_lens.shape)}"
        raise ValueError(f"seq_lens: expected a 1-d int32 array, got {got}")
    if num_items <= seq_lens.shape[0]:
        raise ValueError(f"num_items: expected more items than batch rows ({seq_lens.shape[0]}), got {num_items}")


def _whole_row_blocks(q_rows, q_rope_rows):
    """q_rows [B, rows, D] (and q_rope_rows, or None) with zero rows appended up to a multiple of
    16 rows (``jnp.pad``, a launch of its own, only where rows are not already whole blocks)."""
    whole = pl.cdiv(q_rows.shape[1], Q_ROWS) * Q_ROWS
    if whole == q_rows.shape[1]:
        return q_rows, q_rope_rows
    return pad_rows(q_rows, whole), None if q_rope_rows is None else pad_rows(q_rope_rows, whole)


def _plan_of(out: Outputs) -> SplitPlan | None:
    """The ``SplitPlan`` of a launch's outputs (None without one)."""
    return None if out.items is None else SplitPlan(out.items, out.item_start, out.item_count)


def _fp8_inputs(q_rows, scale, block_table, layer_offset, seq_lens, q_rope_rows, *, num_items: int | None,
                padded_rows: int | None, num_pages, page_size: int, scale_planes: bool,
                interpret: bool) -> DecodeInputs:
    """``decode_inputs`` and, with ``num_items``, its plan: the arguments checked, then one launch."""
    padded_rows = pl.cdiv(q_rows.shape[1], Q_ROWS) * Q_ROWS if padded_rows is None else padded_rows
    _check_rows(q_rows, q_rope_rows, padded_rows)
    if num_items is not None:
        _check_plan(seq_lens, num_items)
    if page_size not in FP8_PAGE_SIZES:
        raise ValueError(f"page_size: expected one of {FP8_PAGE_SIZES}, got {page_size!r}")
    if scale.shape[0] % page_size:
        raise ValueError(f"scale: expected whole {page_size}-token pages (N a multiple of {page_size}), "
                         f"got N = {scale.shape[0]}")
    num_pages = resolve_num_pages(num_pages, scale.shape[0], page_size)
    q_rows, q_rope_rows = _whole_row_blocks(q_rows, q_rope_rows)
    out = _launch(Parts(num_items, "quantize", q_rope_rows is not None, "planes" if scale_planes else "flat"),
                  q_rows=q_rows, q_rope_rows=q_rope_rows, scale=scale, block_table=block_table,
                  layer_offset=layer_offset, seq_lens=seq_lens, padded_rows=padded_rows, num_pages=num_pages,
                  page_size=page_size, capacity=block_table.shape[1] * page_size, interpret=interpret)
    return DecodeInputs(out.q8, out.q_scale, out.scales, out.q_rope, _plan_of(out))


@functools.partial(jax.jit, static_argnames=("padded_rows", "num_pages", "page_size", "scale_planes", "interpret"))
def decode_inputs(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array, *,
                  q_rope_rows: jax.Array | None = None, padded_rows: int | None = None,
                  num_pages: int | None = None, page_size: int = PAGE, scale_planes: bool = False,
                  interpret: bool = False) -> DecodeInputs:
    """``decode_inputs_reference`` in one launch: q_rows [B, rows, 512], scale [N] f32 (N a
    multiple of ``page_size``: 16, 32 or 64), block_table [B, max_pages] int32, layer_offset [1]
    int32 (a multiple of page_size), q_rope_rows [B, rows, 64] or None, padded_rows: the rows of
    the outputs (a multiple of 16, at least rows; None: rows rounded up to one), num_pages: pages
    in one layer (None: N / page_size) -> ``DecodeInputs`` (plan None). ValueError for arguments
    that disagree (named in the message).

    Padding here (the kernels take rows in blocks of 16 or 64) saves the call the XLA pads of
    q and q_rope, a launch each (2-3 us on an H100 at 64 x 32 rows)."""
    return _fp8_inputs(q_rows, scale, block_table, layer_offset, None, q_rope_rows, num_items=None,
                       padded_rows=padded_rows, num_pages=num_pages, page_size=page_size, scale_planes=scale_planes,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_items", "padded_rows", "num_pages", "page_size", "scale_planes",
                                             "interpret"))
def decode_inputs_and_plan(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array,
                           seq_lens: jax.Array, *, num_items: int, q_rope_rows: jax.Array | None = None,
                           padded_rows: int | None = None, num_pages: int | None = None, page_size: int = PAGE,
                           scale_planes: bool = False, interpret: bool = False) -> DecodeInputs:
    """``decode_inputs`` and the balanced split plan of seq_lens [B] int32 in W = ``num_items``
    items of 128-token steps (``split_plan.balanced_plan`` with the table's capacity) in the same
    launch: one launch a decode call fewer. Returns ``DecodeInputs`` with its plan; ValueError
    also for seq_lens not 1-d int32 or W <= B."""
    return _fp8_inputs(q_rows, scale, block_table, layer_offset, seq_lens, q_rope_rows, num_items=num_items,
                       padded_rows=padded_rows, num_pages=num_pages, page_size=page_size, scale_planes=scale_planes,
                       interpret=interpret)


class TwinInputs(NamedTuple):
    """The BF16 twin's query rows padded to P rows in one launch (``bf16_rows_and_plan``)."""
    q: jax.Array  # [B, P, 512] bf16
    q_rope: jax.Array  # [B, P, 64] bf16
    plan: SplitPlan | None  # the balanced plan, when ``num_items`` was given


@functools.partial(jax.jit, static_argnames=("padded_rows", "num_items", "capacity", "interpret"))
def bf16_rows_and_plan(q_rows: jax.Array, q_rope_rows: jax.Array, seq_lens: jax.Array | None = None, *,
                       padded_rows: int, num_items: int | None = None, capacity: int | None = None,
                       interpret: bool = False) -> TwinInputs:
    """The BF16 twin's inputs in one launch: q_rows [B, rows, 512] and q_rope_rows [B, rows, 64]
    (bf16/f32) cast to bf16 and padded with zero rows to ``padded_rows`` (a multiple of 16, at
    least rows), and with ``num_items`` the balanced split plan of seq_lens [B] int32 over a
    block table of ``capacity`` tokens. Where XLA pads q and q_rope in a launch each (and the
    plan takes its own)."""
    _check_rows(q_rows, q_rope_rows, padded_rows)
    if (num_items is None) != (capacity is None) or (num_items is not None and seq_lens is None):
        raise ValueError("num_items: a plan needs num_items, capacity and seq_lens together, got "
                         f"num_items={num_items!r}, capacity={capacity!r}, seq_lens {'given' if seq_lens is not None else None}")
    if num_items is not None:
        _check_plan(seq_lens, num_items)
    q_rows, q_rope_rows = _whole_row_blocks(q_rows, q_rope_rows)
    out = _launch(Parts(num_items, "copy", True, None), q_rows=q_rows, q_rope_rows=q_rope_rows, seq_lens=seq_lens,
                  padded_rows=padded_rows, capacity=capacity or 0, interpret=interpret)
    return TwinInputs(out.q8, out.q_rope, _plan_of(out))


@functools.partial(jax.jit, static_argnames=("num_items", "step_tokens", "capacity", "interpret"))
def balanced_plan_kernel(seq_lens: jax.Array, *, num_items: int, step_tokens: int, capacity: int,
                         interpret: bool = False) -> SplitPlan:
    """``split_plan.balanced_plan`` (the same arguments, the same values) in one launch of plan
    CTAs: seq_lens [B] int32 -> SplitPlan(items int32 [3, W], item_start [B], item_count [B]).
    Where no other inputs launch runs (the BF16 twin on rows of whole blocks). In jnp XLA runs
    the plan as three to five launches, ~1.1-2 us each on an H100.

    Raises ValueError unless seq_lens is a 1-d int32 array and W (``num_items``) > B.
    """
    _check_plan(seq_lens, num_items)
    return _plan_of(_launch(Parts(num_items, None, False, None), seq_lens=seq_lens, capacity=capacity,
                            step_tokens=step_tokens, interpret=interpret))
