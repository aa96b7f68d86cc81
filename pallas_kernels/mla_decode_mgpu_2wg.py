"""SnapMLA FP8 MLA decode on Mosaic GPU, two warpgroups per CTA (FlashMLA's split).

Status (2026-11-23): lowers for CUDA and matches ``mla_decode_reference`` in
the Mosaic GPU interpreter on CPU; never run on a GPU, not wired in. Same
arguments, results, math and step order as ``mla_decode_mgpu`` (read its
docstring first); this file only changes how the work is laid out.

Layout of the work. Grid (batch row, KV split, block of 64 query rows): one CTA reads
each cache tile once per row block (the quarter kernel reads it 4 times, once
per column quarter). Two warpgroups share everything the TMA brings in; warp
group w owns output columns [256 w, 256 w + 256) (two 128-column chunks, two
fp32 accumulators of 64 x 128: 128 registers a thread). Both compute the whole
64 x 128 score tile (QK done twice instead of 4 times: 1.5x the MMA work of an
ideal kernel) and the same softmax, so no row max or P' crosses between them;
each keeps its own copy of P'.

V^T in place. After both warpgroups have read a step's latent slot as K (a
barrier with 2 arrivals), each one packs its own two chunks into 16-bit token
pairs and stores them transposed over the same bytes (the slot is a
``RefUnion`` of e4m3 [.., 128, 128] and uint16 [.., 128, 64] views): chunk c of
the slot then holds V^T of chunk c, the P'.V wgmma's B operand. No V^T buffer:
that is what makes a 2-slot ring of whole 128-token steps (128 KB) fit next to
Q (40 KB), RoPE keys (2 x 16 KB) and P' (2 x 8 KB).

Split-KV: grid (batch row, split, row block); split s takes a contiguous run
of whole 128-token steps of its row and writes float32 partials with their
lse, merged by ``_combine_splits`` (the Triton kernels' merge). The caller picks
the count (``snapmla_jax.decode.choose_num_splits``).

Pipelining: warpgroup 0 issues the TMA of step j + 1 (latent chunks, RoPE rows
and token scales, one barrier a slot) at the start of step j, once both
warpgroups have finished step j - 1's P'.V on that slot (a "consumed" barrier
with 2 arrivals). One warpgroup's softmax can overlap the other's wgmmas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from pallas_kernels.mla_decode import LN2, LOG2E, _combine_splits
from pallas_kernels.mla_decode_mgpu import (BLOCK_M, CHUNK, HALF, NUM_CHUNKS, RANK, ROPE, STEP, _aligned, issue_query,
                                            pack_p, page_boxes, prepare_inputs, qk_products, softmax_step, step_iotas,
                                            v_masked_token_major, v_words)

NUM_WGS = 2
CHUNKS_PER_WG = NUM_CHUNKS // NUM_WGS
NUM_SLOTS = 2
# TMA copies arriving on a slot's barrier per step: per page and token parity,
# the 4 latent chunks and the RoPE rows; plus one box of token scales.
COPIES_STEP = 2 * 2 * (NUM_CHUNKS + 1) + 1
COPIES_Q = NUM_CHUNKS + 2  # Q8 chunks, Q rope, q scale


def _kernel(seq_lens_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref,
            q_union, qr_s, qsc_s, lse_s, kv_union, rope_s, ksc_s, p_union,
            step_bar, qk_done_bar, consumed_bar, q_bar, end_bar,
            *, s_q: int, num_heads: int, scale_log2: float, num_splits: int, interpret: bool):
    """One CTA: (batch row b, KV split s, row block r), two warpgroups; shapes in the module docstring.

    SMEM (shared by both warpgroups): q_union = (q8_s e4m3 [4, 64, 128] | o_s
    [2, 64, 128] bf16 or [2, 64, 64] f32 output staging, one tile per
    warpgroup), qr_s bf16 [64, 64],
    qsc_s f32 [64], lse_s f32 [64], kv_union = (kv8_s e4m3 [2, 4, 128, 128] |
    kv16_s uint16 [2, 4, 128, 64]) (slot, chunk, step row, feature: K, then V^T
    in place), rope_s bf16 [2, 128, 64], ksc_s f32 [2, 128], p_union = (p16_s
    uint16 [2, 64, 64] | p8_s e4m3 [2, 64, 128]) (one P' per warpgroup).
    """
    b = lax.axis_index("b")
    split = lax.axis_index("s")
    r = lax.axis_index("r")
    wg = lax.axis_index("wg")
    q8_s, o_s = q_union
    kv8_s, kv16_s = kv_union
    p16_s, p8_s = p_union
    seq_len = seq_lens_ref[b]
    layer_offset = off_ref[0]
    # Split-KV: this CTA takes steps [first_step, first_step + num_steps) of the row.
    total_steps = (seq_len + (STEP - 1)) // STEP
    steps_per_split = (total_steps + (num_splits - 1)) // num_splits
    first_step = split * steps_per_split
    num_steps = jnp.maximum(jnp.minimum(total_steps - first_step, steps_per_split), 0)
    row0 = _aligned(r * BLOCK_M, BLOCK_M)

    def issue_step(step, slot):
        """Latent chunks and RoPE rows in step order (even tokens to rows 0..63), and token scales."""
        for parity, src, dst in page_boxes(bt_ref, b, step, layer_offset):
            for ch in range(NUM_CHUNKS):
                plgpu.copy_gmem_to_smem(latp_ref.at[src, parity, pl.ds(ch * CHUNK, CHUNK)],
                                        kv8_s.at[slot, ch, dst], step_bar.at[slot])
            plgpu.copy_gmem_to_smem(ropep_ref.at[src, parity], rope_s.at[slot, dst], step_bar.at[slot])
        plgpu.copy_gmem_to_smem(ksc_ref.at[b, pl.ds(_aligned(step * STEP, STEP), STEP)], ksc_s.at[slot],
                                step_bar.at[slot])

    @pl.when(wg == 0)
    def _():
        issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, q_bar)

        @pl.when(num_steps > 0)
        def _():
            issue_step(first_step, 0)

    plgpu.barrier_wait(q_bar)
    q_row_scale = plgpu.load(qsc_s, layout=plgpu.Layout.WGMMA.reduce(1))
    col_tokens, visible_len, word_ids = step_iotas(row0, seq_len, s_q=s_q, num_heads=num_heads)
    my_p8 = p8_s.at[wg]

    def step(j, carry):
        accs, m, l = carry[:CHUNKS_PER_WG], carry[-2], carry[-1]
        t0 = (first_step + j) * STEP
        slot = lax.rem(j, NUM_SLOTS)
        plgpu.barrier_wait(step_bar.at[slot])

        @pl.when((wg == 0) & (j + 1 < num_steps))
        def _():
            @pl.when(j >= 1)
            def _():
                plgpu.barrier_wait(consumed_bar.at[1 - slot])  # step j - 1's P'.V by both warpgroups
            issue_step(first_step + j + 1, 1 - slot)

        s8, sr = qk_products(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot])
        plgpu.barrier_arrive(qk_done_bar.at[slot])

        k_scale = plgpu.load(ksc_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        m_new, alpha, l, p8, pv_max = softmax_step(s8, sr, q_row_scale, k_scale, (t0 + col_tokens) < visible_len,
                                                   m, l, scale_log2)
        if not interpret:
            p16_s[wg] = pack_p(p8)
        else:
            my_p8[...] = p8

        # Both warpgroups have read the slot as K: overwrite my chunks with V^T.
        plgpu.barrier_wait(qk_done_bar.at[slot])
        v_operands = []
        for i in range(CHUNKS_PER_WG):
            ch = wg * CHUNKS_PER_WG + i
            if not interpret:
                word = v_words(kv8_s.at[slot, ch], t0, seq_len, word_ids)
                kv16_s.at[slot, ch].transpose((1, 0))[...] = plgpu.layout_cast(word, plgpu.Layout.WGMMA)
                v_operands.append(kv8_s.at[slot, ch].transpose((1, 0)))
            else:
                # The interpreter does not alias RefUnion views: V stays
                # token-major in step order, masked in place.
                kv8_s[slot, ch] = v_masked_token_major(kv8_s.at[slot, ch], t0, seq_len)
                v_operands.append(kv8_s.at[slot, ch])
        plgpu.commit_smem()  # generic-proxy stores (P', V^T) -> visible to wgmma

        undo = lax.broadcast_in_dim(pv_max * (1.0 / FP8_E4M3_MAX), (BLOCK_M, CHUNK), [0])
        alpha_b = lax.broadcast_in_dim(alpha, (BLOCK_M, CHUNK), [0])
        new_accs = []
        for acc, v_operand in zip(accs, v_operands):
            def pv_mma(acc_ref, v_operand=v_operand):
                plgpu.wgmma(acc_ref, my_p8, v_operand)
                return acc_ref[...]

            pv_out = pl.run_scoped(pv_mma, plgpu.ACC((BLOCK_M, CHUNK), jnp.float32))
            new_accs.append(acc * alpha_b + pv_out * undo)
        plgpu.barrier_arrive(consumed_bar.at[slot])
        return (*new_accs, m_new, l)

    zeros = plgpu.layout_cast(jnp.zeros((BLOCK_M, CHUNK), jnp.float32), plgpu.Layout.WGMMA)
    init = ((zeros,) * CHUNKS_PER_WG
            + (plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
               plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))))
    *accs, m, l = lax.fori_loop(0, num_steps, step, init)

    @pl.when(wg == 0)
    def _():
        # Observe the consumption of the last two steps too (the loop waited for
        # steps 0 .. num_steps - 3 only): a barrier phase nobody waits for is
        # left dangling (the interpreter rejects that).
        for back in (2, 1):
            @pl.when(num_steps >= back)
            def _():
                plgpu.barrier_wait(consumed_bar.at[lax.rem(num_steps - back, NUM_SLOTS)])

    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    inv_l = lax.broadcast_in_dim(1.0 / l_safe, (BLOCK_M, CHUNK), [0])
    # The output staging reuses Q8's bytes: wait until both warpgroups are past their last QK.
    plgpu.barrier_arrive(end_bar)
    plgpu.barrier_wait(end_bar)
    # Staging tile of 64 x cols: 128 columns of a 2-byte output, 64 of the
    # float32 partials of a split (Q8's 32 KB either way).
    my_o = o_s.at[wg]
    cols = my_o.shape[1]
    pieces = [(i * CHUNK + c, acc[:, c:c + cols] if cols < CHUNK else acc)
              for i, acc in enumerate(accs) for c in range(0, CHUNK, cols)]
    for k, (col, piece) in enumerate(pieces):
        if k:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous piece has left the staging tile
        my_o[...] = (piece * inv_l[:, :cols]).astype(my_o.dtype)
        plgpu.commit_smem()
        col0 = wg * CHUNKS_PER_WG * CHUNK + col
        plgpu.copy_smem_to_gmem(my_o, o_ref.at[b, split, pl.ds(row0, BLOCK_M), pl.ds(col0, cols)])

    @pl.when(wg == 0)
    def _():
        lse_s[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, split, pl.ds(row0, BLOCK_M)])

    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "interpret"))
def mla_decode_mgpu_2wg(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                        seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                        s_q: int, num_heads: int, num_splits: int = 1,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 decode, two warpgroups per CTA; arguments and results as ``mla_decode_mgpu``.

    ``num_splits`` > 1 splits each row's steps over that many CTAs (flash
    decoding); their float32 partials are merged with their log-sum-exp, as the
    Triton kernel's are (``_combine_splits``).
    """
    batch, num_rows, _ = q_rows.shape
    q8, q_row_scale, latent_pairs, rope_pairs, scales = prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, layer_offset, softmax_scale=softmax_scale,
        page_size=page_size, name="mla_decode_mgpu_2wg")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int, got {num_splits!r}")
    out_dtype = q_rows.dtype if num_splits == 1 else jnp.float32
    stage_cols = CHUNK * 2 // jnp.dtype(out_dtype).itemsize  # the staging tile fits in Q8's 32 KB
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          num_splits=num_splits, interpret=interpret),
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
            plgpu.RefUnion(plgpu.SMEM((NUM_WGS, BLOCK_M, HALF), jnp.uint16),
                           plgpu.SMEM((NUM_WGS, BLOCK_M, STEP), FP8_DTYPE)),
            plgpu.Barrier(num_arrivals=COPIES_STEP, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=COPIES_Q),
            plgpu.Barrier(num_arrivals=NUM_WGS),
        ],
        grid=(batch, num_splits, num_rows // BLOCK_M),
        grid_names=("b", "s", "r"),
        num_threads=NUM_WGS,
        thread_name="wg",
        kernel_name="snapmla_decode_fp8_mgpu_2wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    out, lse = kernel(seq_lens, block_table, layer_offset, q8, q_row_scale, q_rope_rows.astype(jnp.bfloat16),
                      latent_pairs, scales, rope_pairs)
    if num_splits == 1:
        return out[:, 0], lse[:, 0]
    merged, merged_lse = _combine_splits(out, lse)
    return merged.astype(q_rows.dtype), merged_lse
