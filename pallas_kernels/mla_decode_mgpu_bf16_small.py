"""The BF16 twin on Mosaic GPU in blocks of 16 query rows, transposed products.

``mla_decode_mgpu_bf16`` puts a CTA's query rows on the wgmma M dimension, 64 a block: at
H = 16 (s_q = 1) 48 of them are padding, and 4x the tensor work of the real rows goes into
Q.K. Here, as in the FP8 ``mla_decode_mgpu_small``, the 16 query rows are the N dimension and
tokens or features are M:

  q_rows       [B, rows, 512] bf16, rows = s_q * H (padded here to whole blocks of 16, with the
               split plan in one launch: ``mgpu_decode_inputs.bf16_rows_and_plan``)
  q_rope_rows  [B, rows, 64] bf16
  cache_arrays (latent [N, 512] bf16, rope [N, 64] bf16), flat rows
  block_table  [B, max_pages] int32 (pages of ``page_size`` = 16, 32 or 64 tokens), seq_lens [B] int32,
  layer_offset [1] int32, a multiple of the page size (layer x pages x page_size)
  -> out [B, rows, 512] bf16, lse [B, rows] f32 (natural log)

Math: the BF16 twin's (``mla_decode_mgpu_bf16``): scores (Q.K^T + Qr.Kr^T) * softmax_scale *
log2(e) from BF16 wgmmas with fp32 accumulation, the online softmax on exp2 in fp32, P rounded
to bf16 for the P.V wgmma, fp32 accumulation in place (a BF16 wgmma's accumulator keeps full
precision).

A step is 64 tokens, one page or 64 / page_size of them (their latent, four [64, 128] bf16
chunks, and RoPE rows) in a
two-slot ring; warpgroup 1 issues the copies, a page ahead (``begin_page``), so the CTA has no
producer warpgroup (its accumulators are 32 registers a thread, there is nothing to give up). Each warpgroup:

* S^T = K.Q^T, f32 [64 tokens, 16]: A = the K tile as the TMA lays it, B = the query chunk
  through ``.transpose``. Both warpgroups score the whole page (at 16 rows Q.K is a ninth of
  the 64-row twin's tensor work, and the call is bound by HBM), so they never exchange a
  statistic: each has the same m, l and P.
* The online softmax per column (query row), reducing along the tokens through a scratch of
  its own (``mla_decode_mgpu_small.token_reduce``); l stays per token slot until the loop ends.
* O^T += V^T.P^T, four [64 features, 16] tiles (output features [256 w, 256 w + 256)): A = V^T,
  the ring's chunk transposed in the wgmma's descriptor (16-bit operands may be), B = P^T, which
  each warpgroup stores into its own [16, 64] tile with transposed (``stmatrix.trans``) stores.

Masking, the V rows past seq_len zeroed, split-KV and the merge: as ``mla_decode_mgpu_bf16``.
The outputs leave through each warpgroup's [16, 64] staging tile, transposed stores again.

Interpreter (``interpret=True``): it has no pre-initialised accumulators, so each step's P.V
lands in fresh accumulators, added to the rescaled output in registers.

SMEM: ring 2 x 72 KB, query 18 KB, P 2 x 2 KB, staging 2 x 2 KB, reduction scratch 2 x 2 KB:
about 172 KB.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.mla_decode_reference import LOG2E, resolve_num_pages
from snapmla_jax.pallas_kernels.mla_decode_mgpu import (CHUNK, CHUNKS_PER_WG, HALF, NUM_CHUNKS, NUM_SLOTS, NUM_WGS,
                                                        PAGE, ROPE, check_launch, for_used_items, grid_params,
                                                        initial_carry, issue_query, locate_cta, merge_items,
                                                        output_target, output_types, start_cta, unpadded, walk_steps,
                                                        write_lse_and_wait, Where)
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import (COPIES_Q, PAGE_SIZES, step_copies, step_issuer,
                                                             twin_rows_and_plan, zero_past_seq_len)
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import ISSUER, reduce_scratch_size, token_reduce, visibility_t
from snapmla_jax.pallas_kernels.mgpu_bytes import output_transforms

ROWS = 16  # query rows a CTA: the wgmma N of every product
STEP = PAGE  # tokens a step: one page
# Output tiles a warpgroup: [64 features, ROWS] each, features 256 w + 64 k + (0..63) in tile k.
TILES_PER_WG = CHUNKS_PER_WG * CHUNK // HALF


def page_scores_t(q_s, qr_s, kv_slot, rope_slot) -> jax.Array:
    """K.Q^T + Kr.Qr^T of a page, f32 [64 tokens, R]: q_s bf16 [4, R, 128], qr_s [R, 64],
    kv_slot [4, 64, 128], rope_slot [64, 64]; one wgmma chain."""
    def chain(acc_ref):
        for ch in range(NUM_CHUNKS):
            plgpu.wgmma(acc_ref, kv_slot.at[ch], q_s.at[ch].transpose((1, 0)))
        plgpu.wgmma(acc_ref, rope_slot, qr_s.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(chain, plgpu.ACC((STEP, q_s.shape[1]), jnp.float32))


def pv_update_t(accs, p_ref, kv_slot, wg, alpha, *, interpret: bool) -> list:
    """acc * alpha + V^T.P^T for each of this warpgroup's O^T tiles [64 features, R]
    (``TILES_PER_WG``): p_ref bf16 [R, 64] (P, this warpgroup's copy) is the K-major B operand
    through ``.transpose``, V^T the ring's chunk [64 tokens, 128] sliced and transposed. On the
    GPU the products accumulate onto the rescaled tiles in place; the interpreter's land in
    fresh accumulators."""
    scaled = [acc * lax.broadcast_in_dim(alpha, acc.shape, [1]) for acc in accs]
    vt = [kv_slot.at[wg * CHUNKS_PER_WG + k // 2, :, pl.ds((k % 2) * HALF, HALF)].transpose((1, 0))
          for k in range(len(accs))]
    if interpret:
        def product(a_operand, acc_ref):
            plgpu.wgmma(acc_ref, a_operand, p_ref.transpose((1, 0)))
            return acc_ref[...]
        return [acc + pl.run_scoped(functools.partial(product, a), plgpu.ACC(acc.shape, jnp.float32))
                for acc, a in zip(scaled, vt)]

    def products(acc_refs):
        for acc_ref, a_operand in zip(acc_refs, vt):
            plgpu.wgmma(acc_ref, a_operand, p_ref.transpose((1, 0)))
    return list(pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc in scaled)))


def begin_page(j, wg, first_step, num_steps, issue, step_bar, consumed_bar):
    """Warpgroup ``ISSUER`` issues page j + 1 into the other slot once both warpgroups have
    consumed page j - 1 there, then every warpgroup waits for page j's slot; returns it.

    ``mla_decode_mgpu.begin_step`` with the two in the other order: here the next page's copies
    do not wait for the current page's arrival, so two pages are in flight from the first step
    on. Measured against that order it made no difference (H200, 1 x 1k x 16: 0.0125 vs 0.0124
    ms a call); the benchmark pages were measured with this one."""
    slot = lax.rem(j, NUM_SLOTS)

    @pl.when((wg == ISSUER) & (j + 1 < num_steps))
    def _():
        @pl.when(j >= 1)
        def _():
            plgpu.barrier_wait(consumed_bar.at[1 - slot])  # page j - 1's P.V by both warpgroups
        issue(first_step + j + 1, 1 - slot)

    plgpu.barrier_wait(step_bar.at[slot])
    return slot


def write_outputs_t(accs, m, l, o_s, lse_s, target, row0, wg) -> None:
    """This warpgroup's output features of rows row0 .. row0 + R (its O^T tiles / l) and, from
    warpgroup 0, the rows' lse, to ``target`` (``mla_decode_mgpu.OutputTarget``), each tile
    through o_s[wg] ([R, 64], transposed stores); call after the step loop."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    my_o = o_s.at[wg]
    for k, acc in enumerate(accs):
        if k:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile has left the staging tile
        normalised = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [1])
        my_o.transpose((1, 0))[...] = normalised.astype(my_o.dtype)
        plgpu.commit_smem()
        col0 = wg * CHUNKS_PER_WG * CHUNK + k * HALF
        target.copy(my_o, False, pl.ds(row0, my_o.shape[0]), pl.ds(col0, HALF))
    write_lse_and_wait(wg, m, l_safe, seen, lse_s, target, row0)


@for_used_items
def _kernel(seq_lens_ref, items_ref, bt_ref, off_ref, q_ref, qr_ref, lat_ref, rope_ref,
            o_ref, lse_ref, part_o_ref, part_lse_ref,
            q_s, qr_s, lse_s, kv_s, rope_s, p_s, red_s, o_s, step_bar, consumed_bar, q_bar,
            *, s_q: int, num_heads: int, scale_log2: float, partials: bool, num_pages: int, page_size: int,
            interpret: bool):
    """One CTA: (work item w: a run of pages of batch row b, block of R query rows), warpgroups 0
    and 1; outputs as ``mla_decode_mgpu.OutputTarget``.

    SMEM: q_s bf16 [4, R, 128], qr_s bf16 [R, 64], lse_s f32 [R], kv_s bf16 [2 slots, 4 chunks,
    64 tokens, 128] and rope_s bf16 [2, 64, 64] (the ring), p_s bf16 [2, R, 64] (each
    warpgroup's P), red_s f32 [2, ``reduce_scratch_size``] (each warpgroup's reduction scratch),
    o_s bf16 [2, R, 64] (each warpgroup's output staging).

    Slot reuse: warpgroup ``ISSUER`` refills a slot (``begin_page``) once both warpgroups have
    arrived at consumed_bar for it, after their P.V of that slot has been waited for (the
    products are read back into registers before the arrival).
    """
    rows = q_s.shape[1]
    where = locate_cta(seq_lens_ref, items_ref, bt_ref, rows, s_q=s_q, step_tokens=STEP, page_size=page_size)
    b, wg, _, row0, first_step, num_steps, _ = where
    issue = step_issuer(bt_ref, lat_ref, rope_ref, b, off_ref[0], kv_s, rope_s, step_bar, num_pages=num_pages,
                        page_size=page_size)
    start_cta(wg, first_step, num_steps, issue,
              functools.partial(issue_query, q_ref, qr_ref, None, b, row0, q_s, qr_s, None), q_bar, issuer=ISSUER)
    my_scratch, my_p = red_s.at[wg], p_s.at[wg]

    def step(j, carry, *, where: Where, masked: bool):
        accs, (m, l_tile) = carry[:-2], carry[-2:]
        t0 = (where.first_step + j) * STEP
        slot = begin_page(j, wg, where.first_step, where.num_steps, issue, step_bar, consumed_bar)
        scores = page_scores_t(q_s, qr_s, kv_s.at[slot], rope_s.at[slot]) * scale_log2
        if masked:  # masked slots may hold any bytes, NaN included
            visible = visibility_t(row0, t0, where.seq_len, 0, s_q=s_q, num_heads=num_heads, rows=rows,
                                   token_stride=1)
            scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, token_reduce(scores, "max", my_scratch, interpret=interpret))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no token seen yet: P is 0
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [1]))
        l_tile = l_tile * lax.broadcast_in_dim(alpha, scores.shape, [1]) + p
        if masked:
            # The other warpgroup may still read these chunks as K: it sees the old bytes or
            # zeros past seq_len, where its scores are -inf either way, and the same bytes below.
            for i in range(CHUNKS_PER_WG):
                zero_past_seq_len(kv_s.at[slot, wg * CHUNKS_PER_WG + i], t0, where.seq_len)
        my_p.transpose((1, 0))[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()  # P (and the zeroed V rows) before the products (the async proxy) read them
        new_accs = pv_update_t(accs, my_p, kv_s.at[slot], wg, alpha, interpret=interpret)
        plgpu.barrier_arrive(consumed_bar.at[slot])
        return (*new_accs, m_new, l_tile)

    *accs, m0, _ = initial_carry((HALF, rows), rows_axis=1, num_accs=TILES_PER_WG)
    l_tile0 = plgpu.layout_cast(jnp.zeros((STEP, rows), jnp.float32), plgpu.Layout.WGMMA)
    carry = walk_steps(step, (*accs, m0, l_tile0), where, consumed_bar, issuer=ISSUER)
    accs, m, l_tile = carry[:TILES_PER_WG], carry[-2], carry[-1]
    l = token_reduce(l_tile, "add", my_scratch, interpret=interpret)
    target = output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials)
    write_outputs_t(accs, m, l, o_s, lse_s, target, row0, wg)


def takes(q_dtype) -> bool:
    """Whether ``mla_decode_mgpu_bf16_small`` takes query rows of ``q_dtype``: bf16 ones (its output
    and split partials are bf16; a 32-bit transposed store does not lower)."""
    return jnp.dtype(q_dtype) == jnp.bfloat16


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "num_pages", "segments", "interpret"))
def mla_decode_mgpu_bf16_small(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple,
                               block_table: jax.Array, seq_lens: jax.Array, layer_offset: jax.Array, *,
                               softmax_scale: float, page_size: int, s_q: int, num_heads: int,
                               num_splits: int = 1, balanced: bool = False, num_pages: int | None = None,
                               segments: int = 0, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """BF16 decode in 16-row blocks on Mosaic GPU; arguments and results in the module docstring,
    split-KV (``segments`` included), ``num_pages`` and the clipping of traced inputs as
    ``mla_decode_mgpu_bf16``. ValueError for a cache, row count or query dtype this kernel does not take."""
    check_launch("mla_decode_mgpu_bf16_small: bf16 cache", q_rows, q_rope_rows, cache_arrays, page_size=page_size,
                 num_arrays=2, block_rows=None, num_splits=num_splits, page_sizes=PAGE_SIZES)
    if not takes(q_rows.dtype):
        raise ValueError(f"q_rows: mla_decode_mgpu_bf16_small takes bfloat16 rows, got {q_rows.dtype}")
    latent, rope = cache_arrays
    num_pages = resolve_num_pages(num_pages, latent.shape[0], page_size)
    q, q_rope, plan = twin_rows_and_plan(q_rows, q_rope_rows, seq_lens, block_table, block_rows=ROWS,
                                         num_splits=num_splits, balanced=balanced, page_size=page_size,
                                         interpret=interpret, segments=segments)
    rows = q.shape[1]
    # P's and the staging tiles: 128-byte rows, swizzled as the ring's chunks (a wgmma's two
    # operands share their swizzle) and as the output's TMA reads them.
    tile_transforms = () if interpret else output_transforms(jnp.bfloat16)
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, num_pages=num_pages, page_size=page_size, interpret=interpret),
        out_type=output_types(plan, rows, jnp.bfloat16),
        scratch_types=[
            plgpu.SMEM((NUM_CHUNKS, ROWS, CHUNK), jnp.bfloat16),
            plgpu.SMEM((ROWS, ROPE), jnp.bfloat16),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_WGS, ROWS, STEP), jnp.bfloat16, transforms=tile_transforms),
            plgpu.SMEM((NUM_WGS, reduce_scratch_size(ROWS)), jnp.float32),
            plgpu.SMEM((NUM_WGS, ROWS, HALF), jnp.bfloat16, transforms=tile_transforms),
            plgpu.Barrier(num_arrivals=step_copies(page_size), num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),  # consumed (both warpgroups)
            plgpu.Barrier(num_arrivals=COPIES_Q),
        ],
        # Its reductions across warps bring their own scratch (``token_reduce``).
        **grid_params(plan, rows // ROWS, "snapmla_decode_bf16_mgpu_small", interpret, reduction_scratch_bytes=0),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, q, q_rope, latent, rope)
    out, lse = merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, interpret=interpret)
    return unpadded(out, lse, q_rows.shape[1])
