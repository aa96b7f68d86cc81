"""SnapMLA FP8 MLA decode on Mosaic GPU in blocks of 16 or 32 query rows, transposed products.

The default for up to 32 query rows a batch row (``snapmla_jax.decode.mosaic_kernel``): 16-row
blocks for up to 16 (H = 16 at s_q = 1, DeepSeek-V2-Lite or V3 split by heads over 8 GPUs),
32-row blocks for 17-32 (H = 16 at s_q = 2, H = 32). ``mla_decode_mgpu`` puts a CTA's query rows on the wgmma M dimension, 64 a warpgroup: at
H = 16 48 of them would be padding. Here the query rows are the N dimension (R = 16 or 32) and
tokens or features are M:

* S^T = K.Q^T, [64 tokens, R]: warpgroup w scores half w of each step (SMEM rows [64 w, 64 w +
  64)). A = the K tile as the TMA lays it (K-major, as FP8 needs), B = Q8's chunk through
  ``.transpose``; the RoPE product likewise in BF16 (``half_scores_t``). With two
  ``query_terms`` (16-row blocks) the query's rounding and what it leaves are two FP8 B operands
  against the same K tile, each product under its own row scales.
* The online softmax in the log domain of ``mla_decode_mgpu`` (its docstring has the math), per
  column (query row), reducing along the tokens (``softmax_frame_t``). The step's row max of
  log_pv crosses the eight warps of both warpgroups in one exchange (``store_warp_maxima``, a
  named barrier, eight partials read); l' stays per token slot until the loop ends.
* O^T = V^T.P'^T, [64 features, R] a tile, four tiles a warpgroup (output features [256 w,
  256 w + 256)): V^T the 8-bit register A operand built from the ring slot
  (``mgpu_bytes.load_vt_quads``), P' [R, 128] e4m3 the K-major B operand, each warpgroup's half
  stored byte by byte into the order that operand's columns follow (``store_token_bytes``), after
  which the warpgroups meet at a second named barrier. The four products of a warpgroup are in
  flight at once.

The other reductions along the tokens cross warps too. Pallas Mosaic GPU lowers such a
reduction through one SMEM scratch at a static offset, which two warpgroups reducing at once
would overwrite (only the GPU shows it): each warpgroup reduces through a scratch of its own
(``token_reduce``; test_no_kernel_reduces_through_the_shared_scratch checks the lowering).
Warpgroup 1 issues the TMA ring (a third, producer warpgroup in the row blocks of
``PRODUCER_ROWS``: none by default).

Shared with ``mla_decode_mgpu``: the inputs launch (rows padded to a multiple of R instead of
64, the token scales in step order; their log2 and reciprocals are taken here), the step order
(even tokens of a step in SMEM rows 0..63, odd ones in 64..127), the TMA ring of whole steps,
masks only in a row's last steps, split-KV by the plan of work items (``split_plan``), the named
barriers and the output's store (``write_outputs_t``).

Without the inputs launch (``runs_query_in_kernel``: 16-row blocks of bf16 rows; a balanced
plan then comes from the plan-only launch): the CTA copies its bf16 query rows to SMEM and both
warpgroups quantize half of them each (``quantize_query``, the inputs launch's math) while the
first step's copies fly, and each
step brings its two pages' token scales in token order, from which each warpgroup reads its
parity (``parity_scales``). At small problems the inputs launch is a fifth of the call: 2.0-2.2
us of GPU time against a kernel of 6-8 us (H200, B = 1-16, 1k-16k tokens).

SMEM: ring 2 x 80.5 KB, Q 10 or 20 KB, P' 2 x 2 or 4 KB, the reduction scratch 2 x 2 KB, the
warps' row maxima 1 or 2 KB, the output staging 4-16 KB: about 191 KB at R = 16 (207 KB with the
bf16 query's staging tile, 8 KB more with the query's second term), 214 KB at R = 32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref

from snapmla_jax.pallas_kernels.combine_splits import partial_dtype
from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX, residual_per_token
from snapmla_jax.pallas_kernels.mgpu_bytes import (BYTE_TILE_TRANSFORMS, load_vt_quads, output_transforms,
                                                   store_token_bytes)
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import (GROUP_ROWS, SCALE_FLOOR, by_row, quantized_rows,
                                                            scale_copy_pages)
from snapmla_jax.pallas_kernels.mla_decode_reference import LOG2E, resolve_num_pages
import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
from snapmla_jax.pallas_kernels.mla_decode_mgpu import (CHUNK, CHUNKS_PER_WG, COPIES_Q, FRAME_DROP, HALF,
                                                        LOG2_FP8_MAX, NAMED_SYNC, NUM_CHUNKS, NUM_SLOTS, NUM_WGS,
                                                        PAGE_SIZES, RANK, ROPE, ROW, STATS_SYNC_ID, STEP, aligned,
                                                        begin_cta, begin_step, check_launch, check_qk_promotion,
                                                        consumers_sync, for_used_items,
                                                        gather_p, grid_params, initial_carry, merge_items,
                                                        output_target, output_types, plan_items, prepare_inputs,
                                                        produce_steps, producer_by_warps, publish_p,
                                                        specialize_warpgroups, step_copies, step_pages,
                                                        store_rows, walk_steps, unpadded, write_outputs_t,
                                                        Where)
from snapmla_jax.pallas_kernels.write_kv import row_layout

ROWS = 16  # query rows a CTA by default: the wgmma N of every product
# Features a fp32 promotion of the FP8 S^T product, as ``mla_decode_mgpu.QK_PROMOTION``. Every
# 128 features in 16-row blocks, where the call is bound by the cache's bytes: the kernel 315.4 vs
# 311.3 us at 64 x 32k x 16 and 312.7 vs 313.2 at 128 x 16k x 16 against one 512-feature chain
# (H200, jax 0.11.2, tools/time_mgpu_variants.py --kernel small --variants baseline promotion_512
# --kernel-trace-rounds 3), and it halves FP8's cost in answer bits on the long-context model
# served a token a call (docs/fidelity.md, "Q.K summed in float32 every 128 features").
QK_PROMOTION = 128
# The same for 32-row blocks, so that a 16-head model's numerics do not change with s_q (1 or 2).
# Bound by their own work there (the step profile in docs/design_notes.md, section 12), the
# shorter chains cost 0-2% of the kernel: 201.0 vs 201.7 us at 64 x 16k x 16 x 2 and 387.6 vs
# 378.9 at 128 x 16k x 32 against one chain (H200, tools/time_mgpu_variants.py --kernel small
# --block-rows 32 --kernel-trace-rounds 3, the variant of 128 against one chain; now
# ``promotion_32_rows_512`` against the shipped 128).
QK_PROMOTION_32_ROWS = 128
BLOCK_ROWS = (16, 32)  # the row blocks the kernel takes (``block_rows``)
QUERY_TERMS = (1, 2)  # FP8 terms of the query (``query_terms``)
QUERY_IN_KERNEL_ROWS = 16  # the row block that quantizes its query in the kernel (``runs_query_in_kernel``)
TOKENS = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector with one value per token (axis 0 of a [64, R] tile)
QROWS = plgpu.Layout.WGMMA.reduce(0)  # an [R] vector with one value per query row (axis 1)
# The warpgroup that issues the ring's TMAs (``begin_step``).
ISSUER = 1
# The row blocks in which it issues step j + 1's copies before waiting for step j's
# (``begin_step``): kernel 307.1 vs 307.7 us at 64 x 32k x 16, 160.2 vs 160.9 at 64 x 16k x 16,
# 270.1 vs 277.4 at 64 x 16k x 16 x 2 (two 16-row blocks; H200, tools/time_mgpu_variants.py
# --kernel small --variants baseline issue_after_wait --kernel-trace-rounds 3); in 32-row blocks
# 196.1 vs 201.7 at 64 x 16k x 16 x 2 and 380.2 vs 378.9 at 128 x 16k x 32 (``--block-rows 32``,
# against issuing after the wait; now the variant ``issue_after_wait``). With both this and
# 128-feature Q.K chains, 32-row blocks run 1.0-1.5% slower than with neither: 201.9 vs 199.8,
# 387.1 vs 381.5, and 203.7 vs 201.9 at 32 x 32k x 16 x 2 (``--compare-file``).
ISSUE_FIRST_ROWS = (16, 32)
# The row blocks in which a third warpgroup, the 64-row kernel's producer (``produce_steps``, its
# register split), issues the ring instead of warpgroup 1, where that split is honoured
# (``mla_decode_mgpu.PRODUCER_WG``). None: in 32-row blocks it was 11-13% slower (kernel 228.4 vs
# 206.2 us at 64 x 16k x 16 x 2, 439.7 vs 389.9 at 128 x 16k x 32, 69.3 vs 61.5 at 8 x 32k x 16 x 2),
# in 16-row blocks even (163.0 vs 163.2 at 64 x 16k x 16; H200, jax 0.11.2,
# tools/time_mgpu_variants.py --kernel small --variants baseline producer_32_rows / producer).
PRODUCER_ROWS = ()
WARPGROUP = 128  # threads a warpgroup
WARPS = WARPGROUP // 32  # warps a warpgroup
# Whether each warpgroup stores its row max of a step (``stats_s``) without the warpgroup barriers
# Pallas puts around every SMEM store (``mla_decode_mgpu.store_rows``): the statistics exchange's
# named barrier orders it (``NAMED_SYNC``). GPU only.
UNSYNCED_ROW_STORES = True
# The row blocks whose step's row max meets across warps and warpgroups in one SMEM exchange
# (``store_warp_maxima``: each warp's maxima, the statistics' named barrier, eight partials read
# by every thread) instead of a reduction across the warpgroup's warps (``token_reduce``) and
# then the warpgroups' exchange. GPU only, with ``NAMED_SYNC``. Kernel 194.2 vs 203.6 us at
# 64 x 16k x 16 x 2 and 377.5 vs 400.9 at 128 x 16k x 32 (32-row blocks), 158.1 vs 158.7 at
# 64 x 16k x 16 and 304.4 vs 303.9 at 64 x 32k x 16 (16-row blocks), the same output bits (H200,
# jax 0.11.2, tools/time_mgpu_variants.py --kernel small [--block-rows 32] --variants baseline
# two_exchanges --kernel-trace-rounds 5).
ONE_EXCHANGE_ROWS = (16, 32)
# Whether the issuing warpgroup loads the page ids of step j + 2 from the block table during step
# j (carried in the step loop) instead of when it issues that step: the load's latency was on its
# path (an issue took ~950 SM cycles whatever its copies). Kernel 194.7 vs 199.6 us at
# 64 x 16k x 16 x 2 and 374.8 vs 371.2 at 128 x 16k x 32 (32-row blocks), 157.2 vs 161.3 at
# 64 x 16k x 16, 307.5 vs 310.8 at 64 x 32k x 16, even at 8 x 32k (H200, jax 0.11.2,
# tools/time_mgpu_variants.py --kernel small [--block-rows 32] --variants baseline pages_at_issue
# --kernel-trace-rounds 5).
PREFETCH_PAGES = True

def half_scores_t(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scale, first_row, *, interpret: bool,
                  qk_promotion: int, rest=None) -> jax.Array:
    """S^T of this warpgroup's half of a step before the softmax scale, (K8.Q8^T * k_scale *
    q_scale + Kr.Qr^T), f32 [64, R]: the step's SMEM rows [first_row, first_row + 64) (a traced
    start must be a marked multiple of 64) against the query rows.

    q8_s e4m3 [4, R, 128], kv_slot e4m3 [4, 128, 128], qr_s bf16 [R, 64], rope_slot
    bf16 [128, 64], q_scale [R] (``QROWS``), k_scale [64] (``TOKENS``). ``rest``: None, or the
    query's second term (``quantize_query``), (q8 e4m3 [4, R, 128], its row scales [R]): its
    FP8 product against the same K tile is added, K8.Q8^T * q_scale + K8.Q8r^T * q_scale_r.

    fp32 promotion every ``qk_promotion`` features (``block_qk_promotion``), as
    ``mla_decode_mgpu``, every chain (of either term) in flight at once (one accumulator
    each, 8 registers at R = 16) under one wait; then the RoPE wgmma onto the scaled FP8
    product (the interpreter, which has no pre-initialised accumulators, adds it in registers).
    """
    rows = q8_s.shape[1]
    tokens = pl.ds(first_row, HALF)
    per_chain = qk_promotion // CHUNK
    firsts = range(0, NUM_CHUNKS, per_chain)
    acc = plgpu.ACC((HALF, rows), jnp.float32)
    terms = [q8_s] if rest is None else [q8_s, rest[0]]

    def qk8(*acc_refs):
        for t, term in enumerate(terms):
            for first, acc_ref in zip(firsts, acc_refs[t * len(firsts):]):
                for ch in range(first, first + per_chain):
                    plgpu.wgmma(acc_ref, kv_slot.at[ch, tokens], term.at[ch].transpose((1, 0)))
        values = [acc_ref[...] for acc_ref in acc_refs]
        return [functools.reduce(jnp.add, values[t * len(firsts):(t + 1) * len(firsts)]) for t in range(len(terms))]

    s8 = pl.run_scoped(qk8, *([acc] * (len(firsts) * len(terms))))
    by_query_row = lambda scale: lax.broadcast_in_dim(scale, (HALF, rows), [1])
    by_token = lax.broadcast_in_dim(k_scale, (HALF, rows), [0])
    if rest is None:
        scaled = s8[0] * by_token * by_query_row(q_scale)
    else:
        scaled = (s8[0] * by_query_row(q_scale) + s8[1] * by_query_row(rest[1])) * by_token

    def qk_rope(acc_ref):
        plgpu.wgmma(acc_ref, rope_slot.at[tokens], qr_s.transpose((1, 0)))

    if interpret:
        def qk_rope_value(acc_ref):
            qk_rope(acc_ref)
            return acc_ref[...]
        return scaled + pl.run_scoped(qk_rope_value, acc)
    return pl.run_state(qk_rope)(plgpu.ACC.init(scaled))


def visibility_t(row0, t0, seq_len, half, *, s_q: int, num_heads: int, rows: int,
                 token_stride: int = 2) -> jax.Array:
    """bool [64, R]: which tokens of a half step (SMEM row c: token t0 + 2c + half) each query
    row sees (row i * H + h is query position i: tokens below seq_len - s_q + i + 1; padding
    rows are capped at seq_len). ``token_stride`` 1, ``half`` 0: 64 consecutive tokens (the
    16-row BF16 twin's page), as ``mla_decode_mgpu.step_visibility`` takes them."""
    token_ids = plgpu.broadcasted_iota(jnp.int32, (HALF, rows), 0, layout=plgpu.Layout.WGMMA)
    tokens = t0 + token_stride * token_ids + half
    if s_q == 1:
        return tokens < seq_len
    row_ids = plgpu.broadcasted_iota(jnp.int32, (HALF, rows), 1, layout=plgpu.Layout.WGMMA)
    visible_len = jnp.minimum(seq_len - s_q + lax.div(row0 + row_ids, jnp.int32(num_heads)) + 1, seq_len)
    return tokens < visible_len


def token_reduce(x, op: str, scratch, *, interpret: bool) -> jax.Array:
    """x f32 [64, R] (WGMMA) reduced along the tokens (axis 0) by ``op`` ("max" or "add"): [R]
    (``QROWS``).

    The 64 tokens lie across the warpgroup's four warps, so the reduction meets at an SMEM
    scratch. Pallas' own reduction uses one scratch at a static offset for the whole kernel, and
    both warpgroups reduce here, at moments of their own: each reduces through its own scratch
    (``scratch`` f32 [REDUCE_SCRATCH], this warpgroup's), behind the warpgroup's own barrier
    (Mosaic GPU's ``FragmentedArray.reduce``). The interpreter gives every warpgroup its own
    values anyway.
    """
    if interpret:
        return x.max(axis=0) if op == "max" else x.sum(axis=0)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((x.shape[1],), jnp.float32, layout=QROWS))
    def reduce(ctx, x_fa, scratch_ref):
        del ctx
        return x_fa.reduce(op, 0, scratch=scratch_ref)

    return reduce(x, scratch)


def store_warp_maxima(x, dst_ref) -> None:
    """x f32 [64, R] (WGMMA): each warp's max along its 16 tokens, stored as row (warpgroup * 4 +
    warp) of dst_ref f32 [2, 4, R] (the consumers' eight warps). Shuffles within the warp, then
    eight bytes a store from every lane (the lanes of a column pair store the same value), no
    barrier: the caller's named barrier orders the stores before the reads. GPU only."""
    rows = x.shape[1]

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, x_fa, dst):
        del ctx
        regs = x_fa.registers
        if regs.shape != (1, rows // 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"store_warp_maxima: unexpected WGMMA registers {regs.shape}")
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        c32 = lambda v: mgpu_utils.c(v, i32)
        tid = mgpu_utils.thread_idx()
        warp = arith.andi(arith.shrui(tid, c32(5)), c32(NUM_WGS * WARPS - 1))  # the consumers' warps
        pair = arith.andi(tid, c32(3))  # this lane's column pair within each group of 8 columns
        row_bytes = arith.muli(warp, c32(rows * 4))
        base = mgpu_utils.memref_ptr(dst)
        for group in range(rows // 8):
            # Rows g and g + 8 of the warp's 16, then across the eight lanes of each column pair.
            value = arith.maximumf(regs[0, group, 0, 0, 0, 0, 0, 0, 0], regs[0, group, 0, 0, 1, 0, 0, 0, 0])
            for distance in (4, 8, 16):
                value = arith.maximumf(value, mgpu_utils.shfl_bfly(value, distance))
            column = arith.addi(c32(8 * group), arith.shli(pair, c32(1)))
            offset = arith.addi(row_bytes, arith.shli(column, c32(2)))
            llvm.store(value, mgpu_utils.getelementptr(base, [offset], i8))

    store(x, dst_ref)


def reduce_scratch_size(rows: int) -> int:
    """f32 elements of one warpgroup's ``token_reduce`` scratch: every lane of the four warps
    stores a 2-element partial of each of its R / 8 column pairs, at most two pairs at once (at
    R = 32 the reduction runs in two rounds, each between two warpgroup barriers). One round of
    all four pairs at R = 32 was slower: kernel 214.8 vs 206.8 us at 64 x 16k x 16 x 2, 410.8 vs
    399.9 at 128 x 16k x 32 (H200, tools/time_mgpu_variants.py --kernel small --block-rows 32
    --compare-file), its row max 1117 / 838 cycles a step against 1018 / 636."""
    return 4 * 32 * 2 * min(rows // 8, 2)


def softmax_frame_t(log_pv, inv_k_scale, m, l_tile, frame, log_pv_max, visible=None):
    """``mla_decode_mgpu.softmax_frame`` with rows and columns exchanged, for this warpgroup's
    half of a step: the same frame, P' and ratio.

    log_pv f32 [64, R]: score (base 2) + log2 k_scale, -inf where not visible; inv_k_scale [64]
    (``TOKENS``); per query row [R] (``QROWS``): m, the running max of log_pv; frame;
    log_pv_max, the step's max of log_pv over both halves. l_tile f32 [64, R]: this warpgroup's
    l' kept per token slot (its sum along the tokens is taken once, after the loop: no reduction
    across warps a step for l).

    Returns (m_new, l_tile_new, frame_new, P' f32 [64, R] (at most 448, 0 where not
    ``visible``), ratio [R]).
    """
    m_new = jnp.maximum(m, log_pv_max)
    frame_new = jnp.maximum(log_pv_max, m_new - FRAME_DROP)
    frame_safe = jnp.where(frame_new == -jnp.inf, 0.0, frame_new)  # no token seen yet: P' is 0
    ratio = jnp.exp2(frame - frame_safe)
    shape = log_pv.shape
    p8 = jnp.exp2(log_pv - lax.broadcast_in_dim(frame_safe - LOG2_FP8_MAX, shape, [1]))
    weights = p8 * lax.broadcast_in_dim(inv_k_scale, shape, [0])
    if visible is not None:
        weights = jnp.where(visible, weights, 0.0)  # 0 * a garbage scale's inverse could be NaN
    return m_new, l_tile * lax.broadcast_in_dim(ratio, shape, [1]) + weights, frame_new, p8, ratio


def pv_update_t(accs, p8_ref, kv_slot, wg, ratio, visible, t0, seq_len, *, interpret: bool) -> list:
    """acc * ratio + V^T.P'^T for each of this warpgroup's four O^T tiles [64 features, R]
    (``softmax_frame_t``): tile 2 i + t holds features 64 t .. 64 t + 63 of its chunk i.

    p8_ref e4m3 [R, 128]: the step's P' (both warpgroups' halves), the K-major B operand. On the
    GPU each tile's V^T is the register A operand (``mgpu_bytes.load_vt_quads``; its rows in
    ``vt_feature`` order, P''s columns in ``vt_step_row`` order, ``store_token_bytes``), the four
    products in flight at once, each into a fresh accumulator (accumulating in place would drop
    the running sum's low bits: ``mla_decode_mgpu``'s design notes). ``visible``: None or int32
    [64] (``ROW``) the number of the step's tokens below seq_len. The interpreter, which has no
    inline PTX, multiplies in registers in step-row order, tokens past seq_len zeroed.
    """
    shape = accs[0].shape
    chunks = [kv_slot.at[wg * CHUNKS_PER_WG + k // 2] for k in range(len(accs))]
    if interpret:
        p = p8_ref[...].astype(jnp.float32)  # [R, 128]
        step_rows = lax.broadcasted_iota(jnp.int32, (STEP, HALF), 0)
        tokens = t0 + jnp.where(step_rows < HALF, 2 * step_rows, 2 * (step_rows - HALF) + 1)
        fresh = []
        for k, chunk in enumerate(chunks):
            v = jnp.where(tokens < seq_len, chunk[:, pl.ds((k % 2) * HALF, HALF)].astype(jnp.float32), 0.0)
            fresh.append(lax.dot_general(v, p, (((0,), (1,)), ((), ())), precision=lax.Precision.HIGHEST))
    else:
        def products(*acc_refs):
            for k, (acc_ref, chunk) in enumerate(zip(acc_refs, chunks)):
                plgpu.wgmma(acc_ref, load_vt_quads(chunk, k % 2, visible), p8_ref.transpose((1, 0)))
            return [acc_ref[...] for acc_ref in acc_refs]

        fresh = pl.run_scoped(products, *([plgpu.ACC(shape, jnp.float32)] * len(accs)))
    ratio_b = lax.broadcast_in_dim(ratio, shape, [1])
    return [acc * ratio_b + f for acc, f in zip(accs, fresh)]


def quantize_query(q_in_s, q8_s, qsc_s, wg, *, interpret: bool, rest=None) -> None:
    """Warpgroup wg's half of the block's query rows quantized per row, ``fp8.quantize_per_token``'s
    math as the inputs launch's row CTAs run it (``write_kv.row_layout``, ``GROUP_ROWS`` rows at
    a time, a row's 512 values as four 128-value chunks): q_in_s bf16 [4, R, 128] -> q8_s e4m3
    [4, R, 128] and qsc_s f32 [R]. ``rest``: None, or (e4m3 [4, R, 128], f32 [R]) that take the
    second term, what the first leaves (q - q8 * q_scale in float32) quantized per row the same
    way (``query_rest``'s math)."""
    rows = q_in_s.shape[1]
    layout = row_layout(CHUNK, q_in_s.dtype)
    for g in range(rows // NUM_WGS // GROUP_ROWS):
        group = pl.ds(aligned(wg * (rows // NUM_WGS) + g * GROUP_ROWS, GROUP_ROWS), GROUP_ROWS)
        chunks = [plgpu.load(q_in_s.at[ch, group], layout=layout).astype(jnp.float32) for ch in range(NUM_CHUNKS)]
        q8_chunks, scale = quantized_rows(chunks, layout, interpret)
        if rest is not None:
            q8_chunks = list(q8_chunks)
        for ch, q8 in enumerate(q8_chunks):
            q8_s[ch, group, :] = q8
        qsc_s[group] = scale
        if rest is not None:
            rest_chunks, rest_scale = quantized_rows(
                [x - q8.astype(jnp.float32) * by_row(scale, x.shape, layout, interpret)
                 for x, q8 in zip(chunks, q8_chunks)], layout, interpret)
            for ch, q8 in enumerate(rest_chunks):
                rest[0][ch, group, :] = q8
            rest[1][group] = rest_scale


def query_rest(q_rows: jax.Array, q8: jax.Array, q_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The query's second FP8 term for rows quantized by the inputs launch: q_rows [B, rows, 512]
    (any float dtype), their quantization q8 e4m3 [B, P, 512] and q_scale f32 [B, P] (rows padded
    to P, zeros) -> what q8 leaves of each row (q - q8 * q_scale in float32) quantized per row,
    (e4m3 [B, P, 512], f32 [B, P]): ``quantize_query``'s second term, in XLA."""
    padded = jnp.pad(q_rows.astype(jnp.float32), ((0, 0), (0, q8.shape[1] - q_rows.shape[1]), (0, 0)))
    # The e4m3 values as the reference rounds them (a float8 conversion of x / scale may round a
    # midpoint the other way where XLA computes x * (1 / scale)).
    values, rest_scale = residual_per_token(padded, q8.astype(jnp.float32), q_scale)
    return values.astype(FP8_DTYPE), rest_scale


def parity_scales(ksc_s, slot, wg, *, page_size: int, interpret: bool) -> jax.Array:
    """This warpgroup's token scales of a step from ksc_s f32 [2 slots, 128], the step's pages of
    ``page_size`` tokens in token order (or [2 slots, 128 c / S, S] where a page's copy takes
    c = ``scale_copy_pages`` pages, the first its own): [64] (``TOKENS``), token 2c + wg at c,
    as the step order puts the tokens of parity wg in this warpgroup's SMEM rows.

    A TMA cannot read every other float, and Pallas' layout inference takes no strided view of
    SMEM, so on the GPU each thread loads its own values (two, as a ``TOKENS`` load of a
    contiguous [64] would) at the addresses ``mgpu.FragmentedArray.build`` gives their indices."""
    copied = scale_copy_pages(page_size)
    if interpret:
        pairs = ksc_s[slot].reshape(STEP // page_size, copied, page_size)[:, 0].reshape(HALF, 2)
        return jnp.where(wg == 0, pairs[:, 0], pairs[:, 1])

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((HALF,), jnp.float32, layout=TOKENS))
    def gather(ctx, step_ref):
        del ctx
        index = ir.IndexType.get()
        parity = arith.divui(gpu.thread_id(gpu.Dimension.x), arith.constant(index, WARPGROUP))
        constant = functools.partial(arith.constant, index)

        def address(c):
            token = arith.addi(arith.muli(c, constant(2)), parity)
            if copied == 1:
                return [token]
            page = arith.divui(token, constant(page_size))
            return [arith.muli(page, constant(copied)), arith.remui(token, constant(page_size))]

        return mgpu.FragmentedArray.build((HALF,), TOKENS.to_mgpu(), lambda c: memref.load(step_ref, address(c)))

    return gather(ksc_s.at[slot])


def block_qk_promotion(rows: int) -> int:
    """The fp32 promotion of the FP8 S^T products in ``rows``-row blocks when a call asks for none:
    ``QK_PROMOTION`` (16 rows) or ``QK_PROMOTION_32_ROWS``."""
    return QK_PROMOTION if rows == ROWS else QK_PROMOTION_32_ROWS


@for_used_items
def _kernel(*refs, query_in_kernel: bool, query_terms: int, **params):
    """``_cta`` on the launch's refs. With ``query_in_kernel`` the operands have no q_scale
    (their q_ref holds the bf16 query rows, their ksc_ref the cache's scale plane by page) and
    the scratch ends with the rows' staging tile and their barrier (``quantize_query``). With
    two ``query_terms`` the scratch ends with the second term's tiles (e4m3 [4, R, 128], f32
    [R]), and without ``query_in_kernel`` the operands end with that term (``query_rest``)."""
    if query_in_kernel:
        refs = (*refs[:5], None, *refs[5:])
    rest_in = rest_s = None
    if query_terms == 2:
        refs, rest_s = refs[:-2], refs[-2:]
        if not query_in_kernel:
            rest_in, refs = refs[10:12], (*refs[:10], *refs[12:])
    _cta(*refs, rest_in=rest_in, rest_s=rest_s, **params)


def _cta(seq_lens_ref, items_ref, bt_ref, off_ref, q_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
         o_ref, lse_ref, part_o_ref, part_lse_ref,
         q8_s, qr_s, qsc_s, lse_s, kv8_s, rope_s, ksc_s, p8_s, stats_s, lsum_s, red_s, o_s,
         step_bar, stats_bar, pexch_bar, consumed_bar, q_bar, end_bar, q_in_s=None, q_ready_bar=None,
         *, s_q: int, num_heads: int, scale_log2: float, partials: bool, num_pages: int, page_size: int,
         interpret: bool, qk_promotion: int, rest_in=None, rest_s=None):
    """One CTA: (work item w: a run of steps of batch row b, block of R query rows), two
    warpgroups (``consume``; with ``has_producer``, a third that only issues the ring);
    outputs as ``mla_decode_mgpu.OutputTarget``.

    Its query rows either arrive quantized (q_ref e4m3 [B, P, 512], qsc_ref f32 [B, P], ksc_ref
    the step-ordered token scales [B, steps * 128], all from the inputs launch) or, with qsc_ref
    None, as the bf16 rows (q_ref [B, P, 512]) that the warpgroups quantize into q8_s
    (``quantize_query``, through q_in_s bf16 [4, R, 128]; both meet at q_ready_bar, NUM_WGS
    arrivals, in the interpreter) beside the first step's copies, ksc_ref then the cache's
    scale plane [N / page_size, page_size] (``parity_scales``).

    SMEM (R = 16 or 32 rows): q8_s e4m3 [4, R, 128], qr_s bf16 [R, 64], qsc_s f32
    [R], lse_s f32 [R], kv8_s e4m3 [2, 4, 128, 128] and rope_s bf16 [2, 128, 64] (the
    ring, step order), ksc_s f32 [2, 128] (a slot's token scales), p8_s e4m3 [2, R, 128]
    (a slot's P', both warpgroups' halves, the B operand of both), stats_s f32 [2 slots, 2
    warpgroups, 4 warps, R] (each warp's row max of log_pv, or each warpgroup's in row 0:
    ``ONE_EXCHANGE_ROWS``), lsum_s f32 [2, R] (each warpgroup's l' after the loop), red_s f32 [2,
    ``reduce_scratch_size``] (each warpgroup's reduction scratch), o_s [2, R, 64] (each
    warpgroup's output staging tile, in the output's dtype).

    Slot reuse: both warpgroups store their halves of p8_s[slot] after step j's statistics
    exchange, which each reaches only after its P'.V of step j - 1 (the last read of
    p8_s[slot] was step j - 2's). The slot's next TMA (step j + 2) is issued after both
    warpgroups consumed step j. stats_s[slot] is rewritten two steps later, after both
    warpgroups have passed this step's P' exchange and so have read it.

    The query's second term (two ``query_terms``): rest_s = (e4m3 [4, R, 128], f32 [R]) in SMEM,
    made by ``quantize_query`` or, from rest_in = (e4m3 [B, P, 512], f32 [B, P]), copied with
    the first.
    """
    rows = q8_s.shape[1]
    query_in_kernel = qsc_ref is None
    producer = has_producer(rows)

    def issue_rest(b, row0, bar):
        for ch in range(NUM_CHUNKS):
            plgpu.copy_gmem_to_smem(rest_in[0].at[b, pl.ds(row0, rows), pl.ds(ch * CHUNK, CHUNK)], rest_s[0].at[ch],
                                    bar)
        plgpu.copy_gmem_to_smem(rest_in[1].at[b, pl.ds(row0, rows)], rest_s[1], bar)

    where, issue = begin_cta(
        seq_lens_ref, items_ref, bt_ref, off_ref, q_ref, qr_ref, qsc_ref, latp_ref, ropep_ref, ksc_ref,
        q_in_s if query_in_kernel else q8_s, qr_s, None if query_in_kernel else qsc_s, kv8_s, rope_s, ksc_s,
        step_bar, q_bar, s_q=s_q, num_pages=num_pages, page_size=page_size,
        issuer=NUM_WGS if producer else ISSUER, by_warps=producer_by_warps(page_size) if producer else None,
        issue_more_query=None if rest_in is None else issue_rest)
    _, wg, _, row0, _, _, _ = where
    consumers_issue = None if producer else issue  # with a producer, the ring is its work alone

    def consume():
        my_rows = aligned(wg * HALF, HALF)  # this warpgroup's half of each step's SMEM rows
        named_sync = NAMED_SYNC and not interpret
        one_exchange = named_sync and rows in ONE_EXCHANGE_ROWS
        my_scratch = red_s.at[wg]
        if query_in_kernel:
            quantize_query(q_in_s, q8_s, qsc_s, wg, interpret=interpret, rest=rest_s)
            plgpu.commit_smem()  # the rows' stores before the products (the async proxy) read them
            meet(STATS_SYNC_ID, q_ready_bar, named_sync)

        def step(j, carry, *, where: Where, masked: bool):
            carry, pages = carry[:len(carry) - num_prefetched], carry[len(carry) - num_prefetched:]
            accs, (m, l_tile, frame) = carry[:-3], carry[-3:]
            t0 = (where.first_step + j) * STEP
            # The named scopes are the phases tools/profile_mgpu_steps.py --kernel small times on the
            # GPU (the on-device profiler records them when ``mla_decode_mgpu.COMPILER_PARAMS`` asks).
            with jax.named_scope("wait_step"):
                slot = begin_step(j, wg, where.first_step, where.num_steps, consumers_issue, step_bar,
                                  consumed_bar, issuer=ISSUER, issue_first=rows in ISSUE_FIRST_ROWS,
                                  pages=pages or None)
                if num_prefetched:  # the page ids of the step issued next time, loaded under this one
                    pages = next_pages(where.first_step + j + 2)
            with jax.named_scope("qk"):
                if query_in_kernel:
                    k_scale = parity_scales(ksc_s, slot, wg, page_size=page_size, interpret=interpret)
                else:
                    k_scale = plgpu.load(ksc_s.at[slot, pl.ds(my_rows, HALF)], layout=TOKENS)
                rest = None if rest_s is None else (rest_s[0], plgpu.load(rest_s[1], layout=QROWS))
                scores = half_scores_t(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot], plgpu.load(qsc_s, layout=QROWS),
                                       k_scale, my_rows, interpret=interpret, qk_promotion=qk_promotion, rest=rest)
            with jax.named_scope("stats"):
                # The log2 and reciprocal of the token scales (``mgpu_decode_inputs.with_scale_planes``'
                # math) cost two values a thread a step here; as planes from the inputs launch they cost
                # 8 bytes a token written there and read here: 0.339 vs 0.349 ms a call at 64 x 32k x 16
                # (kernel 316 vs 323 us), the same within noise at 8 x 32k, 1 x 32k and 32 x 16k x 2
                # (H200, tools/time_mgpu_variants.py --kernel small --compare-file).
                floored = jnp.maximum(k_scale, SCALE_FLOOR)
                log_pv = scores * scale_log2 + lax.broadcast_in_dim(jnp.log2(floored), scores.shape, [0])
                visible = None
                if masked:  # masked slots may hold any bytes, NaN included
                    visible = visibility_t(row0, t0, where.seq_len, wg, s_q=s_q, num_heads=num_heads, rows=rows)
                    log_pv = jnp.where(visible, log_pv, -jnp.inf)
                # The step's row max over both halves: each warp's maxima through SMEM, or each
                # warpgroup's own (reduced across its warps), exchanged through SMEM.
                if one_exchange:
                    store_warp_maxima(log_pv, stats_s.at[slot])
                else:
                    log_pv_max = token_reduce(log_pv, "max", my_scratch, interpret=interpret)
                    store_rows((log_pv_max,), stats_s.at[slot, wg, pl.ds(0, 1)], layout=QROWS,
                               unsynced=named_sync and UNSYNCED_ROW_STORES)
            with jax.named_scope("wait_stats"):
                meet(STATS_SYNC_ID, stats_bar.at[slot], named_sync)
                if one_exchange:
                    maxima = [plgpu.load(stats_s.at[slot, g, w], layout=QROWS)
                              for g in range(NUM_WGS) for w in range(WARPS)]
                    while len(maxima) > 1:
                        maxima = [jnp.maximum(a, b) for a, b in zip(maxima[::2], maxima[1::2])]
                    log_pv_max = maxima[0]
                else:
                    log_pv_max = jnp.maximum(log_pv_max, plgpu.load(stats_s.at[slot, 1 - wg, 0], layout=QROWS))
            with jax.named_scope("softmax"):
                m, l_tile, frame, p8, ratio = softmax_frame_t(log_pv, 1.0 / floored, m, l_tile, frame, log_pv_max,
                                                              visible)
                p8 = jnp.minimum(p8, FP8_E4M3_MAX).astype(FP8_DTYPE)  # the SnapMLA math: P' in e4m3
            with jax.named_scope("p_store"):
                if interpret:
                    p8_s[slot, :, pl.ds(my_rows, HALF)] = p8.T
                else:
                    store_token_bytes(p8, p8_s.at[slot])
                publish_p(None if named_sync else pexch_bar.at[slot])
            with jax.named_scope("wait_p"):
                gather_p(None if named_sync else pexch_bar.at[slot])  # the other warpgroup's half of P'
            with jax.named_scope("pv"):
                visible_count = None
                if masked and not interpret:
                    visible_count = plgpu.layout_cast(jnp.full((HALF,), where.seq_len - t0, jnp.int32), ROW)
                new_accs = pv_update_t(accs, p8_s.at[slot], kv8_s.at[slot], wg, ratio, visible_count, t0,
                                       where.seq_len, interpret=interpret)
                plgpu.barrier_arrive(consumed_bar.at[slot])
            return (*new_accs, m, l_tile, frame, *pages)

        num_accs = 2 * CHUNKS_PER_WG  # O^T tiles [64 features, R]
        *accs, m0, _ = initial_carry((HALF, rows), rows_axis=1, num_accs=num_accs)
        l_tile0 = plgpu.layout_cast(jnp.zeros((HALF, rows), jnp.float32), plgpu.Layout.WGMMA)
        # With the issue in the consumers, the page ids of the step after next ride in the carry.
        num_prefetched = STEP // page_size if PREFETCH_PAGES and not producer else 0
        next_pages = lambda step: tuple(step_pages(bt_ref, where.b, step, num_pages, page_size))
        prefetched = next_pages(where.first_step + 1) if num_prefetched else ()
        carry = walk_steps(step, (*accs, m0, l_tile0, m0, *prefetched), where, consumed_bar,
                           issuer=None if producer else ISSUER)
        accs, l_tile, frame = carry[:num_accs], carry[num_accs + 1], carry[num_accs + 2]
        lsum_s[wg] = token_reduce(l_tile, "add", my_scratch, interpret=interpret)
        # Both warpgroups have stored their l'.
        plgpu.barrier_arrive(end_bar)
        plgpu.barrier_wait(end_bar)
        l = plgpu.load(lsum_s.at[wg], layout=QROWS) + plgpu.load(lsum_s.at[1 - wg], layout=QROWS)
        # Per query row, what the accumulators are multiplied by: 1 / l' (0 for rows that saw no token).
        seen = l > 0
        inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        target = output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials)
        # lse (base 2) = frame + log2(l') - log2 448 (``softmax_frame_t``): ``write_outputs_t`` adds log2(l').
        write_outputs_t(accs, frame - LOG2_FP8_MAX, l, inv_l, o_s, lse_s, target, row0, wg, interpret=interpret)

    if not producer:
        consume()
        return
    specialize_warpgroups(wg, functools.partial(produce_steps, issue, where.first_step, where.num_steps, consumed_bar),
                          consume, mgpu_kernel.PRODUCER_REGISTERS, mgpu_kernel.CONSUMER_REGISTERS)


def has_producer(rows: int) -> bool:
    """Whether blocks of ``rows`` query rows run a producer warpgroup (``PRODUCER_ROWS``)."""
    return mgpu_kernel.PRODUCER_WG and rows in PRODUCER_ROWS


def meet(barrier_id: int, bar, named_sync: bool) -> None:
    """Both warpgroups meet: at hardware named barrier ``barrier_id`` (``consumers_sync``,
    ``named_sync``), else at mbarrier ``bar`` (NUM_WGS arrivals; the interpreter)."""
    if named_sync:
        consumers_sync(barrier_id)
    else:
        plgpu.barrier_arrive(bar)
        plgpu.barrier_wait(bar)


def runs_query_in_kernel(q_rows: jax.Array, q_rope_rows: jax.Array, *, block_rows: int) -> bool:
    """Whether ``mla_decode_mgpu_small`` takes its query rows and token scales in the kernel
    (``quantize_query``, ``parity_scales``) instead of from the inputs launch: 16-row blocks (the
    bf16 staging tile's 16 KB fits beside the rest; at 32 rows it would not) of bf16 rows that
    are whole blocks (no padding to make). Then the call is the kernel, the plan-only launch for a
    balanced plan (``plan_items``; a uniform plan is a constant) and, with splits, the merge."""
    return (block_rows == QUERY_IN_KERNEL_ROWS and q_rows.shape[1] % block_rows == 0
            and q_rows.dtype == q_rope_rows.dtype == jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "block_rows", "num_pages", "query_in_kernel", "segments",
                                             "query_terms", "interpret", "qk_promotion"))
def mla_decode_mgpu_small(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                          seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                          s_q: int, num_heads: int, num_splits: int = 1, balanced: bool = False,
                          block_rows: int = ROWS, num_pages: int | None = None, query_in_kernel: bool | None = None,
                          segments: int = 0, query_terms: int = 1, interpret: bool = False,
                          qk_promotion: int | None = None) -> tuple[jax.Array, jax.Array]:
    """FP8 decode for blocks of ``block_rows`` (16 or 32) query rows; arguments and results as
    ``mla_decode_mgpu``'s (``num_splits``, ``balanced``, ``segments`` and ``num_pages`` included): q_rows
    [B, rows, 512] of any rows (padded to whole blocks of ``block_rows`` in the inputs launch).
    ``query_in_kernel``: the query rows quantized and the token scales read in the kernel, no
    inputs launch (None: where ``runs_query_in_kernel`` says it can; False: never).
    ``query_terms``: 1, the query rounded to e4m3 once a row (SnapMLA's), or 2 (16-row blocks):
    also what that rounding leaves, as a second FP8 term with its own row scales, both products
    against the same K tile (``mla_decode_reference``'s ``query_terms``). ``qk_promotion``: the
    features a fp32 sum of the FP8 S^T products covers (``mla_decode_mgpu.QK_PROMOTIONS``; None:
    ``block_qk_promotion``, 128)."""
    check_qk_promotion(qk_promotion)
    if block_rows not in BLOCK_ROWS:
        raise ValueError(f"block_rows: expected one of {BLOCK_ROWS}, got {block_rows!r}")
    if query_terms not in QUERY_TERMS or (query_terms == 2 and block_rows != QUERY_IN_KERNEL_ROWS):
        raise ValueError(f"query_terms: expected one of {QUERY_TERMS} (2 in {QUERY_IN_KERNEL_ROWS}-row blocks, whose "
                         f"SMEM holds the second term), got {query_terms!r} in {block_rows}-row blocks")
    rows = block_rows
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    can = runs_query_in_kernel(q_rows, q_rope_rows, block_rows=rows)
    if query_in_kernel and not can:
        raise ValueError(f"query_in_kernel: takes {QUERY_IN_KERNEL_ROWS}-row blocks of bf16 rows, got {rows}-row "
                         f"blocks, {q_rows.shape[1]} rows of {q_rows.dtype} (RoPE part {q_rope_rows.dtype})")
    in_kernel = can if query_in_kernel is None else query_in_kernel
    out_dtype = partial_dtype(q_rows.dtype)  # output and partials: bf16 for a bf16 output, else float32
    copied = scale_copy_pages(page_size)  # pages a page's scale copy takes (``parity_scales``)
    if in_kernel:
        check_launch("mla_decode_mgpu_small: FP8 cache", q_rows, q_rope_rows, cache_arrays, page_size=page_size,
                     num_arrays=3, block_rows=rows, num_splits=num_splits, page_sizes=PAGE_SIZES)
        latent, scale, rope = cache_arrays
        plan = plan_items(seq_lens, block_table, num_splits=num_splits, balanced=balanced, step_tokens=STEP,
                          page_size=page_size, segments=segments, interpret=interpret)
        # The latent and RoPE parts as token pairs (the step order's boxes) and the scales by page.
        operands = (q_rows, q_rope_rows, latent.reshape(-1, 2, RANK), scale.reshape(-1, page_size),
                    rope.reshape(-1, 2, ROPE))
        num_rows = q_rows.shape[1]
    else:
        q8, q_scale, q_rope, latent_pairs, rope_pairs, scales, plan = prepare_inputs(
            q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, page_size=page_size,
            num_splits=num_splits, balanced=balanced, num_pages=num_pages, block_rows=rows, scale_planes=False,
            segments=segments, interpret=interpret)
        operands = (q8, q_scale, q_rope, latent_pairs, scales, rope_pairs)
        if query_terms == 2:
            operands += query_rest(q_rows, q8, q_scale)
        num_rows = q8.shape[1]  # padded to whole blocks
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, num_pages=num_pages, page_size=page_size, interpret=interpret,
                          query_in_kernel=in_kernel, query_terms=query_terms,
                          qk_promotion=block_qk_promotion(rows) if qk_promotion is None else qk_promotion),
        out_type=output_types(plan, num_rows, out_dtype),
        scratch_types=[
            plgpu.SMEM((NUM_CHUNKS, rows, CHUNK), FP8_DTYPE),
            plgpu.SMEM((rows, ROPE), jnp.bfloat16),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), FP8_DTYPE),
            plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, STEP // page_size * copied, page_size) if in_kernel and copied > 1
                       else (NUM_SLOTS, STEP), jnp.float32),
            # P' (``store_token_bytes``): its byte stores compute addresses for this layout.
            plgpu.SMEM((NUM_SLOTS, rows, STEP), FP8_DTYPE, transforms=BYTE_TILE_TRANSFORMS),
            plgpu.SMEM((NUM_SLOTS, NUM_WGS, WARPS, rows), jnp.float32),  # each warp's row max of a step
            plgpu.SMEM((NUM_WGS, rows), jnp.float32),
            plgpu.SMEM((NUM_WGS, reduce_scratch_size(rows)), jnp.float32),
            plgpu.SMEM((NUM_WGS, rows, HALF), out_dtype, transforms=() if interpret else output_transforms(out_dtype)),
            # The scales of a step by page are a copy a page (``step_issuer``).
            plgpu.Barrier(num_arrivals=step_copies(page_size, STEP // page_size if in_kernel else 1),
                          num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),  # statistics (the interpreter)
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),  # P'^T halves (the interpreter)
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),  # consumed (both warpgroups)
            # No q_scale copy when the kernel makes it; the second term's copies (``issue_rest``).
            plgpu.Barrier(num_arrivals=COPIES_Q - in_kernel + (NUM_CHUNKS + 1) * (query_terms == 2 and not in_kernel)),
            plgpu.Barrier(num_arrivals=NUM_WGS),
            *([plgpu.SMEM((NUM_CHUNKS, rows, CHUNK), jnp.bfloat16), plgpu.Barrier(num_arrivals=NUM_WGS)]
              if in_kernel else []),
            *([plgpu.SMEM((NUM_CHUNKS, rows, CHUNK), FP8_DTYPE), plgpu.SMEM((rows,), jnp.float32)]
              if query_terms == 2 else []),
        ],
        # Its reductions across warps bring their own scratch (``token_reduce``).
        **grid_params(plan, num_rows // rows, "snapmla_decode_fp8_mgpu_small", interpret,
                      num_threads=NUM_WGS + has_producer(rows), reduction_scratch_bytes=0),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, *operands)
    out, lse = merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, interpret=interpret)
    return unpadded(out, lse, q_rows.shape[1])
