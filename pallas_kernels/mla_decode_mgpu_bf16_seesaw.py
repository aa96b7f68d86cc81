"""The BF16 twin on Mosaic GPU in 64-row blocks, each page scored once: two warpgroups in a seesaw.

``mla_decode_mgpu_bf16`` has both consumer warpgroups score every page, so that they never
exchange a statistic; its price is Q.K computed twice. Here a step is two pages and each
warpgroup scores one of them, as FlashMLA's BF16 kernel does:

  q_rows       [B, rows, 512] bf16/f32, rows = s_q * H (padded to whole blocks of 64)
  q_rope_rows  [B, rows, 64]
  cache_arrays (latent [N, 512] bf16, rope [N, 64] bf16), flat rows
  block_table  [B, max_pages] int32, seq_lens [B] int32,
  layer_offset [1] int32, a multiple of 64 (layer x pages x 64)
  -> out [B, rows, 512] (q_rows' dtype), lse [B, rows] f32 (natural log)

Math: the BF16 twin's (scores from BF16 wgmmas with fp32 accumulation, online softmax on exp2
in fp32, P rounded to bf16 for the P.V wgmmas, fp32 accumulation in place).

Page w of a step (tokens t0 + 64 w ...) lies in ring slot w; warpgroup w scores it and owns
output features [256 w, 256 w + 256), as in the twin. A step, for warpgroup 0 and 1:

1. S_w = Q.K_w^T over slot w. Warpgroup 0's row max m0 = max(m, max S_0) goes to SMEM;
   warpgroup 1 takes it and publishes m1 = max(m0, max S_1), the step's frame.
2. P_w = exp2(S_w - m_w); each folds its own P_w.V_w (the A operand in registers) into its
   columns. Warpgroup 1's P_1 is already in the step's frame: it stores it (bf16) over slot 1's
   RoPE rows, which only its own Q.K read. Warpgroup 0 rescales P_0 by 2^(m0 - m1) and stores
   it over slot 0's.
3. Each folds the other's P (the SMEM A operand) times V of the other slot into its columns.

So the statistics go one way a step (0 -> 1 -> 0), P crosses once each way, and the tensor work
is one Q.K and one P.V a page. A slot's V chunks of its scorer are released after that
warpgroup's own product, the other two chunks and the RoPE rows after the other warpgroup's,
each half on its own barrier: the producer refills a half as soon as it is free, and a Q.K
takes its own half first.

Masking: the masked tail (a row's last step or two) sets scores past each row's visible length
to -inf and zeroes the V rows past seq_len that the warpgroup multiplies (their bytes may be
NaN; 0 x NaN would poison the sum). l per warpgroup over its own P, added at the end.

Interpreter (``interpret=True``): it takes no wgmma operand from registers and has no
pre-initialised accumulators, so P_w goes through an SMEM tile of the warpgroup's own and each
product into a fresh accumulator, added to the rescaled output in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.combine_splits import partial_dtype
from snapmla_jax.pallas_kernels.mla_decode import LOG2E, resolve_num_pages
from snapmla_jax.pallas_kernels.mla_decode_mgpu import (BLOCK_M, CHUNK, CHUNKS_PER_WG, NUM_CHUNKS, NUM_WGS, PAGE,
                                                        ROPE, ROW, aligned, check_launch, check_registers,
                                                        for_used_items, grid_params, initial_carry, issue_query,
                                                        locate_cta, merge_items, output_target, output_types,
                                                        specialize_warpgroups, start_cta, step_visibility, unpadded,
                                                        walk_steps, write_outputs)
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import (COPIES_Q, CONSUMER_REGISTERS, PRODUCER_REGISTERS,
                                                             pv_update, twin_rows_and_plan, zero_past_seq_len)

STEP = 2 * PAGE  # tokens a step: page w in slot w, scored by warpgroup w
NUM_SLOTS = 2
OWN_COPIES = CHUNKS_PER_WG  # a slot's half for its scorer's columns: two latent chunks
OTHER_COPIES = CHUNKS_PER_WG + 1  # the other two chunks and the RoPE rows (later P of that slot)


def own_chunks(slot) -> list:
    """The latent chunks of ``slot`` that hold V for its scorer's columns (warpgroup ``slot``)."""
    return [slot * CHUNKS_PER_WG + i for i in range(CHUNKS_PER_WG)]


def other_chunks(slot) -> list:
    return [(1 - slot) * CHUNKS_PER_WG + i for i in range(CHUNKS_PER_WG)]


def page_issuer(bt_ref, lat_ref, rope_ref, b, layer_offset, kv_s, rope_s, own_bar, other_bar, *, num_pages: int):
    """(issue_own(step, slot), issue_other(step, slot)): the TMA of one half of page
    2 step + slot of row b into ring slot ``slot`` (``own_chunks``, or ``other_chunks`` and the
    RoPE rows), arriving on that half's barrier. Page ids clipped into [0, num_pages); a page
    past the table (only in a row's last, masked step) is the table's last."""
    max_pages = bt_ref.shape[1]

    def rows(step, slot):
        page = jnp.clip(bt_ref[b, jnp.minimum(2 * step + slot, max_pages - 1)], 0, num_pages - 1)
        return pl.ds(aligned(layer_offset + page * PAGE, PAGE), PAGE)

    def copy_chunk(src_rows, slot, ch, bar):
        plgpu.copy_gmem_to_smem(lat_ref.at[src_rows, pl.ds(ch * CHUNK, CHUNK)], kv_s.at[slot, ch], bar)

    def issue_own(step, slot):
        src = rows(step, slot)
        for ch in own_chunks(slot):
            copy_chunk(src, slot, ch, own_bar.at[slot])

    def issue_other(step, slot):
        src = rows(step, slot)
        for ch in other_chunks(slot):
            copy_chunk(src, slot, ch, other_bar.at[slot])
        plgpu.copy_gmem_to_smem(rope_ref.at[src], rope_s.at[slot], other_bar.at[slot])

    return issue_own, issue_other


def produce_pages(issue_own, issue_other, first_step, num_steps, own_free, other_free) -> None:
    """The producer warpgroup: each half of step j (from 1) into its slot once step j - 1 has
    released it, in the order the consumers release them; then the last step's releases are
    observed (a barrier phase nobody waits for is left dangling)."""
    halves = [(own_free, issue_own, 0), (own_free, issue_own, 1), (other_free, issue_other, 1),
              (other_free, issue_other, 0)]

    def body(j, carry):
        for free, issue, slot in halves:
            plgpu.barrier_wait(free.at[slot])
            issue(first_step + j, slot)
        return carry

    lax.fori_loop(1, num_steps, body, 0)

    @pl.when(num_steps > 0)
    def _():
        for free, _, slot in halves:
            plgpu.barrier_wait(free.at[slot])


def page_scores(q_s, qr_s, kv_slot, rope_slot, wg, own_bar, other_bar) -> jax.Array:
    """Q.K^T + Qr.Kr^T of warpgroup wg's page (slot wg), f32 [64, 64]: q_s bf16 [4, 64, 128], qr_s
    [64, 64], kv_slot [4, 64, 128], rope_slot [64, 64]; one wgmma chain, the slot's own half
    (``own_chunks``) waited for and issued first."""
    def chain(acc_ref):
        plgpu.barrier_wait(own_bar)
        for ch in own_chunks(wg):
            plgpu.wgmma(acc_ref, q_s.at[ch], kv_slot.at[ch].transpose((1, 0)))
        plgpu.barrier_wait(other_bar)
        for ch in other_chunks(wg):
            plgpu.wgmma(acc_ref, q_s.at[ch], kv_slot.at[ch].transpose((1, 0)))
        plgpu.wgmma(acc_ref, qr_s, rope_slot.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(chain, plgpu.ACC((BLOCK_M, PAGE), jnp.float32))


def pv_smem_update(accs, p_ref, v_chunks, ratio, *, interpret: bool) -> list:
    """acc * ratio + P.V for each of this warpgroup's accumulators [64, 128], P the other
    warpgroup's, SMEM bf16 [64, 64] (the A operand as stored), v_chunks SMEM bf16 [64, 128]."""
    ratio_b = lax.broadcast_in_dim(ratio, (BLOCK_M, CHUNK), [0])
    scaled = [acc * ratio_b for acc in accs]
    if interpret:
        def product(v_chunk, acc_ref):
            plgpu.wgmma(acc_ref, p_ref, v_chunk)
            return acc_ref[...]
        return [acc + pl.run_scoped(functools.partial(product, v), plgpu.ACC((BLOCK_M, CHUNK), jnp.float32))
                for acc, v in zip(scaled, v_chunks)]

    def products(acc_refs):
        for acc_ref, v_chunk in zip(acc_refs, v_chunks):
            plgpu.wgmma(acc_ref, p_ref, v_chunk)
    return list(pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc in scaled)))


def frame_safe(m):
    """m where it is finite, else 0: a frame for rows that have seen no token (their P is 0)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


@for_used_items
def _kernel(seq_lens_ref, items_ref, bt_ref, off_ref, q_ref, qr_ref, lat_ref, rope_ref,
            o_ref, lse_ref, part_o_ref, part_lse_ref,
            q_union, qr_s, lse_s, max_s, lsum_s, kv_s, rope_s, own_bar, other_bar, own_free, other_free,
            max_bar, p_bar, q_bar, end_bar, *interpreter_p,
            s_q: int, num_heads: int, scale_log2: float, partials: bool, num_pages: int, interpret: bool):
    """One CTA: (work item w: a run of steps of batch row b, row block r), consumer warpgroups 0
    and 1 and the producer (wg 2); outputs as ``mla_decode_mgpu.OutputTarget``.

    SMEM: q_union = (q_s bf16 [4, 64, 128] | o_s output staging, a tile a warpgroup), qr_s bf16
    [64, 64], lse_s f32 [64], max_s f32 [2, 64] (each warpgroup's frame of the step), lsum_s f32
    [2, 64] (each one's l after the loop), kv_s bf16 [2 slots, 4 chunks, 64 tokens, 128], rope_s
    bf16 [2, 64, 64] (a slot's RoPE rows, then its scorer's P); in the interpreter only,
    interpreter_p = (P tiles bf16 [2, 64, 64], one a warpgroup,).
    """
    q_s, o_s = q_union
    where = locate_cta(seq_lens_ref, items_ref, bt_ref, BLOCK_M, s_q=s_q, step_tokens=STEP)
    b, wg, _, row0, first_step, num_steps, _ = where
    issue_own, issue_other = page_issuer(bt_ref, lat_ref, rope_ref, b, off_ref[0], kv_s, rope_s, own_bar,
                                         other_bar, num_pages=num_pages)

    def issue_step(step, _):
        for slot in range(NUM_SLOTS):
            issue_own(step, slot)
            issue_other(step, slot)

    start_cta(wg, first_step, num_steps, issue_step,
              functools.partial(issue_query, q_ref, qr_ref, None, b, row0, q_s, qr_s, None), q_bar, issuer=NUM_WGS)

    def consume():
        other = 1 - wg
        # Per-row selections between the warpgroups' roles (a traced scalar does not broadcast).
        is_wg1 = plgpu.layout_cast(jnp.full((BLOCK_M,), wg, jnp.int32), ROW) == 1

        def step(j, carry, *, where, masked: bool):
            accs, m, l = carry[:CHUNKS_PER_WG], carry[-2], carry[-1]
            t0 = (where.first_step + j) * STEP
            my_t0 = t0 + wg * PAGE
            with jax.named_scope("qk"):
                scores = page_scores(q_s, qr_s, kv_s.at[wg], rope_s.at[wg], wg, own_bar.at[wg],
                                     other_bar.at[wg]) * scale_log2
            with jax.named_scope("softmax"):
                if masked:  # masked slots may hold any bytes, NaN included
                    visible = step_visibility(row0, my_t0, where.seq_len, 0, s_q=s_q, num_heads=num_heads,
                                              token_stride=1)
                    scores = jnp.where(visible, scores, -jnp.inf)
                page_max = scores.max(axis=1)

                # Warpgroup 1's frame includes warpgroup 0's page (m0, published first).
                @pl.when(wg == 1)
                def _():
                    plgpu.barrier_wait(max_bar.at[0])
                m0 = plgpu.load(max_s.at[0], layout=ROW)
                m_mine = jnp.maximum(jnp.where(is_wg1, jnp.maximum(m, m0), m), page_max)
                max_s[wg] = m_mine
                plgpu.barrier_arrive(max_bar.at[wg])
                m_mine_safe = frame_safe(m_mine)
                alpha = jnp.exp2(m - m_mine_safe)
                p = jnp.exp2(scores - lax.broadcast_in_dim(m_mine_safe, scores.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.bfloat16)

            @pl.when(wg == 1)
            def _():
                # P_1 is in the step's frame already: hand it over before the own product.
                rope_s[1] = p16
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_bar.at[1])

            mine = [kv_s.at[wg, ch] for ch in own_chunks(wg)]
            if masked:
                with jax.named_scope("v_mask"):
                    for v_chunk in mine:
                        zero_past_seq_len(v_chunk, my_t0, where.seq_len)
                    plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
            with jax.named_scope("pv_own"):
                p_ref = interpreter_p[0].at[wg] if interpret else None
                accs = pv_update(accs, p16, mine, alpha, p_ref)
                plgpu.barrier_arrive(own_free.at[wg])

            with jax.named_scope("frame"):
                @pl.when(wg == 0)
                def _():
                    plgpu.barrier_wait(max_bar.at[1])
                m_step = jnp.where(is_wg1, m_mine, plgpu.load(max_s.at[1], layout=ROW))
                ratio = jnp.exp2(m_mine - frame_safe(m_step))

            @pl.when(wg == 0)
            def _():
                rope_s[0] = (p * lax.broadcast_in_dim(ratio, p.shape, [0])).astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_bar.at[0])

            with jax.named_scope("pv_other"):
                plgpu.barrier_wait(p_bar.at[other])  # the other page's P, and its TMA long done
                theirs = [kv_s.at[other, ch] for ch in own_chunks(wg)]
                if masked:
                    for v_chunk in theirs:
                        zero_past_seq_len(v_chunk, t0 + other * PAGE, where.seq_len)
                    plgpu.commit_smem()
                accs = pv_smem_update(accs, rope_s.at[other], theirs, ratio, interpret=interpret)
                plgpu.barrier_arrive(other_free.at[other])
            return (*accs, m_step, l * ratio)

        *accs, m, l = walk_steps(step, initial_carry(), where, None, issuer=None,
                                 relocate=functools.partial(locate_cta, seq_lens_ref, items_ref, bt_ref, BLOCK_M,
                                                            s_q=s_q, step_tokens=STEP))
        lsum_s[wg] = l
        # Both warpgroups are past their last Q.K (the query's bytes become the output staging)
        # and have published their l.
        plgpu.barrier_arrive(end_bar)
        plgpu.barrier_wait(end_bar)
        l = l + plgpu.load(lsum_s.at[other], layout=ROW)
        target = output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials)
        write_outputs(accs, m, l, o_s, lse_s, target, row0, wg)

    specialize_warpgroups(
        wg, functools.partial(produce_pages, issue_own, issue_other, first_step, num_steps, own_free, other_free),
        consume, PRODUCER_REGISTERS, CONSUMER_REGISTERS)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "num_pages", "interpret"))
def mla_decode_mgpu_bf16_seesaw(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple,
                                block_table: jax.Array, seq_lens: jax.Array, layer_offset: jax.Array, *,
                                softmax_scale: float, page_size: int, s_q: int, num_heads: int, num_splits: int = 1,
                                balanced: bool = False, num_pages: int | None = None,
                                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """BF16 decode on Mosaic GPU, each page scored once; arguments, results, split-KV and the
    checks as ``mla_decode_mgpu_bf16``."""
    check_launch("mla_decode_mgpu_bf16_seesaw: bf16 cache", q_rows, q_rope_rows, cache_arrays, page_size=page_size,
                 num_arrays=2, block_rows=None, num_splits=num_splits)
    check_registers(PRODUCER_REGISTERS, CONSUMER_REGISTERS)
    latent, rope = cache_arrays
    num_pages = resolve_num_pages(num_pages, latent.shape[0], page_size)
    q, q_rope, plan = twin_rows_and_plan(q_rows, q_rope_rows, seq_lens, block_table, block_rows=BLOCK_M,
                                         num_splits=num_splits, balanced=balanced, step_tokens=STEP,
                                         interpret=interpret)
    num_rows = q.shape[1]
    out_dtype = partial_dtype(q_rows.dtype)
    stage_cols = CHUNK * 2 // jnp.dtype(out_dtype).itemsize  # a warpgroup's staging tile: 16 KB
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, num_pages=num_pages, interpret=interpret),
        out_type=output_types(plan, num_rows, out_dtype),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_CHUNKS, BLOCK_M, CHUNK), jnp.bfloat16),
                           plgpu.SMEM((NUM_WGS, BLOCK_M, stage_cols), out_dtype)),
            plgpu.SMEM((BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((NUM_WGS, BLOCK_M), jnp.float32),
            plgpu.SMEM((NUM_WGS, BLOCK_M), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, PAGE, CHUNK), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, PAGE, ROPE), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=OWN_COPIES, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=OTHER_COPIES, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_SLOTS),  # own half released
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_SLOTS),  # other half released
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_WGS),  # a warpgroup's frame published
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_WGS),  # a warpgroup's P published
            plgpu.Barrier(num_arrivals=COPIES_Q),
            plgpu.Barrier(num_arrivals=NUM_WGS),  # end of the step loop
            *([plgpu.SMEM((NUM_WGS, BLOCK_M, PAGE), jnp.bfloat16)] if interpret else []),
        ],
        **grid_params(plan, num_rows // BLOCK_M, "snapmla_decode_bf16_seesaw_mgpu", interpret,
                      num_threads=NUM_WGS + 1),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, q, q_rope, latent, rope)
    out, lse = merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, interpret=interpret)
    return unpadded(out, lse, q_rows.shape[1])
