"""The BF16 twin on Mosaic GPU: MLA decode over the bf16 latent cache, two consumer warpgroups and a TMA producer.

The baseline the FP8 kernels are measured against should be as good a kernel as
they are (a Triton BF16 twin, since removed, ran the H = 128 shapes at about a third of
its own roofline, one 64 x 512 fp32 output per program in Triton's registers). This
kernel is built like the FP8 Mosaic kernel
(``mla_decode_mgpu``: grid, producer warpgroup, split-KV, outputs) with what
16-bit operands allow, and nothing the FP8 kernel needs for 8-bit ones:

  q_rows       [B, rows, 512] bf16/f32, rows = s_q * H (padded here to whole blocks of 64,
               with the split plan in one launch: ``mgpu_decode_inputs.bf16_rows_and_plan``)
  q_rope_rows  [B, rows, 64]
  cache_arrays (latent [N, 512] bf16, rope [N, 64] bf16), flat rows
  block_table  [B, max_pages] int32 (pages of ``page_size`` = 16, 32 or 64 tokens), seq_lens [B] int32,
  layer_offset [1] int32, a multiple of the page size (layer x pages x page_size)
  -> out [B, rows, 512] (q_rows' dtype), lse [B, rows] f32 (natural log)

Math: ``mla_decode_reference`` over a bf16 cache: scores = (Q.K^T + Qr.Kr^T) *
softmax_scale * log2(e), BF16 wgmma with fp32 accumulation; online softmax on
exp2 in fp32; P rounded to bf16 for the P.V wgmma, fp32 accumulation.

Layout of the work. Grid (work item: a run of steps of one batch row, ``split_plan``; block
of 64 query rows). A step is 64 tokens, one page or 64 / page_size of them: their latent (four
[64, 128] bf16 chunks, 64 KB) and RoPE rows (8 KB) arrive by TMA in a two-slot ring, which with
the bf16 query (72 KB) is what an H100's 227 KB of SMEM holds (a 128-token step would need 144 KB
a slot). Warpgroup w owns output columns [256 w, 256 w + 256) (two fp32
accumulators of 64 x 128, 128 registers a thread) and computes the whole 64 x 64
score tile of the step itself, so the two warpgroups never exchange anything:
each has the same m, l and P, P stays in registers as the A operand of its P.V
wgmmas (16-bit A may come from registers; V [tokens, 128] is the B operand as
stored, 16-bit B may be N-major), and the output accumulates in place (a BF16
wgmma's fp32 accumulator keeps full precision, unlike an FP8 one). The price is
the Q.K product twice (64 x 64 x 576 a warpgroup a step, 1.5x the tensor work of
one Q.K and one P.V); what it buys is two warpgroups that drift freely, so one's
softmax overlaps the other's wgmmas.

Masking: only a row's last step or two (s_q > 1) hold tokens some query row
must not see; they run a second loop with masks. Slots past seq_len may hold any
bytes: their scores are replaced by -inf, and the warpgroup zeroes its V chunks'
rows there before P.V (0 x NaN would poison the sum).

Split-KV and the merge, the producer and its ring, the output staging through
the query's SMEM: as ``mla_decode_mgpu`` (whose helpers this module calls).

Interpreter (``interpret=True``): it takes no wgmma operand from registers and
has no pre-initialised accumulators, so there P goes through an SMEM tile of
the warpgroup's own (16 KB the GPU could not spare) and each step's P.V lands in
a fresh accumulator, added to the rescaled output in registers. Everything else
is the hardware code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.combine_splits import partial_dtype
from snapmla_jax.pallas_kernels.mla_decode_reference import LOG2E, resolve_num_pages
from snapmla_jax.pallas_kernels.mla_decode_mgpu import (BLOCK_M, CHUNK, CHUNKS_PER_WG, NUM_CHUNKS, NUM_SLOTS, NUM_WGS,
                                                        PAGE, ROPE, aligned, balanced_plan_size, check_launch,
                                                        check_registers, grid_params, initial_carry, for_used_items,
                                                        issue_query, locate_cta, merge_items, output_target,
                                                        output_types, padded_rows, plan_items, produce_steps,
                                                        specialize_warpgroups, start_cta, step_page_columns,
                                                        step_visibility, unpadded,
                                                        walk_steps, write_outputs, Where)
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import bf16_rows_and_plan

STEP = PAGE  # tokens a step: one page (see the module docstring)
PAGE_SIZES = (16, 32, PAGE)  # page sizes the twins take: a step holds STEP / page_size pages
COPIES_Q = NUM_CHUNKS + 1  # query chunks, query RoPE part
# Registers a thread for the producer (it only computes TMA addresses) and the two
# consumers (output 128, score tile 32, P 16); within ``check_registers``' budget.
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
# Over pages of fewer tokens than this the issuing warpgroup's four warps share a step's copies,
# a page each in turn (``issue_by_warps``), as the FP8 kernel's producer does
# (``mla_decode_mgpu.producer_by_warps``): a step of 16-token pages is 20 copies against 5 of one
# 64-token page. Shared vs one thread (H200, jax 0.11.2, round-robin, ms a call, the same bits):
# 16-token pages 0.301 vs 0.326 at 64 x 16k x 16 (16-row twin), 0.198 vs 0.203 at 8 x 32k x 128,
# 0.376 vs 0.385 at 32 x 16k x 128; 32-token pages 0.298 vs 0.311, 0.200 vs 0.196, 0.382 vs 0.383,
# so they keep one thread.
ISSUE_BY_WARPS_BELOW = 32


def step_copies(page_size: int) -> int:
    """TMA copies arriving on a slot's barrier a step: latent chunks and RoPE rows of each page."""
    return STEP // page_size * (NUM_CHUNKS + 1)


def issue_by_warps(page_size: int) -> bool:
    """Whether the four warps of the issuing warpgroup share a step's copies over ``page_size``-token
    pages (a page each in turn: ``ISSUE_BY_WARPS_BELOW``)."""
    return page_size < ISSUE_BY_WARPS_BELOW


def step_issuer(bt_ref, lat_ref, rope_ref, b, layer_offset, kv_s, rope_s, step_bar, *, num_pages: int,
                page_size: int = PAGE):
    """``issue(step, slot)``: the TMA of step ``step`` of row b (its STEP / ``page_size`` pages,
    columns past the table's end clamped to its last) into a ring slot, arriving on
    ``step_bar[slot]`` (``step_copies``). Page ids are clipped into [0, num_pages) (a traced
    block table is not validated), as the XLA reference's gather clips them. Over 16-token pages
    the issuing warpgroup's warps take the pages in turn (``issue_by_warps``)."""
    def copy_page(slot, k, start):
        rows, dst = pl.ds(start, page_size), pl.ds(k * page_size, page_size)
        for ch in range(NUM_CHUNKS):
            plgpu.copy_gmem_to_smem(lat_ref.at[rows, pl.ds(ch * CHUNK, CHUNK)], kv_s.at[slot, ch, dst],
                                    step_bar.at[slot])
        plgpu.copy_gmem_to_smem(rope_ref.at[rows], rope_s.at[slot, dst], step_bar.at[slot])

    def issue(step, slot):
        # Page starts computed here: ``pl.multiple_of`` does not lower in a warp's code.
        starts = [aligned(layer_offset + jnp.clip(bt_ref[b, column], 0, num_pages - 1) * page_size, page_size)
                  for column in step_page_columns(step, bt_ref.shape[1], STEP // page_size)]
        if not issue_by_warps(page_size):
            for k, start in enumerate(starts):
                copy_page(slot, k, start)
            return

        def per_warp(warp):
            for k, start in enumerate(starts):
                @pl.when(warp == k % 4)
                def _():
                    copy_page(slot, k, start)

        plgpu.warp_map(per_warp)
    return issue


def step_scores(q_s, qr_s, kv_slot, rope_slot) -> jax.Array:
    """Q.K^T + Qr.Kr^T of a step, f32 [64, 64]: q_s bf16 [4, 64, 128], qr_s [64, 64], kv_slot
    [4, 64, 128], rope_slot [64, 64]; one wgmma chain (bf16 products accumulate in fp32)."""
    def chain(acc_ref):
        for ch in range(NUM_CHUNKS):
            plgpu.wgmma(acc_ref, q_s.at[ch], kv_slot.at[ch].transpose((1, 0)))
        plgpu.wgmma(acc_ref, qr_s, rope_slot.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(chain, plgpu.ACC((BLOCK_M, STEP), jnp.float32))


def zero_past_seq_len(chunk_ref, t0, seq_len) -> None:
    """Rows of a V chunk (SMEM bf16 [64, 128], tokens t0 ...) at or past seq_len set to 0."""
    rows = plgpu.broadcasted_iota(jnp.int32, (STEP, CHUNK), 0, layout=plgpu.Layout.WGMMA)
    v = plgpu.load(chunk_ref, layout=plgpu.Layout.WGMMA)
    chunk_ref[...] = jnp.where(t0 + rows < seq_len, v, jnp.zeros_like(v))


def pv_update(accs, p16, v_chunks, alpha, p_ref=None) -> list:
    """acc * alpha + P.V for each of this warpgroup's accumulators [64, 128] (p16 bf16 [64, 64]
    in registers, v_chunks SMEM bf16 [64, 128]): on the GPU the products accumulate onto the
    rescaled outputs in place. ``p_ref`` (the interpreter's; SMEM bf16 [64, 64]): P goes
    through it and the products into fresh accumulators."""
    alpha_b = lax.broadcast_in_dim(alpha, (BLOCK_M, CHUNK), [0])
    scaled = [acc * alpha_b for acc in accs]

    if p_ref is not None:
        p_ref[...] = p16

        def product(v_chunk, acc_ref):
            plgpu.wgmma(acc_ref, p_ref, v_chunk)
            return acc_ref[...]
        return [acc + pl.run_scoped(functools.partial(product, v), plgpu.ACC((BLOCK_M, CHUNK), jnp.float32))
                for acc, v in zip(scaled, v_chunks)]

    def products(acc_refs):
        for acc_ref, v_chunk in zip(acc_refs, v_chunks):
            plgpu.wgmma(acc_ref, p16, v_chunk)
    return list(pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc in scaled)))


@for_used_items
def _kernel(seq_lens_ref, items_ref, bt_ref, off_ref, q_ref, qr_ref, lat_ref, rope_ref,
            o_ref, lse_ref, part_o_ref, part_lse_ref,
            q_union, qr_s, lse_s, kv_s, rope_s, step_bar, consumed_bar, q_bar, end_bar, *interpreter_p,
            s_q: int, num_heads: int, scale_log2: float, partials: bool, num_pages: int, page_size: int,
            interpret: bool):
    """One CTA: (work item w: a run of steps of batch row b, row block r), consumer warpgroups 0
    and 1 and the producer (wg 2); outputs as ``mla_decode_mgpu.OutputTarget``.

    SMEM: q_union = (q_s bf16 [4, 64, 128] | o_s [2, 64, 128] bf16 or [2, 64, 64]
    f32 output staging, one tile per warpgroup), qr_s bf16 [64, 64], lse_s f32
    [64], kv_s bf16 [2 slots, 4 chunks, 64 tokens, 128], rope_s bf16 [2, 64, 64]; in the
    interpreter only, interpreter_p = (P tiles bf16 [2, 64, 64], one a warpgroup,).
    """
    q_s, o_s = q_union
    where = locate_cta(seq_lens_ref, items_ref, bt_ref, BLOCK_M, s_q=s_q, step_tokens=STEP, page_size=page_size)
    b, wg, _, row0, first_step, num_steps, _ = where
    issue = step_issuer(bt_ref, lat_ref, rope_ref, b, off_ref[0], kv_s, rope_s, step_bar, num_pages=num_pages,
                        page_size=page_size)
    start_cta(wg, first_step, num_steps, issue,
              functools.partial(issue_query, q_ref, qr_ref, None, b, row0, q_s, qr_s, None), q_bar, issuer=NUM_WGS)

    def consume():
        def step(j, carry, *, where: Where, masked: bool):
            accs, m, l = carry[:CHUNKS_PER_WG], carry[-2], carry[-1]
            # The masked tail's ``where`` is ``walk_steps``' relocated one.
            t0 = (where.first_step + j) * STEP
            slot = lax.rem(j, NUM_SLOTS)
            with jax.named_scope("wait_step"):
                plgpu.barrier_wait(step_bar.at[slot])
            with jax.named_scope("qk"):
                scores = step_scores(q_s, qr_s, kv_s.at[slot], rope_s.at[slot]) * scale_log2
            with jax.named_scope("softmax"):
                if masked:  # masked slots may hold any bytes, NaN included
                    visible = step_visibility(row0, t0, where.seq_len, 0, s_q=s_q, num_heads=num_heads,
                                              token_stride=1)
                    scores = jnp.where(visible, scores, -jnp.inf)
                m_new = jnp.maximum(m, scores.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m - m_safe)
                p = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
                l = l * alpha + p.sum(axis=1)
            v_chunks = [kv_s.at[slot, wg * CHUNKS_PER_WG + i] for i in range(CHUNKS_PER_WG)]
            if masked:
                # The other warpgroup may still be reading these chunks as K: it sees either
                # the old bytes or zeros past seq_len, where its scores are -inf either way,
                # and the same bytes below seq_len (rewritten unchanged).
                with jax.named_scope("v_mask"):
                    for v_chunk in v_chunks:
                        zero_past_seq_len(v_chunk, t0, where.seq_len)
                    plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
            with jax.named_scope("pv"):
                p_ref = interpreter_p[0].at[wg] if interpret else None
                new_accs = pv_update(accs, p.astype(jnp.bfloat16), v_chunks, alpha, p_ref)
                plgpu.barrier_arrive(consumed_bar.at[slot])
            return (*new_accs, m_new, l)

        *accs, m, l = walk_steps(step, initial_carry(), where, consumed_bar, issuer=None,
                                 relocate=functools.partial(locate_cta, seq_lens_ref, items_ref, bt_ref, BLOCK_M,
                                                            s_q=s_q, step_tokens=STEP, page_size=page_size))
        # Both warpgroups are past their last Q.K: the query's bytes become the output staging.
        plgpu.barrier_arrive(end_bar)
        plgpu.barrier_wait(end_bar)
        target = output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials)
        write_outputs(accs, m, l, o_s, lse_s, target, row0, wg)

    specialize_warpgroups(wg, functools.partial(produce_steps, issue, first_step, num_steps, consumed_bar), consume,
                          PRODUCER_REGISTERS, CONSUMER_REGISTERS)


def twin_rows_and_plan(q_rows, q_rope_rows, seq_lens, block_table, *, block_rows: int, num_splits: int,
                       balanced: bool, page_size: int, interpret: bool, segments: int = 0) -> tuple:
    """A BF16 twin's inputs: (q [B, P, 512] bf16, q_rope [B, P, 64] bf16, the split plan of
    64-token steps over a table of ``page_size``-token pages), P = rows padded to whole blocks of
    ``block_rows``. Rows short of whole blocks
    are padded (and a balanced plan computed) in one launch, as the FP8 kernels' inputs launch
    does, where XLA would pad q and q_rope in two; whole blocks need at most the plan's launch.
    ``segments`` > 0: a wave plan (``plan_items``), computed apart from the padding."""
    batch, num_rows = q_rows.shape[:2]
    rows = padded_rows(num_rows, block_rows)
    plan_of = functools.partial(plan_items, seq_lens, block_table, num_splits=num_splits, step_tokens=STEP,
                                page_size=page_size, segments=segments, interpret=interpret)
    if rows == num_rows:
        return q_rows.astype(jnp.bfloat16), q_rope_rows.astype(jnp.bfloat16), plan_of(balanced=balanced)
    num_items = balanced_plan_size(batch, num_splits, balanced and not segments)
    with_plan = num_items is not None
    q, q_rope, plan = bf16_rows_and_plan(
        q_rows, q_rope_rows, seq_lens if with_plan else None, padded_rows=rows, num_items=num_items,
        capacity=block_table.shape[1] * page_size if with_plan else None, interpret=interpret)
    return q, q_rope, plan if with_plan else plan_of(balanced=False)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "num_pages", "segments", "interpret"))
def mla_decode_mgpu_bf16(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                         seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                         s_q: int, num_heads: int, num_splits: int = 1, balanced: bool = False,
                         num_pages: int | None = None, segments: int = 0,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """BF16 decode on Mosaic GPU; arguments and results in the module docstring.

    Split-KV as ``mla_decode_mgpu`` (``num_splits`` CTAs a row, or ``balanced``: in proportion
    to the rows' seq_lens, or ``segments``: the batch's steps in equal segments), the partials
    (bf16 for a bf16 output) merged with their log-sum-exp (``combine_splits_mgpu.combine_items_mgpu``). ``num_pages``: pages in one layer of
    the cache (None: all of the arrays' rows); traced page ids are clipped into [0, num_pages)
    and seq_lens into the table's capacity, so that no read leaves the cache. ValueError for
    a cache or row count this kernel does not take.
    """
    check_launch("mla_decode_mgpu_bf16: bf16 cache", q_rows, q_rope_rows, cache_arrays, page_size=page_size,
                 num_arrays=2, block_rows=None, num_splits=num_splits, page_sizes=PAGE_SIZES)
    check_registers(PRODUCER_REGISTERS, CONSUMER_REGISTERS)
    latent, rope = cache_arrays
    num_pages = resolve_num_pages(num_pages, latent.shape[0], page_size)
    q, q_rope, plan = twin_rows_and_plan(q_rows, q_rope_rows, seq_lens, block_table, block_rows=BLOCK_M,
                                         num_splits=num_splits, balanced=balanced, page_size=page_size,
                                         interpret=interpret, segments=segments)
    num_rows = q.shape[1]
    out_dtype = partial_dtype(q_rows.dtype)
    stage_cols = CHUNK * 2 // jnp.dtype(out_dtype).itemsize  # a warpgroup's staging tile: 16 KB
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, num_pages=num_pages, page_size=page_size, interpret=interpret),
        out_type=output_types(plan, num_rows, out_dtype),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_CHUNKS, BLOCK_M, CHUNK), jnp.bfloat16),
                           plgpu.SMEM((NUM_WGS, BLOCK_M, stage_cols), out_dtype)),
            plgpu.SMEM((BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=step_copies(page_size), num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),  # consumed
            plgpu.Barrier(num_arrivals=COPIES_Q),
            plgpu.Barrier(num_arrivals=NUM_WGS),  # end of the step loop
            *([plgpu.SMEM((NUM_WGS, BLOCK_M, STEP), jnp.bfloat16)] if interpret else []),
        ],
        **grid_params(plan, num_rows // BLOCK_M, "snapmla_decode_bf16_mgpu", interpret, num_threads=NUM_WGS + 1),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, q, q_rope, latent, rope)
    out, lse = merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, interpret=interpret)
    return unpadded(out, lse, q_rows.shape[1])
