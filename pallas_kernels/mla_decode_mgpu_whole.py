"""SnapMLA FP8 MLA decode on Mosaic GPU, each consumer warpgroup scoring the whole step: P' stays in registers.

A candidate layout for the 64-row FP8 kernel (``mla_decode_mgpu``, whose
docstring describes the inputs, the step order, the TMA ring, V^T and the
masking, all shared). What differs is who computes what within a step:

* There, warpgroup w scores only its half of the step's 128 tokens (SMEM rows
  [64 w, 64 w + 64)); the two exchange row statistics through SMEM, then each
  stores its P' bytes into a shared tile both multiply: three meetings a step,
  and 0.6k of the step's ~7.9k SM cycles in byte stores (sixteenth-session
  profile, docs/mosaic_gpu_decode_plan.md).
* Here each warpgroup scores all 128 tokens itself, as two 64 x 64 tiles (the
  step's even tokens, rows 0..63, and its odd ones, rows 64..127; each with the
  same promoted FP8 chains and RoPE product as there). Both then hold the same
  m, l and P' factor, computed without an exchange, and P' never leaves
  registers: ``interleave_columns`` packs the two tiles' e4m3 bytes into the
  8-bit A operand of the P'.V wgmma (one ``prmt`` a register, in the token
  order V^T has: byte 2k of a V^T row is step row k, byte 2k + 1 row 64 + k).
  The price is the FP8 Q.K product twice (the tensor cores' cheapest work) and
  a 64 x 128 softmax a warpgroup instead of 64 x 64.

What still crosses: before a warpgroup overwrites its own latent chunks with
their V^T, the other one must have read them as K (``qk_done``, as there);
it arrives there right after its Q.K, and the softmax lies between, so the
two may drift by about a softmax. The producer warpgroup, the ring, split-KV
and the output staging are the 64-row kernel's.

Row statistics: m and pv_max come straight from the 128 scores of a row (the
64-row kernel derives pv_max from a log2 of the token scales, so that it can
exchange it with m in one meeting); this is ``mla_decode_reference``'s
formulation, so ``mla_decode_reference(..., block_n=128)`` is the reference.

Registers: the output half (64 x 256 fp32, 128 a thread), the two score tiles
(32 each) while the second one's two promoted chains run (32 each): ~224 at the
peak, within the consumers' 240.

Interpreter: it takes no wgmma A operand from registers and does not alias the
``RefUnion`` views, so P' goes through an SMEM tile of the warpgroup's own in
step order and V stays token-major, as in the 64-row kernel's interpreter path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from pallas_kernels.mgpu_bytes import interleave_columns
from pallas_kernels.mla_decode import LOG2E, MIN_PV_ROW_MAX, resolve_num_pages
from pallas_kernels.mla_decode_mgpu import (BLOCK_M, CHUNK, CHUNKS_PER_WG, COPIES_Q, COPIES_STEP, COL, HALF,
                                            NUM_CHUNKS, NUM_SLOTS, NUM_WGS, PRODUCER_ISSUE_BY_WARPS,
                                            PRODUCER_REGISTERS, CONSUMER_REGISTERS, RANK, ROPE, ROW, STEP,
                                            begin_cta, check_registers, grid_params, initial_carry, merge_splits,
                                            prepare_inputs, produce_steps, pv_update, specialize_warpgroups,
                                            step_scores, step_visibility, v_operands_in_place, walk_steps,
                                            write_outputs)

# Whether the two warpgroups take turns at their Q.K products (FA3's ping-pong): warpgroup
# 1 starts its Q.K of a step once warpgroup 0's has completed, so that one's softmax runs
# beside the other's wgmmas instead of both contending for the tensor cores at once. Two
# one-arrival barriers replace ``qk_done``: warpgroup w arrives on ``turn[w]`` after its
# Q.K; warpgroup 1 waits on ``turn[0]`` before its Q.K (which also covers its V^T),
# warpgroup 0 on ``turn[1]`` before its V^T. Without it, both wait on ``qk_done`` before
# their V^T only.
QK_TURNS = True


def whole_step_softmax(halves, m, l, visible=None):
    """Online softmax over a step's 128 tokens, held as two score tiles.

    halves: ((scores f32 [64, 64] in base 2, k_scale [64]) for the even tokens, then
    the odd ones); visible: None, or a bool [64, 64] per half. Returns (m_new, alpha,
    l_new, (P' * 448 / pv_max) f32 [64, 64] per half, pv_max [64]).
    """
    row_max = jnp.maximum(halves[0][0].max(axis=1), halves[1][0].max(axis=1))
    m_new = jnp.maximum(m, row_max)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    l = l * alpha
    pvs = []
    for h, (scores, k_scale) in enumerate(halves):
        p = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
        l = l + p.sum(axis=1)
        pv = p * lax.broadcast_in_dim(k_scale, scores.shape, [1])
        if visible is not None:
            pv = jnp.where(visible[h], pv, 0.0)  # 0 * a garbage scale could be NaN
        pvs.append(pv)
    pv_max = jnp.maximum(pvs[0].max(axis=1), pvs[1].max(axis=1))
    factor = lax.broadcast_in_dim(FP8_E4M3_MAX / jnp.maximum(pv_max, MIN_PV_ROW_MAX), (BLOCK_M, HALF), [0])
    return m_new, alpha, l, tuple(pv * factor for pv in pvs), pv_max


def _kernel(seq_lens_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref,
            q_union, qr_s, qsc_s, lse_s, kv_union, rope_s, ksc_s,
            step_bar, qk_done_bar, turn_bar, consumed_bar, q_bar, end_bar, *interpreter_p,
            s_q: int, num_heads: int, scale_log2: float, num_splits: int, num_pages: int, interpret: bool):
    """One CTA: (batch row b, KV split s, row block r), two consumer warpgroups and the producer
    (wg 2).

    SMEM: as ``mla_decode_mgpu._kernel``'s without P' tiles and statistics: q_union
    = (q8_s e4m3 [4, 64, 128] | o_s output staging), qr_s bf16 [64, 64], qsc_s f32
    [64], lse_s f32 [64], kv_union = (kv8_s e4m3 [2, 4, 128, 128] | kv16_s uint16
    [2, 4, 128, 64]), rope_s bf16 [2, 128, 64], ksc_s f32 [2, 128]; in the
    interpreter only, interpreter_p = (P' tiles e4m3 [2, 64, 128], one a warpgroup,).
    """
    q8_s, o_s = q_union
    kv8_s, kv16_s = kv_union
    b, split, wg, seq_len, row0, first_step, num_steps, unmasked_steps, issue = begin_cta(
        seq_lens_ref, bt_ref, off_ref, q8_ref, qr_ref, qsc_ref, latp_ref, ropep_ref, ksc_ref,
        q8_s, qr_s, qsc_s, kv8_s, rope_s, ksc_s, step_bar, q_bar, s_q=s_q, num_splits=num_splits,
        num_pages=num_pages, issuer=NUM_WGS, by_warps=PRODUCER_ISSUE_BY_WARPS)

    def consume():
        q_scale = plgpu.load(qsc_s, layout=ROW)

        def step(j, carry, *, masked: bool):
            accs, m, l = carry[:CHUNKS_PER_WG], carry[-2], carry[-1]
            t0 = (first_step + j) * STEP
            slot = lax.rem(j, NUM_SLOTS)
            # Named scopes: phases for scripts/profile_mgpu_steps.py, as in mla_decode_mgpu.
            with jax.named_scope("wait_step"):
                plgpu.barrier_wait(step_bar.at[slot])
            halves, visible = [], []
            if QK_TURNS:
                @pl.when(wg == 1)
                def _():
                    with jax.named_scope("wait_turn"):
                        plgpu.barrier_wait(turn_bar.at[0])  # warpgroup 0's Q.K of this step is done
            with jax.named_scope("qk"):
                for half in range(2):
                    k_scale = plgpu.load(ksc_s.at[slot, pl.ds(half * HALF, HALF)], layout=COL)
                    scores = step_scores(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot], q_scale, k_scale,
                                         half * HALF, interpret=interpret) * scale_log2
                    if masked:  # masked slots may hold any bytes, NaN included
                        visible.append(step_visibility(row0, t0, seq_len, half, s_q=s_q, num_heads=num_heads))
                        scores = jnp.where(visible[-1], scores, -jnp.inf)
                    halves.append((scores, k_scale))
                plgpu.barrier_arrive(turn_bar.at[wg] if QK_TURNS else qk_done_bar.at[slot])
            with jax.named_scope("softmax"):
                m_new, alpha, l, p_scaled, pv_max = whole_step_softmax(halves, m, l, visible if masked else None)
                p8 = [jnp.minimum(p, FP8_E4M3_MAX).astype(FP8_DTYPE) for p in p_scaled]
            with jax.named_scope("wait_qk_done"):  # the other warpgroup has read my chunks as K
                if QK_TURNS:
                    @pl.when(wg == 0)
                    def _():
                        plgpu.barrier_wait(turn_bar.at[1])
                else:
                    plgpu.barrier_wait(qk_done_bar.at[slot])
            with jax.named_scope("v_transpose"):
                v_operands = v_operands_in_place(kv8_s, kv16_s, slot, wg, t0, seq_len, masked=masked,
                                                 interpret=interpret)
                if interpret:
                    p_ref = interpreter_p[0].at[wg]
                    for half in range(2):
                        p_ref[:, pl.ds(half * HALF, HALF)] = p8[half]
                    p_operand = p_ref
                else:
                    p_operand = interleave_columns(*p8)
                plgpu.commit_smem()  # generic-proxy stores (V^T) -> visible to wgmma
            with jax.named_scope("pv"):
                new_accs = pv_update(accs, p_operand, v_operands, alpha, pv_max)
                plgpu.barrier_arrive(consumed_bar.at[slot])
            return (*new_accs, m_new, l)

        *accs, m, l = walk_steps(step, initial_carry(), wg, unmasked_steps, num_steps, consumed_bar, issuer=None)
        # Both warpgroups are past their last Q.K: Q8's bytes become the output staging.
        plgpu.barrier_arrive(end_bar)
        plgpu.barrier_wait(end_bar)
        write_outputs(accs, m, l, o_s, lse_s, o_ref, lse_ref, b, split, row0, wg)

    specialize_warpgroups(wg, functools.partial(produce_steps, issue, first_step, num_steps, consumed_bar), consume,
                          PRODUCER_REGISTERS, CONSUMER_REGISTERS)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "num_pages", "interpret"))
def mla_decode_mgpu_whole(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                          seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                          s_q: int, num_heads: int, num_splits: int = 1, num_pages: int | None = None,
                          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 decode on Mosaic GPU, each warpgroup scoring whole steps; arguments and results as
    ``mla_decode_mgpu.mla_decode_mgpu`` (its module docstring)."""
    batch, num_rows, _ = q_rows.shape
    check_registers(PRODUCER_REGISTERS, CONSUMER_REGISTERS)
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    q8, q_scale, latent_pairs, rope_pairs, scales = prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, layer_offset, page_size=page_size, num_splits=num_splits,
        num_pages=num_pages, interpret=interpret)
    out_dtype = q_rows.dtype if num_splits == 1 else jnp.float32
    stage_cols = CHUNK * 2 // jnp.dtype(out_dtype).itemsize  # the staging tile fits in Q8's 32 KB
    slot_barrier = lambda: plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS)
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          num_splits=num_splits, num_pages=num_pages, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, num_splits, num_rows, RANK), out_dtype),
                  jax.ShapeDtypeStruct((batch, num_splits, num_rows), jnp.float32)),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_CHUNKS, BLOCK_M, CHUNK), FP8_DTYPE),
                           plgpu.SMEM((NUM_WGS, BLOCK_M, stage_cols), out_dtype)),
            plgpu.SMEM((BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.RefUnion(plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), FP8_DTYPE),
                           plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK // 2), jnp.uint16)),
            plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, STEP), jnp.float32),
            plgpu.Barrier(num_arrivals=COPIES_STEP, num_barriers=NUM_SLOTS),
            slot_barrier(),  # qk_done
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_WGS),  # turn (``QK_TURNS``)
            slot_barrier(),  # consumed
            plgpu.Barrier(num_arrivals=COPIES_Q),
            plgpu.Barrier(num_arrivals=NUM_WGS),  # end of the step loop
            *([plgpu.SMEM((NUM_WGS, BLOCK_M, STEP), FP8_DTYPE)] if interpret else []),
        ],
        **grid_params(batch, num_splits, num_rows // BLOCK_M, "snapmla_decode_fp8_mgpu_whole", interpret,
                      num_threads=NUM_WGS + 1),
    )
    out, lse = kernel(seq_lens, block_table, layer_offset, q8, q_scale, q_rope_rows.astype(jnp.bfloat16),
                      latent_pairs, scales, rope_pairs)
    return merge_splits(out, lse, q_rows.dtype, interpret=interpret)
