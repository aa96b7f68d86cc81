"""SnapMLA FP8 MLA decode on Mosaic GPU with the score tile split between the two warpgroups.

Status (2026-11-23): EXPERIMENTAL. Lowers for CUDA and matches
``mla_decode_reference`` in the Mosaic GPU interpreter; never run on a GPU
(written after the session's device time ran out). Not reachable from
``snapmla_jax.mla_decode``; ``scripts/bench_mgpu.py`` times it beside
``mla_decode_mgpu``. Same arguments, results and math as ``mla_decode_mgpu``
(read its docstring first); this file changes who computes what.

Why. In ``mla_decode_mgpu`` both warpgroups compute the whole 64 x 128 score
tile of a step: the Q.K product is done twice (two thirds of the CTA's MMA
work) and so is the softmax, and the score tile, its promotion accumulator and
two 64 x 128 output accumulators do not fit 255 registers (1-1.4 KB of spills
a thread on an H100). Here, as in FlashMLA, warpgroup w scores only the step's
SMEM rows [64 w, 64 w + 64) (w = 0: the even tokens, 1: the odd ones), so each
computes half the Q.K product and half the softmax, and holds a 64 x 64 score
tile (32 registers) instead of 64 x 128.

What crosses between the warpgroups, per step, through SMEM:

1. Row statistics (``stats_s``, 2 x 2 x 64 f32 a slot): each warpgroup's row
   max of its scores (base 2) and row max of score + log2(token scale). Both
   then hold the step's row max m and pv_max = exp2(max(score + log2 k_scale)
   - m), which equals max over the step's 128 tokens of P * k_scale (up to
   exp2/log2 rounding; the e4m3 conversion saturates at 448). So m, alpha and
   the P' factor are the same in both warpgroups, as their accumulators (two
   column halves of one output) require. The running l stays per warpgroup
   and is summed once, after the loop.
2. P' bytes (``xb``, e4m3 [2, 64, 64] a slot, aliasing the step's RoPE slot,
   which is free once both warpgroups have passed the step's ``qk_done``
   barrier): each warpgroup stores its 64 columns, then each interleaves both
   halves into its own uint16 word tile (word k = tokens 2k and 2k + 1 =
   column k of each half), the A operand of its P'.V wgmmas, exactly as in
   ``mla_decode_mgpu``.

Everything else (TMA ring, V^T in place, split-KV, masks only in the last
steps, fp32 promotion of Q.K every 128 features, output staging) is
``mla_decode_mgpu``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from pallas_kernels.mgpu_bytes import interleave_bytes
from pallas_kernels.mla_decode import MIN_PV_ROW_MAX
from pallas_kernels.mla_decode_mgpu import (BLOCK_M, CHUNKS_PER_WG, HALF, NUM_SLOTS, NUM_WGS, ROPE, STEP, _aligned,
                                            begin_step, cta_steps, drain_consumed, initial_carry, launch, pv_update,
                                            start_cta, step_issuer, step_scores, step_visibility, v_operands_in_place,
                                            write_outputs)

ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector with one value per score row
COL = plgpu.Layout.WGMMA.reduce(0)  # a [64] vector with one value per score column


def local_stats(scores, k_scale, scale_log2: float, visible=None):
    """A warpgroup's half of a step: (scores in base 2 [64, 64], invisible columns at -inf;
    row max [64]; row max of score + log2 k_scale [64], the log of the row's largest P * k_scale
    before the max is subtracted)."""
    scores = scores * scale_log2
    if visible is not None:  # masked slots may hold any bytes, NaN included
        scores = jnp.where(visible, scores, -jnp.inf)
    log_scaled = scores + lax.broadcast_in_dim(jnp.log2(k_scale), scores.shape, [1])
    if visible is not None:
        log_scaled = jnp.where(visible, log_scaled, -jnp.inf)  # a garbage scale's log could be NaN
    return scores, scores.max(axis=1), log_scaled.max(axis=1)


def softmax_half(scores, k_scale, m, l_part, row_max, log_pv_max, visible=None):
    """Online softmax of a warpgroup's 64 columns given the step's row statistics over all 128.

    scores [64, 64] base 2 (``local_stats``), k_scale [64], running m and this
    warpgroup's partial l [64], row_max and log_pv_max [64] over both halves.
    Returns (m_new, alpha, l_part_new, P' * 448 / pv_max f32 [64, 64], pv_max [64]).
    """
    m_new = jnp.maximum(m, row_max)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
    l_part = l_part * alpha + p.sum(axis=1)
    pv = p * lax.broadcast_in_dim(k_scale, scores.shape, [1])
    if visible is not None:
        pv = jnp.where(visible, pv, 0.0)  # 0 * a garbage scale could be NaN
    pv_max = jnp.exp2(log_pv_max - m_safe)
    factor = FP8_E4M3_MAX / jnp.maximum(pv_max, MIN_PV_ROW_MAX)
    return m_new, alpha, l_part, pv * lax.broadcast_in_dim(factor, pv.shape, [0]), pv_max


def _kernel(seq_lens_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref,
            q_union, qr_s, qsc_s, lse_s, kv_union, rope_union, ksc_s, p_union, stats_s, lsum_s,
            step_bar, qk_done_bar, stats_bar, pexch_bar, consumed_bar, q_bar, end_bar,
            *, s_q: int, num_heads: int, scale_log2: float, num_splits: int, interpret: bool):
    """One CTA: (batch row b, KV split s, row block r), two warpgroups.

    SMEM as ``mla_decode_mgpu._kernel``'s, plus: rope_union = (rope_s bf16 [2,
    128, 64] | xb e4m3 [2 slots, 2 warpgroups, 64, 64]: the P' byte halves),
    stats_s f32 [2 slots, 2 warpgroups, 2, 64] (row max, log pv max), lsum_s
    f32 [2, 64] (the partial l of each warpgroup, after the loop).
    """
    b = lax.axis_index("b")
    split = lax.axis_index("s")
    r = lax.axis_index("r")
    wg = lax.axis_index("wg")
    q8_s, o_s = q_union
    kv8_s, kv16_s = kv_union
    rope_s, xb = rope_union
    p16_s, p8_s = p_union
    seq_len = seq_lens_ref[b]
    layer_offset = off_ref[0]
    first_step, num_steps, unmasked_steps = cta_steps(seq_len, split, s_q=s_q, num_splits=num_splits)
    row0 = _aligned(r * BLOCK_M, BLOCK_M)
    my_rows = _aligned(wg * HALF, HALF)  # this warpgroup's half of each step's SMEM rows
    issue = step_issuer(bt_ref, latp_ref, ropep_ref, ksc_ref, b, layer_offset, kv8_s, rope_s, ksc_s, step_bar)
    start_cta(wg, first_step, num_steps, issue, (q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s), q_bar)
    q_scale = plgpu.load(qsc_s, layout=ROW)
    my_p8 = p8_s.at[wg]

    def step(j, carry, *, masked: bool):
        accs, m, l_part = carry[:CHUNKS_PER_WG], carry[-2], carry[-1]
        t0 = (first_step + j) * STEP
        slot = begin_step(j, wg, first_step, num_steps, issue, step_bar, consumed_bar)

        k_scale = plgpu.load(ksc_s.at[slot, pl.ds(my_rows, HALF)], layout=COL)
        [scores] = step_scores(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot], q_scale, [k_scale],
                               interpret=interpret, first_rows=(my_rows,))
        plgpu.barrier_arrive(qk_done_bar.at[slot])

        visible = step_visibility(row0, t0, seq_len, wg, s_q=s_q, num_heads=num_heads) if masked else None
        scores, row_max, log_pv_max = local_stats(scores, k_scale, scale_log2, visible)
        stats_s[slot, wg, 0] = row_max
        stats_s[slot, wg, 1] = log_pv_max
        plgpu.barrier_arrive(stats_bar.at[slot])
        plgpu.barrier_wait(stats_bar.at[slot])
        other = 1 - wg
        row_max = jnp.maximum(row_max, plgpu.load(stats_s.at[slot, other, 0], layout=ROW))
        log_pv_max = jnp.maximum(log_pv_max, plgpu.load(stats_s.at[slot, other, 1], layout=ROW))
        m_new, alpha, l_part, p_scaled, pv_max = softmax_half(scores, k_scale, m, l_part, row_max, log_pv_max,
                                                              visible)

        # Both warpgroups are past their QK: the RoPE slot takes the P' bytes, and
        # my latent chunks become their V^T.
        plgpu.barrier_wait(qk_done_bar.at[slot])
        xb[slot, wg] = jnp.minimum(p_scaled, FP8_E4M3_MAX).astype(FP8_DTYPE)
        v_operands = v_operands_in_place(kv8_s, kv16_s, slot, wg, t0, seq_len, masked=masked, interpret=interpret)
        plgpu.barrier_arrive(pexch_bar.at[slot])
        plgpu.barrier_wait(pexch_bar.at[slot])
        if not interpret:
            # Word k of a row: tokens 2k (warpgroup 0's column k) and 2k + 1.
            p16_s[wg] = interleave_bytes(plgpu.load(xb.at[slot, 0], layout=plgpu.Layout.WGMMA),
                                         plgpu.load(xb.at[slot, 1], layout=plgpu.Layout.WGMMA))
        else:
            for half in range(NUM_WGS):
                my_p8[:, pl.ds(half * HALF, HALF)] = xb[slot, half]
        plgpu.commit_smem()  # generic-proxy stores (P', V^T) -> visible to wgmma
        new_accs = pv_update(accs, my_p8, v_operands, alpha, pv_max)
        plgpu.barrier_arrive(consumed_bar.at[slot])
        return (*new_accs, m_new, l_part)

    carry = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), initial_carry())
    *accs, m, l_part = lax.fori_loop(unmasked_steps, num_steps, functools.partial(step, masked=True), carry)
    drain_consumed(wg, num_steps, consumed_bar)
    lsum_s[wg] = l_part
    # Both warpgroups are past their last QK (Q8's bytes become the output
    # staging) and have published their partial l.
    plgpu.barrier_arrive(end_bar)
    plgpu.barrier_wait(end_bar)
    write_outputs(accs, m, l_part + plgpu.load(lsum_s.at[1 - wg], layout=ROW), o_s, lse_s, o_ref, lse_ref, b, split,
                  row0, wg)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "interpret"))
def mla_decode_mgpu_split(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                          seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                          s_q: int, num_heads: int, num_splits: int = 1,
                          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 decode, score tile split between the warpgroups; arguments and results as ``mla_decode_mgpu``."""
    return launch(_kernel, "snapmla_decode_fp8_mgpu_split", q_rows, q_rope_rows, cache_arrays, block_table,
                  seq_lens, layer_offset, softmax_scale=softmax_scale, page_size=page_size, s_q=s_q,
                  num_heads=num_heads, num_splits=num_splits, interpret=interpret,
                  rope_scratch=plgpu.RefUnion(plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
                                              plgpu.SMEM((NUM_SLOTS, NUM_WGS, BLOCK_M, HALF), FP8_DTYPE)),
                  extra_scratch=[plgpu.SMEM((NUM_SLOTS, NUM_WGS, 2, BLOCK_M), jnp.float32),
                                 plgpu.SMEM((NUM_WGS, BLOCK_M), jnp.float32)],
                  extra_barriers=2)
