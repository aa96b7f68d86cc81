"""SnapMLA FP8 MLA decode on Mosaic GPU in blocks of 16 or 32 query rows, transposed products.

The default for up to 32 query rows a batch row (``snapmla_jax.decode.mosaic_kernel``: 16-row
blocks for H = 16 at s_q = 1, 32-row blocks for H = 16 at s_q = 2 or H = 32). ``mla_decode_mgpu``
puts a CTA's query rows on the wgmma M dimension, 64 a warpgroup: at H = 16 48 of them would be
padding. Here the query rows are the N dimension (R = 16 or 32) and tokens or features are M:

* S^T = K.Q^T, [64 tokens, R] a half step: A = the K tile as the TMA lays it (K-major, as FP8
  needs), B = Q8's chunk through ``.transpose``; the RoPE product likewise in BF16. fp32
  promotion every ``QK_PROMOTION`` features, every chain of a step in flight under one wait
  (``step_scores_t``).
* The online softmax runs per column (query row), reducing along the tokens (``softmax_t``):
  the math of ``mla_decode_reference(..., block_n=128)``, as the 64-row kernel.
* O^T = V^T.P'^T, [128 features, R] a chunk, in f16: P' rounds to e4m3 and then to f16
  exactly; V's e4m3 bytes convert to f16 exactly into a [64 tokens, 128] tile, the MN-major A
  operand; P'^T is stored as it sits in registers, the MN-major B operand. 16-bit operands may
  be MN-major, so no 8-bit transpose is needed.

Warpgroup 0 alone computes the scores and the softmax and hands P'^T, the step's alpha and P'
factor to warpgroup 1 through SMEM (``p_ready``); each warpgroup converts and multiplies the V
chunks of output features [256 w, 256 w + 256). Only one warpgroup reduces across warps because
Pallas Mosaic GPU lowers such a reduction through an SMEM scratch at one static offset, shared by
both warpgroups: two reducing at once overwrite each other's partials (only the GPU shows it;
test_64_row_kernel_reduces_within_warps checks the lowering). Warpgroup 1 issues the TMA ring.

Shared with ``mla_decode_mgpu`` (its docstring has the shapes): the inputs and outputs (rows
padded to a multiple of R instead of 64), the step order (even tokens of a step in SMEM rows
0..63, odd ones in 64..127), the TMA ring of whole steps, the token scales gathered in step order,
masks only in a row's last steps, split-KV by the plan of work items (``split_plan``).

SMEM: ring 2 x 80.5 KB (P'^T lives in the step's RoPE rows once warpgroup 0's Q.K has read them),
Q 10 or 20 KB, the V f16 tiles 2 x 16 KB (the output staging after the loop), and a few
[R]-vectors: 203 KB at R = 16, 214 KB at R = 32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.combine_splits import partial_dtype
from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from snapmla_jax.pallas_kernels.mla_decode import LOG2E, MIN_PV_ROW_MAX, resolve_num_pages
from snapmla_jax.pallas_kernels.mla_decode_mgpu import (CHUNK, CHUNKS_PER_WG, COPIES_Q, COPIES_STEP, HALF, NUM_CHUNKS,
                                                        NUM_SLOTS, NUM_WGS, ROPE, STEP, OutputTarget, begin_cta,
                                                        begin_step, grid_params, initial_carry, merge_items,
                                                        output_target, output_types, for_used_items, prepare_inputs,
                                                        store_rows, walk_steps, unpadded, write_lse_and_wait, Where)

ROWS = 16  # query rows a CTA by default: the wgmma N of every product
# Features a fp32 promotion of the FP8 S^T product, as ``mla_decode_mgpu.QK_PROMOTION``: with all
# chains under one wait, fewer chains save accumulators and adds: 0.515 vs 0.523 ms for 128 at
# 128 x 16k x 16 (H100, tools/time_mgpu_variants.py --kernel small --variants baseline promotion_128).
QK_PROMOTION = 512
BLOCK_ROWS = (16, 32)  # the row blocks the kernel takes (``block_rows``)
TOKENS = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector with one value per token (axis 0 of a [64, R] tile)
QROWS = plgpu.Layout.WGMMA.reduce(0)  # an [R] vector with one value per query row (axis 1)
# The warpgroup that issues the ring's TMAs: warpgroup 1, which waits for warpgroup 0's softmax at
# the start of every step anyway (warpgroup 0's work sets the step time).
ISSUER = 1
# Whether warpgroup 0 stores a step's m, l (``ml_s``) and the fold's factors (``stats_s``) without
# the warpgroup barriers Pallas puts around every SMEM store (``mla_decode_mgpu.store_rows``):
# eight barriers a step fewer on warpgroup 0's path. GPU only. What orders them instead: the
# softmax's cross-warp reductions lie between this step's loads of m and l and the stores; the
# ``commit_smem`` after them precedes every read (warpgroup 1's behind ``p_ready``); a slot's
# factors are overwritten two steps later, behind that step's TMA, issued once both warpgroups
# consumed the slot.
UNSYNCED_ROW_STORES = True

def step_scores_t(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scales, *, interpret: bool) -> list[jax.Array]:
    """S^T of a step before the softmax scale, (K8.Q8^T * k_scale * q_scale + Kr.Qr^T), as two
    f32 [64, R] halves: the step's SMEM rows 0..63 (even tokens) and 64..127 against the query rows.

    q8_s e4m3 [4, R, 128], kv_slot e4m3 [4, 128, 128], qr_s bf16 [R, 64], rope_slot
    bf16 [128, 64], q_scale [R] (``QROWS``), k_scales: the halves' [64] (``TOKENS``).

    fp32 promotion every ``QK_PROMOTION`` features, as ``mla_decode_mgpu``, but
    with every chain of both halves in flight at once (one accumulator each, 8
    registers at R = 16) and one wait, instead of a wait per chain; then both
    halves' RoPE wgmmas onto the scaled FP8 products, one wait.
    """
    rows = q8_s.shape[1]
    per_chain = QK_PROMOTION // CHUNK
    chains = [(half, first) for half in range(2) for first in range(0, NUM_CHUNKS, per_chain)]
    acc = plgpu.ACC((HALF, rows), jnp.float32)

    def qk8(*acc_refs):
        for (half, first), acc_ref in zip(chains, acc_refs):
            for ch in range(first, first + per_chain):
                plgpu.wgmma(acc_ref, kv_slot.at[ch, pl.ds(half * HALF, HALF)], q8_s.at[ch].transpose((1, 0)))
        parts = [acc_ref[...] for acc_ref in acc_refs]
        return [functools.reduce(jnp.add, [part for (h, _), part in zip(chains, parts) if h == half])
                for half in range(2)]

    s8 = pl.run_scoped(qk8, *([acc] * len(chains)))
    scaled = [s8[half] * lax.broadcast_in_dim(k_scales[half], (HALF, rows), [0])
              * lax.broadcast_in_dim(q_scale, (HALF, rows), [1]) for half in range(2)]

    def qk_rope(acc_refs):  # both halves in flight, one wait
        for half, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, rope_slot.at[pl.ds(half * HALF, HALF)], qr_s.transpose((1, 0)))

    if interpret:  # no pre-initialised accumulators in the interpreter
        def qk_rope_values(*acc_refs):
            qk_rope(acc_refs)
            return [acc_ref[...] for acc_ref in acc_refs]
        return [x + r for x, r in zip(scaled, pl.run_scoped(qk_rope_values, acc, acc))]
    return list(pl.run_state(qk_rope)(tuple(plgpu.ACC.init(x) for x in scaled)))


def visibility_t(row0, t0, seq_len, half: int, *, s_q: int, num_heads: int, rows: int) -> jax.Array:
    """bool [64, R]: which tokens of a half step (SMEM row c: token t0 + 2c + half) each query
    row sees (row i * H + h is query position i: tokens below seq_len - s_q + i + 1; padding
    rows are capped at seq_len)."""
    token_ids = plgpu.broadcasted_iota(jnp.int32, (HALF, rows), 0, layout=plgpu.Layout.WGMMA)
    tokens = t0 + 2 * token_ids + half
    if s_q == 1:
        return tokens < seq_len
    row_ids = plgpu.broadcasted_iota(jnp.int32, (HALF, rows), 1, layout=plgpu.Layout.WGMMA)
    visible_len = jnp.minimum(seq_len - s_q + lax.div(row0 + row_ids, jnp.int32(num_heads)) + 1, seq_len)
    return tokens < visible_len


def softmax_t(scores, k_scales, m, l, scale_log2: float, visible=None):
    """The online softmax of a step along the tokens, per query row (column).

    scores: the two halves' S^T f32 [64, R]; k_scales: their [64] token scales;
    running m (base 2), l [R]; visible: two bool [64, R] or None. Returns
    (m_new, alpha, l_new, the two halves of P' * 448 / pv_max (f32, at most
    448), pv_max [R]: the factor to undo): the 64-row kernel's P' (``mla_decode_mgpu.softmax_frame``,
    which gets there in the log domain) with rows and columns exchanged.
    """
    scores = [s * scale_log2 for s in scores]
    if visible is not None:  # masked slots may hold any bytes, NaN included
        scores = [jnp.where(v, s, -jnp.inf) for s, v in zip(scores, visible)]
    # Each reduction along the tokens crosses warps (through SMEM and a barrier): the two
    # halves are combined elementwise first, so that a step reduces three times, not six.
    m_new = jnp.maximum(m, jnp.maximum(scores[0], scores[1]).max(axis=0))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    shape = scores[0].shape
    m_b = lax.broadcast_in_dim(m_safe, shape, [1])
    p = [jnp.exp2(s - m_b) for s in scores]
    l = l * alpha + (p[0] + p[1]).sum(axis=0)
    pv = [ph * lax.broadcast_in_dim(k, shape, [0]) for ph, k in zip(p, k_scales)]
    if visible is not None:
        pv = [jnp.where(v, x, 0.0) for x, v in zip(pv, visible)]  # 0 * a garbage scale could be NaN
    pv_max = jnp.maximum(pv[0], pv[1]).max(axis=0)
    factor = lax.broadcast_in_dim(FP8_E4M3_MAX / jnp.maximum(pv_max, MIN_PV_ROW_MAX), shape, [1])
    return m_new, alpha, l, [x * factor for x in pv], pv_max


def v_half_f16(chunk_ref, half: int, t0, seq_len, *, masked: bool) -> jax.Array:
    """Rows [64 half, 64 half + 64) of a step's V chunk (e4m3 [128, 128]) as f16 [64, 128]
    (exact); ``masked``: tokens past seq_len zeroed (0 * NaN would poison the sum)."""
    v = plgpu.load(chunk_ref.at[pl.ds(half * HALF, HALF)], layout=plgpu.Layout.WGMMA).astype(jnp.float16)
    if not masked:
        return v
    token_ids = plgpu.broadcasted_iota(jnp.int32, (HALF, CHUNK), 0, layout=plgpu.Layout.WGMMA)
    return jnp.where(t0 + 2 * token_ids + half < seq_len, v, jnp.float16(0))


def pv_update_t(accs, kv_slot, wg, pt_ref, v16_ref, alpha, pv_max, t0, seq_len, *, masked: bool) -> list:
    """acc * alpha + (V^T.P'^T) * pv_max / 448 for each of this warpgroup's O^T chunks [128, R].

    Each half step's V chunk converts to f16 into ``v16_ref`` (f16 [64, 128]), the
    MN-major A operand; ``pt_ref`` f16 [128, R] holds the step's P'^T (written by
    warpgroup 0), the MN-major B operand.
    The one tile is reused, so each half waits for the previous wgmma to read it.
    """
    shape = accs[0].shape
    undo = lax.broadcast_in_dim(pv_max * (1.0 / FP8_E4M3_MAX), shape, [1])
    alpha_b = lax.broadcast_in_dim(alpha, shape, [1])
    new_accs = []
    for i, acc in enumerate(accs):
        chunk_ref = kv_slot.at[wg * CHUNKS_PER_WG + i]

        def pv_mma(acc_ref, chunk_ref=chunk_ref):
            for half in range(2):
                if half:
                    plgpu.wgmma_wait(0)  # the first half's wgmma has read the tile
                v16_ref[...] = v_half_f16(chunk_ref, half, t0, seq_len, masked=masked)
                plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
                plgpu.wgmma(acc_ref, v16_ref.transpose((1, 0)), pt_ref.at[pl.ds(half * HALF, HALF)])
            return acc_ref[...]

        pv_out = pl.run_scoped(pv_mma, plgpu.ACC(shape, jnp.float32))
        new_accs.append(acc * alpha_b + pv_out * undo)
    return new_accs


def write_outputs_t(accs, m, l, o_s, lse_s, target: OutputTarget, row0, wg, *, transposed: bool) -> None:
    """This warpgroup's columns of the output (O^T / l) and, from warpgroup 0, the rows' lse, to
    ``target``.

    ``transposed`` False: rows row0:row0 + R, its columns, staged through the
    transposed view of o_s [2, R, 128] (a 16-bit transposed store). True (float32
    outputs and partials, whose 32-bit transposed store Mosaic GPU's layout inference
    rejects): columns, rows row0:row0 + R of a [512, rows] output, staged as is in
    o_s [2, 128, R]; the launcher transposes them.
    """
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    rows = accs[0].shape[1]
    inv_l = lax.broadcast_in_dim(1.0 / l_safe, accs[0].shape, [1])
    my_o = o_s.at[wg]
    for i, acc in enumerate(accs):
        if i:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk has left the staging tile
        col0 = (wg * CHUNKS_PER_WG + i) * CHUNK
        if transposed:
            my_o[...] = acc * inv_l
            dst = (pl.ds(col0, CHUNK), pl.ds(row0, rows))
        else:
            my_o.transpose((1, 0))[...] = (acc * inv_l).astype(my_o.dtype)
            dst = (pl.ds(row0, rows), pl.ds(col0, CHUNK))
        plgpu.commit_smem()
        target.copy(my_o, False, *dst)
    write_lse_and_wait(wg, m, l_safe, seen, lse_s, target, row0)


@for_used_items
def _kernel(seq_lens_ref, items_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref, part_o_ref, part_lse_ref,
            q8_s, qr_s, qsc_s, lse_s, kv8_s, rope_union, ksc_s, stats_s, ml_s, v_union,
            step_bar, p_ready_bar, consumed_bar, q_bar, end_bar,
            *, s_q: int, num_heads: int, scale_log2: float, partials: bool, transposed: bool, num_pages: int,
            interpret: bool):
    """One CTA: (work item w: a run of steps of batch row b, block of R query rows), two
    warpgroups; outputs as ``mla_decode_mgpu.OutputTarget``; ``transposed``: the output and
    partials leave as [features, rows] float32 (``write_outputs_t``).

    SMEM (R = 16 or 32 rows): q8_s e4m3 [4, R, 128], qr_s bf16 [R, 64], qsc_s f32
    [R], lse_s f32 [R], kv8_s e4m3 [2, 4, 128, 128] and rope_union = (rope_s bf16
    [2, 128, 64] | pt_s f16 [2, 64 / R, 128, R]) (the ring, step order: RoPE rows,
    then in the same bytes P'^T at pt_s[slot, 0]), ksc_s f32 [2, 128], and from
    warpgroup 0 (module docstring): stats_s f32 [2 slots, 2, R] (alpha, P'
    factor pv_max), ml_s f32 [2, R] (running m, l); v_union = (v16_s f16 [2, 64,
    128] | o_s output staging after the loop: [2, R, 128] in the output's
    16-bit dtype, or [2, 128, R] f32 when ``transposed``).

    Slot reuse: warpgroup 0 writes step j's P'^T over the step's RoPE rows once
    its own QK wgmmas (their only reader) have completed, and the slot's next
    TMA (step j + 2) is issued after both warpgroups consumed step j. It writes
    step j's stats_s slot after ``begin_step`` of step j - 1 waited for both
    warpgroups to consume step j - 2. (Every member of a ``RefUnion`` starts at
    its first byte: pt_s has the RoPE slot's stride, 16 KB, so pt_s[slot] lies
    in rope_s[slot]. With a shorter stride pt_s[1] would lie in the second half
    of rope_s[0], over the RoPE keys of the next step: wrong on the GPU and right
    in the interpreter, which does not alias union members.)
    """
    rope_s, pt_s = rope_union
    rows = q8_s.shape[1]
    v16_s, o_s = v_union
    where, issue = begin_cta(
        seq_lens_ref, items_ref, bt_ref, off_ref, q8_ref, qr_ref, qsc_ref, latp_ref, ropep_ref, ksc_ref,
        q8_s, qr_s, qsc_s, kv8_s, rope_s, ksc_s, step_bar, q_bar, s_q=s_q, num_pages=num_pages, issuer=ISSUER)
    _, wg, _, row0, _, _, _ = where
    *_, m0, l0 = initial_carry((CHUNK, rows), rows_axis=1)

    @pl.when(wg == 0)
    def _():
        ml_s[0] = m0
        ml_s[1] = l0
        plgpu.commit_smem()  # the warpgroup's barrier: every thread sees them before its first load

    def softmax_step(j, slot, t0, seq_len, *, masked: bool) -> None:
        """Warpgroup 0: step j's scores and online softmax; P'^T, alpha and pv_max to the slot."""
        k_scales = [plgpu.load(ksc_s.at[slot, pl.ds(half * HALF, HALF)], layout=TOKENS) for half in range(2)]
        q_scale = plgpu.load(qsc_s, layout=QROWS)
        scores = step_scores_t(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot], q_scale, k_scales, interpret=interpret)
        visible = None
        if masked:
            visible = [visibility_t(row0, t0, seq_len, half, s_q=s_q, num_heads=num_heads, rows=rows)
                       for half in range(2)]
        m, l = plgpu.load(ml_s.at[0], layout=QROWS), plgpu.load(ml_s.at[1], layout=QROWS)
        m_new, alpha, l, p_scaled, pv_max = softmax_t(scores, k_scales, m, l, scale_log2, visible)
        unsynced = UNSYNCED_ROW_STORES and not interpret
        store_rows((m_new, l), ml_s, layout=QROWS, unsynced=unsynced)
        for half in range(2):  # P' rounds to e4m3 (the SnapMLA math), then to f16 exactly
            pt_s[slot, 0, pl.ds(half * HALF, HALF)] = (
                jnp.minimum(p_scaled[half], FP8_E4M3_MAX).astype(FP8_DTYPE).astype(jnp.float16))
        store_rows((alpha, pv_max), stats_s.at[slot], layout=QROWS, unsynced=unsynced)
        plgpu.commit_smem()  # generic-proxy stores -> visible to both warpgroups' wgmma
        plgpu.barrier_arrive(p_ready_bar.at[slot])

    def step(j, accs, *, where: Where, masked: bool):
        t0 = (where.first_step + j) * STEP
        slot = begin_step(j, wg, where.first_step, where.num_steps, issue, step_bar, consumed_bar, issuer=ISSUER)
        pl.when(wg == 0)(functools.partial(softmax_step, j, slot, t0, where.seq_len, masked=masked))

        @pl.when(wg == 1)
        def _():
            plgpu.barrier_wait(p_ready_bar.at[slot])

        alpha = plgpu.load(stats_s.at[slot, 0], layout=QROWS)
        pv_max = plgpu.load(stats_s.at[slot, 1], layout=QROWS)
        new_accs = pv_update_t(accs, kv8_s.at[slot], wg, pt_s.at[slot, 0], v16_s.at[wg], alpha, pv_max, t0,
                               where.seq_len, masked=masked)
        plgpu.barrier_arrive(consumed_bar.at[slot])
        return tuple(new_accs)

    accs = walk_steps(step, initial_carry((CHUNK, rows), rows_axis=1)[:CHUNKS_PER_WG], where, consumed_bar,
                      issuer=ISSUER)
    # The output staging reuses the V tiles' bytes: wait until both warpgroups are past their
    # last step (and warpgroup 0's final m and l are in ml_s).
    plgpu.barrier_arrive(end_bar)
    plgpu.barrier_wait(end_bar)
    m, l = plgpu.load(ml_s.at[0], layout=QROWS), plgpu.load(ml_s.at[1], layout=QROWS)
    target = output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials)
    write_outputs_t(accs, m, l, o_s, lse_s, target, row0, wg, transposed=transposed)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "block_rows", "num_pages", "interpret"))
def mla_decode_mgpu_small(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                          seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                          s_q: int, num_heads: int, num_splits: int = 1, balanced: bool = False,
                          block_rows: int = ROWS, num_pages: int | None = None,
                          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 decode for blocks of ``block_rows`` (16 or 32) query rows; arguments and results as
    ``mla_decode_mgpu``'s (``num_splits``, ``balanced`` and ``num_pages`` included): q_rows
    [B, rows, 512] of any rows (padded to whole blocks of ``block_rows`` in the inputs launch)."""
    if block_rows not in BLOCK_ROWS:
        raise ValueError(f"block_rows: expected one of {BLOCK_ROWS}, got {block_rows!r}")
    rows = block_rows
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    q8, q_scale, q_rope, latent_pairs, rope_pairs, scales, plan = prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, page_size=page_size,
        num_splits=num_splits, balanced=balanced, num_pages=num_pages, block_rows=rows, interpret=interpret)
    num_rows = q8.shape[1]  # padded to whole blocks
    # Output and partials are bf16 for a bf16 output, else float32 (``partial_dtype``). Float32 ones
    # leave the kernel as [features, rows] (``write_outputs_t``: Mosaic GPU cannot store 32-bit
    # values transposed).
    out_dtype = partial_dtype(q_rows.dtype)
    transposed = jnp.dtype(out_dtype).itemsize == 4
    stage_shape = (NUM_WGS, CHUNK, rows) if transposed else (NUM_WGS, rows, CHUNK)
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, transposed=transposed, num_pages=num_pages, interpret=interpret),
        out_type=output_types(plan, num_rows, out_dtype, transposed=transposed),
        scratch_types=[
            plgpu.SMEM((NUM_CHUNKS, rows, CHUNK), FP8_DTYPE),
            plgpu.SMEM((rows, ROPE), jnp.bfloat16),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), FP8_DTYPE),
            # P'^T [128, rows] f16 in the step's RoPE slot, with the slot's stride (``_kernel``).
            plgpu.RefUnion(plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
                           plgpu.SMEM((NUM_SLOTS, ROPE // rows, STEP, rows), jnp.float16)),
            plgpu.SMEM((NUM_SLOTS, STEP), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, 2, rows), jnp.float32),
            plgpu.SMEM((2, rows), jnp.float32),
            plgpu.RefUnion(plgpu.SMEM((NUM_WGS, HALF, CHUNK), jnp.float16),
                           plgpu.SMEM(stage_shape, out_dtype)),
            plgpu.Barrier(num_arrivals=COPIES_STEP, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_SLOTS),  # P'^T ready (warpgroup 0)
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),  # consumed (both warpgroups)
            plgpu.Barrier(num_arrivals=COPIES_Q),
            plgpu.Barrier(num_arrivals=NUM_WGS),
        ],
        **grid_params(plan, num_rows // rows, "snapmla_decode_fp8_mgpu_small", interpret),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, q8, q_scale, q_rope, latent_pairs, scales,
                  rope_pairs)
    out, lse = merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, transposed=transposed,
                           interpret=interpret)
    return unpadded(out, lse, q_rows.shape[1])
