"""SnapMLA FP8 MLA decode on Mosaic GPU (Hopper wgmma + TMA), 64 query rows a CTA.

What ``snapmla_jax.mla_decode`` runs over an fp8 cache of pages of a multiple of 16 tokens on
Hopper for more than 32 query rows (``snapmla_jax.decode.mosaic_kernel``). Its reference is
``mla_decode_reference(..., block_n=128)``; ``interpret=True`` runs it in the Mosaic GPU
interpreter on CPU.

Arguments of ``mla_decode_mgpu`` (an FP8 cache of pages of ``page_size`` 16, 32 or 64 tokens,
``PAGE_SIZES``: a step's 128 tokens are 8, 4 or 2 pages):

  q_rows       [B, rows, 512] bf16 or f32, rows = s_q * H (query position major)
  q_rope_rows  [B, rows, 64] bf16 or f32
  cache_arrays (latent [N, 512] e4m3, scale [N] f32, rope [N, 64] bf16): flat token rows
  block_table  [B, max_pages] int32; seq_lens [B] int32
  layer_offset [1] int32: the layer's first token row, a multiple of page_size
  -> out [B, rows, 512] in q_rows' dtype, lse [B, rows] f32 (natural log)

Scaling math, per 128-token step and query row, in base 2. Q8, q_scale: the query quantized
per row by the inputs launch (``mgpu_decode_inputs``); K8 = V8 the cached latent, k_scale its
per-token scale:

  score  = (Q8.K8^T * q_scale * k_scale + Qr.Kr^T) * softmax_scale * log2(e)
  log_pv = score + log2 k_scale                       the log of P * k_scale
  m      = max(m, max_t log_pv)                       over the whole step
  frame  = max(max_t log_pv, m - FRAME_DROP)          what O' and l' are relative to
  ratio  = 2^(frame_old - frame)
  P'     = 2^(log_pv - frame + log2 448)              the step's largest P * k_scale is 448
  O'     = O' * ratio + e4m3(P').V8                   FP8 wgmma, f32 accumulators
  l'     = l' * ratio + sum_t P' / k_scale
  out    = O' / l',   lse = (frame + log2 l' - log2 448) * ln 2

Work layout. Grid: (work item of the split plan, ``split_plan``; block of 64 query rows). A CTA
runs three warpgroups: a producer that only issues the TMA ring (``produce_steps``) and two
consumers. Consumer w owns output features [256 w, 256 w + 256) and scores half of each step's
tokens, SMEM rows [64 w, 64 w + 64); per step the consumers exchange through SMEM the row max of
log_pv (``publish_stats``, ``gather_stats``) and their halves of P' (``publish_p``,
``gather_p``), at hardware named barriers of their 256 threads.

Step order. The TMA brings a step's even tokens to SMEM rows 0..63 and its odd ones to rows
64..127 (strided boxes of a free [N/2, 2, 512] view of the cache, ``page_boxes``). Scores, RoPE
rows and token scales follow that order; the inputs launch gathers the token scales per batch row
in it, with their log2 and reciprocals (``scale_planes``).

P'.V, transposed. An FP8 wgmma takes SMEM operands K-major only and the ring holds V token-major,
so each consumer computes O^T = V^T.P'^T: V^T is the register A operand, built from the slot
(``mgpu_bytes.load_vt_quads``), and P' the SMEM B operand (``store_quads``). A thread then holds
16 query rows' columns: hence one factor a step (the frame), products waited for one at a time
(``pv_update_t``) and an output store that puts features and rows back (``store_feature_pairs``).

Masking: only a row's last step, or last two with s_q > 1, can hold tokens a query row must not
see; the steps before them run a loop without masks (``walk_steps``).

Interpreter: it runs no inline PTX and has no pre-initialised accumulators. There V is read
transposed as an SMEM A operand (masked in place once both consumers' Q.K have read the slot,
``qk_done``), P' is stored unpacked, the RoPE product is added in registers, the consumers meet at
mbarriers and the O^T tiles leave through a transpose. Ring and barriers are the hardware code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import nvvm

from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import GRID_YZ_MAX
from snapmla_jax.pallas_kernels.mgpu_bytes import (BYTE_TILE_TRANSFORMS, load_vt_quads, output_transforms,
                                                   store_feature_pairs, store_quads)
from snapmla_jax.pallas_kernels.combine_splits import partial_dtype
from snapmla_jax.pallas_kernels.combine_splits_mgpu import combine_items_mgpu, combine_splits_mgpu
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import FP8_PAGE_SIZES as PAGE_SIZES
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import (balanced_plan_kernel, decode_inputs, decode_inputs_and_plan,
                                                        scale_copy_pages)
from snapmla_jax.pallas_kernels.mla_decode_reference import LN2, LOG2E, STEP, resolve_num_pages
from snapmla_jax.pallas_kernels.split_plan import (SplitPlan, balanced_items, cta_item, cta_steps, uniform_plan,
                                                   wave_plan)

PAGE = 64  # cache page size the kernels are built around (``PAGE_SIZES``: the ones they take)
# STEP (mla_decode_reference): 128 tokens a step, two pages (four of 32 tokens, eight of 16); the
# reference rounds P' per step as the kernels do.
HALF = STEP // 2  # a consumer's tokens a step
BLOCK_M = 64  # query rows a CTA (one wgmma M)
CHUNK = 128  # output features an accumulator, and the K width of each Q.K wgmma
RANK = 512
ROPE = 64
NUM_CHUNKS = RANK // CHUNK
NUM_WGS = 2  # consumer warpgroups
CHUNKS_PER_WG = NUM_CHUNKS // NUM_WGS
NUM_SLOTS = 2  # TMA ring slots, a whole step each
COPIES_Q = NUM_CHUNKS + 2  # Q8 chunks, Q rope, q scale
# Features a fp32 promotion of the FP8 Q.K product (Hopper's FP8 wgmma accumulates in ~14 bits;
# ``qk8_promoted``). One 512-feature chain: 0.467 vs 0.508 ms for two of 256 at 64 x 16k x 128
# (H100, tools/time_mgpu_variants.py --variants baseline promotion_256); error against exact
# attention 2.066% vs 2.067% (tools/qk_precision.py).
QK_PROMOTION = 512
QK_PROMOTIONS = (128, 256, 512)  # the promotions a call may ask for (``qk_promotion``)
# Whether the four warps of the issuing warpgroup share a step's TMA issue (``step_issuer``):
# one thread issuing all 21 copies ran 1.06-1.09x slower without a producer warpgroup
# (H100, tools/time_mgpu_variants.py --variants no_producer issue_by_one_thread).
ISSUE_BY_WARPS = True
# ptxas honours ``setmaxnreg`` (the producer / consumer register split below) only when it compiles
# a kernel whole. Under jax 0.12.0 (0.12.0.1) Mosaic GPU kernels are JIT-linked, and ptxas reports
# "(C7504) 'setmaxnreg' ignored to maintain compatibility across compilation units": every thread
# keeps 168 registers and the consumers spill 1560 bytes (392 under 0.11.2). H200, 64 x 16k x 128:
# jax 0.11.2 with a producer 0.384 ms; jax 0.12.0.1 with one 0.805, without 0.487. jax 0.12.1
# honours it again: no C7504, 236 bytes spilled, and on an H100 at 64 x 16k x 128 0.386 ms with a
# producer against 0.450 without (jax 0.11.2 on the same GPU: 0.397 / 0.450)
# (tools/time_mgpu_variants.py --variants baseline with_producer under 0.12.0 and 0.12.1).
SETMAXNREG_HONOURED = not (0, 12) <= jax.__version_info__ < (0, 12, 1)
# Whether a third warpgroup, the producer, issues the TMA ring while the two consumers only
# compute (FA3's warp specialization): 0.817 vs 0.861 ms at 64 x 16k x 128 without it (H100,
# tools/time_mgpu_variants.py --variants baseline no_producer). It needs the register split.
PRODUCER_WG = SETMAXNREG_HONOURED
# Registers a thread (``plgpu.set_max_registers``) of the producer and the consumers: the kernel
# starts at 168 (65536 over 384 threads) and producer + 2 x consumer must stay <= 504
# (``check_registers``). 24 / 240 spills least: 0.512 vs 0.562 ms for 40 / 232 at
# 64 x 16k x 128 (H100, tools/time_mgpu_variants.py --variants baseline registers_40_232).
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
# Whether the producer's four warps share a step's TMA issue: the issue is off the consumers' path
# there, and sharing a step's 21 copies of 64-token pages cost 0.873 vs 0.836 ms
# (tools/time_mgpu_variants.py --variants producer_by_warps). Over pages of fewer tokens than
# PRODUCER_BY_WARPS_BELOW the warps share it anyway (``producer_by_warps``).
PRODUCER_ISSUE_BY_WARPS = False
# Over 16- and 32-token pages a step's 81 or 41 copies from one thread set its pace (round-robin,
# H200, jax 0.11.2, the same bits either way; shared vs one thread): 16-token pages 0.216 vs 0.276
# ms at 32 x 16k x 128, 0.122 vs 0.152 at 8 x 32k x 128, 0.243 vs 0.299 at 64 x 16k x 64;
# 32-token pages 0.213 vs 0.231, 0.117 vs 0.129, 0.235 vs 0.257; over 64-token pages 0.207 vs
# 0.205 at 32 x 16k x 128.
PRODUCER_BY_WARPS_BELOW = 64


def producer_by_warps(page_size: int) -> bool:
    """Whether the producer's warps share the issue of a step over ``page_size``-token pages."""
    return PRODUCER_ISSUE_BY_WARPS or page_size < PRODUCER_BY_WARPS_BELOW


# Whether the producer loads a step's page ids from the block table before it waits for the
# slot's consumption, so that the load's latency runs under the wait instead of before the copies.
# Kernel 371.7 vs 375.0 us at 64 x 16k x 128, 371.1 vs 384.9 at 32 x 16k x 128 x 2, 196.6 vs 198.2
# at 128 x 4k x 128 (H200, jax 0.11.2, tools/time_mgpu_variants.py --variants baseline
# producer_pages_after_wait --kernel-trace-rounds 5).
PRODUCER_PREFETCH_PAGES = True
# Extra ``plgpu.CompilerParams`` for the Mosaic decode kernels (``grid_params``): None in the
# library; tools/profile_mgpu_steps.py sets the on-device profiler's here.
COMPILER_PARAMS: plgpu.CompilerParams | None = None
# Whether the Mosaic decode kernels compile exp2 and log2 to ``ex2.approx.ftz`` / ``lg2.approx.ftz``:
# the precise log2 of the token scales was a ~28-instruction polynomial, 480 of the unmasked step's
# 1897 PTX instructions (tools/ptx_line_costs.py). lg2.approx's ~2^-22 error is far below e4m3's
# 2^-4, and flushed subnormals change no fp32 sum.
APPROX_MATH = True
# Whether P' goes to e4m3 by the GPU's saturating cast (``cvt.rn.satfinite``) alone, without a
# clamp to 448 before it (32 ``min`` a thread a step); P' is never NaN.
SATURATING_P_CAST = True
FRAME_DROP = 64.0  # how far (base 2) a row's frame may sit below its running max (``softmax_frame``)
LOG2_FP8_MAX = math.log2(FP8_E4M3_MAX)  # P' = 2^(log_pv - frame + this) <= 448
# Whether the consumers exchange a step's statistics and P' at hardware named barriers
# (``consumers_sync``: one ``bar.sync`` of 256 threads) instead of mbarriers (each thread's arrive,
# then a try_wait loop). GPU only. Ids 0 (the CTA) and 1..3 (one per warpgroup) are Mosaic GPU's.
NAMED_SYNC = True
STATS_SYNC_ID, P_SYNC_ID = 8, 9
# Whether the step's per-row SMEM stores (published statistics, the fold's factors) skip the
# warpgroup barriers Pallas puts around every SMEM store (``store_rows``): the named barrier
# behind which each is read orders them. GPU only, with ``NAMED_SYNC``. 0.432 vs 0.457 ms at
# 64 x 16k x 128 (H100, tools/time_mgpu_variants.py --variants baseline synced_row_stores).
UNSYNCED_ROW_STORES = True
# Whether P''s stores reach the wgmma behind a proxy fence and the P' exchange's named barrier
# alone (``publish_p``), without the warpgroup barrier ``plgpu.commit_smem`` adds. GPU only, with
# ``NAMED_SYNC``. 0.422 vs 0.432 ms at 32 x 16k x 128 x 2 (H100, tools/time_mgpu_variants.py
# --shape 32x16384x128x2 --variants baseline commit_with_barrier).
FENCE_ONLY_COMMIT = True


ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector with one value per score row
COL = plgpu.Layout.WGMMA.reduce(0)  # a [64] vector with one value per score column


def aligned(index, multiple: int):
    """``index`` marked as a multiple of ``multiple`` for layout inference (python ints pass through).

    Without it, a dynamic TMA start is only known to be a multiple of 1, and
    Mosaic GPU's layout inference cannot pick a tiled SMEM layout for the
    destination: it searches until its fuel runs out ("failed to find a
    solution").
    """
    return index if isinstance(index, int) else pl.multiple_of(index, multiple)


def step_visibility(row0, t0, seq_len, half: int, *, s_q: int, num_heads: int, token_stride: int = 2) -> jax.Array:
    """bool [64, 64]: which of 64 score columns each query row may see, column k holding token
    t0 + token_stride * k + half (this kernel: a step's half, ``half`` 0 its even tokens, 1 its
    odd ones; ``token_stride`` 1, ``half`` 0: 64 consecutive tokens, the BF16 twin's step).

    Row i * H + h is query position i: it sees tokens below seq_len - s_q + i + 1
    (padding rows past s_q * H are capped at seq_len).
    """
    col_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, HALF), 1, layout=plgpu.Layout.WGMMA)
    tokens = t0 + token_stride * col_ids + half
    if s_q == 1:
        return tokens < seq_len  # padding rows see all tokens too; the caller slices them off
    row_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, HALF), 0, layout=plgpu.Layout.WGMMA)
    visible_len = jnp.minimum(seq_len - s_q + lax.div(row0 + row_ids, jnp.int32(num_heads)) + 1, seq_len)
    return tokens < visible_len


def step_page_columns(step, max_pages: int, per_step: int = 2) -> tuple:
    """The block-table columns of a step's ``per_step`` pages (``page_boxes``), clamped into the
    table: with a ``max_pages`` multiple of ``per_step``, the step (so that they stay adjacent),
    else each page."""
    if max_pages % per_step == 0:
        first = jnp.minimum(step, max_pages // per_step - 1) * per_step
        return tuple(first + k for k in range(per_step))
    return tuple(jnp.minimum(step * per_step + k, max_pages - 1) for k in range(per_step))


def step_pages(bt_ref, b, step, num_pages: int, page_size: int = PAGE):
    """The page ids of a step's pages of ``page_size`` tokens (``step_page_columns``), clipped
    into [0, num_pages): a generator, read as ``page_boxes`` needs them."""
    columns = step_page_columns(step, bt_ref.shape[1], STEP // page_size)
    return (jnp.clip(bt_ref[b, column], 0, num_pages - 1) for column in columns)


def step_copies(page_size: int, scale_copies: int = 1) -> int:
    """TMA copies arriving on a slot's barrier a step of ``page_size``-token pages: per page and
    token parity the latent chunks and the RoPE rows, and ``scale_copies`` of token scales."""
    return STEP // page_size * 2 * (NUM_CHUNKS + 1) + scale_copies


def page_boxes(pages, layer_offset, page_size: int = PAGE):
    """TMA boxes of a step of ``pages`` (``step_pages``), yielding (page, parity, source token
    pairs, destination rows): per page of the step and token parity, the pairs ``pl.ds`` in the
    [N/2, 2, ...] pair views and the page_size / 2 step-order rows (even tokens to rows 0..63)
    they fill.

    Pages past the table's end (only in a partial last step) are clamped; their
    tokens are masked. Page ids are clipped into [0, num_pages) (a traced block
    table is not validated), as the XLA reference's gather clips them.

    With an even number of table columns the step is clamped, not each page
    (``step_page_columns``): the step's two ids are then adjacent and ptxas reads them in one
    64-bit load, not two dependent 32-bit ones (2.9-3.5% of the kernel at 32 x 16k-64k x 128 on
    an H100).
    """
    pairs = page_size // 2
    for k, page in enumerate(pages):
        # layer_offset is a multiple of page_size: the TMA boxes start on whole pages.
        first_pair = aligned((layer_offset + page * page_size) // 2, pairs)
        for parity in range(2):
            yield page, parity, pl.ds(first_pair, pairs), pl.ds(parity * HALF + k * pairs, pairs)


def issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, bar) -> None:
    """TMA of a row block's query tiles (as many rows as q8_s [4, rows, 128] holds): 4 chunks
    (FP8, or bf16 for the BF16 twin), the RoPE part and, unless qsc_ref is None (the twin), the
    per-row scale."""
    rows = q8_s.shape[1]
    for ch in range(NUM_CHUNKS):
        plgpu.copy_gmem_to_smem(q8_ref.at[b, pl.ds(row0, rows), pl.ds(ch * CHUNK, CHUNK)], q8_s.at[ch], bar)
    plgpu.copy_gmem_to_smem(qr_ref.at[b, pl.ds(row0, rows)], qr_s, bar)
    if qsc_ref is not None:
        plgpu.copy_gmem_to_smem(qsc_ref.at[b, pl.ds(row0, rows)], qsc_s, bar)


def qk8_promoted(q8_s, kv_slot, rows, qk_promotion: int) -> jax.Array:
    """Q8.K8^T of a slot's step rows ``rows`` (64), f32 [64, 64]: q8_s e4m3 [4, 64, 128], kv_slot
    e4m3 [4, 128, 128].

    Hopper's FP8 wgmma keeps only ~14 significant bits in its accumulator, so the product is
    promoted to fp32 every ``qk_promotion`` features (one of ``QK_PROMOTIONS``): one wgmma chain a
    promotion into a fresh accumulator, the chains summed in registers one after the other
    (chains in flight together keep two more accumulators live beside the output's).
    """
    per_chain = qk_promotion // CHUNK

    def chain_value(acc_ref, first):
        for ch in range(first, first + per_chain):
            plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch, rows].transpose((1, 0)))
        return acc_ref[...]

    parts = [pl.run_scoped(functools.partial(chain_value, first=first), plgpu.ACC((BLOCK_M, HALF), jnp.float32))
             for first in range(0, NUM_CHUNKS, per_chain)]
    return functools.reduce(jnp.add, parts)


def step_scores(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scale, first_row, *, interpret: bool,
                qk_promotion: int) -> jax.Array:
    """Scores before the softmax scale of this warpgroup's half of a step, Q8.K8^T * q_scale *
    k_scale + Qr.Kr^T, f32 [64, 64]: the columns of SMEM rows [first_row, first_row + 64)
    (a traced start must be a marked multiple of 64).

    q8_s e4m3 [4, 64, 128], kv_slot e4m3 [4, 128, 128] (step order), qr_s bf16
    [64, 64], rope_slot bf16 [128, 64], q_scale [64] (per row), k_scale [64]
    (per column). FP8 products summed in fp32 every ``qk_promotion`` features (``qk8_promoted``).

    On the GPU the RoPE wgmma accumulates onto the scaled FP8 product
    (``pl.run_state`` + ``ACC.init``), so no separate RoPE tile is live; the
    interpreter, which has no pre-initialised accumulators, adds the RoPE
    product in registers.
    """
    rows = pl.ds(first_row, HALF)
    s8 = qk8_promoted(q8_s, kv_slot, rows, qk_promotion)
    scaled = (s8 * lax.broadcast_in_dim(q_scale, (BLOCK_M, HALF), [0])
              * lax.broadcast_in_dim(k_scale, (BLOCK_M, HALF), [1]))

    def qk_rope(acc_ref):
        plgpu.wgmma(acc_ref, qr_s, rope_slot.at[rows].transpose((1, 0)))

    if interpret:
        def qk_rope_value(acc_ref):
            qk_rope(acc_ref)
            return acc_ref[...]
        return scaled + pl.run_scoped(qk_rope_value, plgpu.ACC((BLOCK_M, HALF), jnp.float32))
    return pl.run_state(qk_rope)(plgpu.ACC.init(scaled))


def local_stats(scores, log2_k_scale, scale_log2: float, visible=None):
    """A warpgroup's half of a step in the log domain of P * k_scale: (log_pv = score (base 2) +
    log2 k_scale [64, 64], invisible columns at -inf; its row max [64]). log2_k_scale [64]
    (``COL``): the columns' log2 k_scale (``decode_inputs(scale_planes=True)``)."""
    log_pv = scores * scale_log2 + lax.broadcast_in_dim(log2_k_scale, scores.shape, [1])
    if visible is not None:  # masked slots may hold any bytes, NaN included
        log_pv = jnp.where(visible, log_pv, -jnp.inf)
    return log_pv, log_pv.max(axis=1)


def consumers_sync(barrier_id: int) -> None:
    """Both consumer warpgroups (256 threads) meet at hardware named barrier ``barrier_id``
    (``bar.sync``): the shared-memory stores of either before it are visible to the loads of
    both after it. GPU only (inline PTX)."""
    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        mgpu_utils.inline_ptx(f"bar.sync {barrier_id}, {NUM_WGS * 128};", has_side_effects=True)
    sync()


def store_rows(values, ref, layout=ROW, *, unsynced: bool = True) -> None:
    """values[i] (f32 [n] in ``layout``: ``ROW``, or the 16-row kernel's ``QROWS``) into ref[i]
    (ref f32 [len(values), n] in SMEM) without the warpgroup barriers Pallas puts before and after
    an SMEM store (a ``bar.sync`` of the warpgroup's 128 threads each). The caller orders the
    stores: every read of ref before them and every read after them must be separated from them
    by a barrier its threads meet (here the consumers' named barriers, ``UNSYNCED_ROW_STORES``).
    GPU only (inline Mosaic GPU). ``unsynced`` False: Pallas's own stores, barriers included
    (the interpreter, and the flags' comparison runs)."""
    if not unsynced:
        for i, value in enumerate(values):
            ref[i] = value
        return

    @plgpu.inline_mgpu(arg_types=(tuple(layout for _ in values), plgpu.RefType()))
    def store(ctx, values_fa, dst):
        del ctx
        for i, value in enumerate(values_fa):
            value.store_untiled(mgpu_utils.memref_slice(dst, i), optimized=False)

    store(tuple(values), ref)


def publish_p(bar) -> None:
    """After this warpgroup's P' stores: make them visible to the wgmmas (the async proxy) and
    announce them, on mbarrier ``bar`` (the interpreter), or with None for the named barrier
    ``gather_p`` meets at (``NAMED_SYNC``). There, with ``FENCE_ONLY_COMMIT``, each thread's
    proxy fence is enough: the named barrier after it orders every thread's stores before every
    wgmma issued behind it (``plgpu.commit_smem`` would add a barrier of the warpgroup)."""
    if bar is None and FENCE_ONLY_COMMIT:
        @plgpu.inline_mgpu()
        def fence(ctx):
            del ctx
            nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
        fence()
        return
    plgpu.commit_smem()
    if bar is not None:
        plgpu.barrier_arrive(bar)


def gather_p(bar) -> None:
    """Wait until both warpgroups have published their P' (``publish_p``): mbarrier ``bar``, or
    with None the named barrier ``P_SYNC_ID``."""
    if bar is None:
        consumers_sync(P_SYNC_ID)
    else:
        plgpu.barrier_wait(bar)


def publish_stats(mine_ref, bar, log_pv_max) -> None:
    """A warpgroup's row max of log_pv over its half of the step to SMEM (mine_ref f32 [64]),
    then its arrival on the step's statistics barrier ``bar`` (None: the named barrier
    ``gather_stats`` meets at, ``NAMED_SYNC``; with ``UNSYNCED_ROW_STORES`` stored by
    ``store_rows``, which that barrier orders)."""
    store_rows((log_pv_max,), mine_ref, unsynced=bar is None and UNSYNCED_ROW_STORES)
    if bar is not None:
        plgpu.barrier_arrive(bar)


def gather_stats(other_ref, bar, log_pv_max):
    """Once both warpgroups have published (``bar``, or with None the named barrier
    ``STATS_SYNC_ID``), the row max of log_pv over the whole step [64] (``ROW``), the other
    warpgroup's read from other_ref f32 [1, 64]."""
    if bar is None:
        consumers_sync(STATS_SYNC_ID)
    else:
        plgpu.barrier_wait(bar)
    return jnp.maximum(log_pv_max, plgpu.load(other_ref.at[0], layout=ROW))


def softmax_frame(log_pv, inv_k_scale, m, l_part, frame, log_pv_max, visible=None):
    """Online softmax of a warpgroup's 64 columns of a step: the module docstring's math. The
    frame is the step's row max of log_pv over all 128 tokens (``gather_stats``), never more than
    ``FRAME_DROP`` below m: the step's largest P * k_scale lands on 448 exactly (the reference's
    block factor 448 / max P', ``mla_decode_reference``), so the heaviest token carries no P'
    rounding. The clamp bounds O' and l' by 2^64 x 448 x tokens x the largest value; a step whose
    every log_pv is 64 below m loses its tokens in e4m3, as fp32 would lose them beside m's token.

    log_pv [64, 64]: score (base 2) + log2 k_scale (``local_stats``), -inf where not visible;
    inv_k_scale [64] (``COL``): 1 / k_scale; per row [64] (``ROW``): m, the running max of log_pv;
    l_part, this warpgroup's partial l'; frame; log_pv_max, the step's max of log_pv.

    Returns (m_new, l_part_new, frame_new, P' f32 [64, 64] (0 where not ``visible``), ratio [64]).
    """
    m_new = jnp.maximum(m, log_pv_max)
    frame_new = jnp.maximum(log_pv_max, m_new - FRAME_DROP)
    frame_safe = jnp.where(frame_new == -jnp.inf, 0.0, frame_new)  # no token seen yet: P' is 0
    ratio = jnp.exp2(frame - frame_safe)
    p8 = jnp.exp2(log_pv - lax.broadcast_in_dim(frame_safe - LOG2_FP8_MAX, log_pv.shape, [0]))
    weights = p8 * lax.broadcast_in_dim(inv_k_scale, log_pv.shape, [1])
    if visible is not None:
        weights = jnp.where(visible, weights, 0.0)  # 0 * a garbage scale's inverse could be NaN
    return m_new, l_part * ratio + weights.sum(axis=1), frame_new, p8, ratio


def v_masked_token_major(chunk_ref, t0, seq_len) -> jax.Array:
    """Interpreter path: the V chunk e4m3 [128, 128] in step order with tokens past
    seq_len zeroed, written back in place before ``pv_update_t`` reads it transposed."""
    v_rows = plgpu.broadcasted_iota(jnp.int32, (STEP, CHUNK), 0, layout=plgpu.Layout.WGMMA)
    v_tokens = t0 + jnp.where(v_rows < HALF, 2 * v_rows, 2 * (v_rows - HALF) + 1)
    return jnp.where(v_tokens < seq_len, chunk_ref[...].astype(jnp.float32), 0.0).astype(FP8_DTYPE)


def step_issuer(bt_ref, latp_ref, ropep_ref, ksc_ref, b, layer_offset, kv8_s, rope_s, ksc_s, step_bar, *,
                by_warps: bool, num_pages: int, page_size: int = PAGE):
    """``issue(step, slot)``: the TMA of a step of batch row b (its 128 / ``page_size`` pages)
    into a ring slot, arriving on ``step_bar[slot]`` (``step_copies``): latent chunks and RoPE
    rows in step order (even tokens to rows 0..63), and token scales: ksc_ref [B, steps * 128]
    (step order), [B, steps, 3, 128] (with their planes, ``mgpu_decode_inputs``), or
    [N / page_size, page_size] the cache's scale plane by page (the step's pages in token order,
    a copy each: ``copy_scales``).

    ``by_warps``: the warps of the issuing warpgroup take the (page, parity) boxes in turn, the
    last one also the token scales (four threads issue in parallel instead of one issuing all
    21 of a step of 64-token pages)."""
    def copy_box(slot, parity, src, dst):
        for ch in range(NUM_CHUNKS):
            plgpu.copy_gmem_to_smem(latp_ref.at[src, parity, pl.ds(ch * CHUNK, CHUNK)],
                                    kv8_s.at[slot, ch, dst], step_bar.at[slot])
        plgpu.copy_gmem_to_smem(ropep_ref.at[src, parity], rope_s.at[slot, dst], step_bar.at[slot])

    def copy_scales(step, first_token, slot, pages):
        if ksc_ref.ndim == 2 and ksc_ref.shape[-1] == page_size:  # the scale plane by page, in token order
            copied = scale_copy_pages(page_size)  # each page's scales in the room of ``copied`` pages
            for k, page in enumerate(pages):
                page_row = lax.div(layer_offset, page_size) + page
                if copied == 1:
                    plgpu.copy_gmem_to_smem(ksc_ref.at[page_row], ksc_s.at[slot, pl.ds(k * page_size, page_size)],
                                            step_bar.at[slot], oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
                    continue
                # ksc_s [slots, pages x copied, page_size]; the cache's last page's copy runs
                # past the plane: the copy stops at its end.
                plgpu.copy_gmem_to_smem(ksc_ref.at[pl.ds(page_row, copied)], ksc_s.at[slot, pl.ds(k * copied, copied)],
                                        step_bar.at[slot], oob_mode=plgpu.OOBFillMode.ZEROS)
        elif ksc_ref.ndim == 4:  # [B, steps, 3, STEP]: the scales, their logarithms and reciprocals
            plgpu.copy_gmem_to_smem(ksc_ref.at[b, step], ksc_s.at[slot], step_bar.at[slot])
        else:
            plgpu.copy_gmem_to_smem(ksc_ref.at[b, pl.ds(first_token, STEP)], ksc_s.at[slot], step_bar.at[slot])

    def issue(step, slot, pages=None):
        # Box starts computed here: ``pl.multiple_of`` does not lower in a warp's code.
        if pages is None:
            pages = step_pages(bt_ref, b, step, num_pages, page_size)
        boxes = list(page_boxes(pages, layer_offset, page_size))
        pages = [page for page, parity, _, _ in boxes if parity == 0]
        first_token = aligned(step * STEP, STEP)
        if not by_warps:
            for _, parity, src, dst in boxes:
                copy_box(slot, parity, src, dst)
            copy_scales(step, first_token, slot, pages)
            return

        def per_warp(warp):
            for k, (_, parity, src, dst) in enumerate(boxes):
                @pl.when(warp == k % 4)
                def _():
                    copy_box(slot, parity, src, dst)

            @pl.when(warp == 3)
            def _():
                copy_scales(step, first_token, slot, pages)

        plgpu.warp_map(per_warp)

    return issue


def start_cta(wg, first_step, num_steps, issue, issue_q, q_bar, *, issuer: int = 0) -> None:
    """Warpgroup ``issuer`` issues the query tiles (``issue_q(q_bar)``) and the first step; every
    warpgroup waits for the query."""
    @pl.when(wg == issuer)
    def _():
        issue_q(q_bar)

        @pl.when(num_steps > 0)
        def _():
            issue(first_step, 0)

    plgpu.barrier_wait(q_bar)


class Where(NamedTuple):
    """Where a CTA is (``locate_cta``)."""
    b: jax.Array  # the batch row of its work item (``split_plan``)
    wg: jax.Array  # this warpgroup
    seq_len: jax.Array
    row0: jax.Array  # first query row of the block
    first_step: jax.Array
    num_steps: jax.Array
    unmasked_steps: jax.Array


def begin_cta(seq_lens_ref, items_ref, bt_ref, off_ref, q8_ref, qr_ref, qsc_ref, latp_ref, ropep_ref, ksc_ref,
              q8_s, qr_s, qsc_s, kv8_s, rope_s, ksc_s, step_bar, q_bar, *, s_q: int,
              num_pages: int, page_size: int = PAGE, issuer: int = 0,
              by_warps: bool | None = None, issue_more_query: Callable | None = None) -> tuple[Where, Callable]:
    """The start of a Mosaic decode CTA (grid work item, row block of q8_s's rows): where it is
    (``locate_cta``), the TMA issuer of the ring (its copies shared by the issuing warpgroup's
    warps if ``by_warps``; None: ``ISSUE_BY_WARPS``), then ``start_cta`` (query tiles and first
    step in flight from warpgroup ``issuer``, the query waited for; ``issue_more_query(b, row0,
    q_bar)`` issues further query copies onto the same barrier). Returns the CTA's ``Where`` and
    the issuer (``step_issuer``'s issue(step, slot))."""
    where = locate_cta(seq_lens_ref, items_ref, bt_ref, q8_s.shape[1], s_q=s_q, page_size=page_size)
    b, wg, _, row0, first_step, num_steps, _ = where
    issue = step_issuer(bt_ref, latp_ref, ropep_ref, ksc_ref, b, off_ref[0], kv8_s, rope_s, ksc_s, step_bar,
                        by_warps=ISSUE_BY_WARPS if by_warps is None else by_warps, num_pages=num_pages,
                        page_size=page_size)
    def issue_q(bar):
        issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, bar)
        if issue_more_query is not None:
            issue_more_query(b, row0, bar)

    start_cta(wg, first_step, num_steps, issue, issue_q, q_bar, issuer=issuer)
    return where, issue


def locate_cta(seq_lens_ref, items_ref, bt_ref, rows: int, *, s_q: int, step_tokens: int = STEP,
               page_size: int = PAGE) -> Where:
    """Where a Mosaic decode CTA (grid work item w, row block of ``rows`` rows) is, for warpgroup
    wg, from the plan's items_ref int32 [3 or 6, W] (``split_plan.SplitPlan.items``: the item CTA w
    runs, ``cta_item``) and its steps of ``step_tokens`` tokens (``split_plan.cta_steps``) over a
    table of ``page_size``-token pages."""
    w, r, wg = (lax.axis_index(name) for name in ("w", "r", "wg"))
    item = cta_item(items_ref, w)
    b = items_ref[0, item]
    # A traced seq_len is not validated: past the table's capacity it would walk steps of
    # clamped pages (the XLA reference clips it there too).
    seq_len = jnp.clip(seq_lens_ref[b], 0, bt_ref.shape[1] * page_size)
    first_step, num_steps, unmasked_steps = cta_steps(items_ref, item, seq_len, s_q=s_q, step_tokens=step_tokens)
    return Where(b, wg, seq_len, aligned(r * rows, rows), first_step, num_steps, unmasked_steps)


def begin_step(j, wg, first_step, num_steps, issue, step_bar, consumed_bar, *, issuer: int = 0,
               issue_first: bool = False, pages=None):
    """Wait for step j's slot; warpgroup ``issuer`` issues step j + 1 into the other slot once
    both warpgroups have finished step j - 1's P'.V on it (``issue`` None: a producer warpgroup
    issues, ``produce_steps``). With ``issue_first`` it issues before waiting for step j's
    copies, so that both steps' copies are in flight while the cache's bytes set the pace.
    Returns the slot."""
    slot = lax.rem(j, NUM_SLOTS)
    if not issue_first or issue is None:
        plgpu.barrier_wait(step_bar.at[slot])
    if issue is None:
        return slot

    @pl.when((wg == issuer) & (j + 1 < num_steps))
    def _():
        # Named scopes: phases for tools/profile_mgpu_steps.py, inside the caller's "wait_step".
        with jax.named_scope("issue_wait"):
            @pl.when(j >= 1)
            def _():
                plgpu.barrier_wait(consumed_bar.at[1 - slot])  # step j - 1's P'.V by both warpgroups
        with jax.named_scope("issue"):
            issue(first_step + j + 1, 1 - slot, pages)

    if issue_first:
        plgpu.barrier_wait(step_bar.at[slot])
    return slot


def pv_update_t(accs, p8_ref, kv_slot, wg, fac_ref, visible, *, interpret: bool) -> list:
    """Fold this step's V^T.P'^T into each of this warpgroup's four O^T tiles [64 features, 64 rows]
    (tile 2 i + t holds features 64 t .. 64 t + 63 of its chunk i): acc * ratio + V^T.P'^T
    (``softmax_frame``).

    fac_ref f32 [1, 64]: the ratio per query row (the tiles' columns), read once in the
    ``COL`` layout: a thread holds 16 query rows' columns, so each factor is 16 registers (one
    factor a step is why ``softmax_frame`` keeps a frame). p8_ref e4m3 [64 rows, 128]: P' in
    ``vt_step_row`` order, the K-major B operand as it is. ``visible``: None (every token of the
    step is below seq_len) or int32 [64] (``ROW``) the number that is (``load_vt_quads``).

    On the GPU each tile's V^T is the register A operand (``load_vt_quads``); the interpreter,
    which has no inline PTX, reads the slot's V chunk transposed as an SMEM A operand (masked in
    place by the caller) and P' in step-row order. Each tile's product goes to a fresh accumulator,
    is waited for and folded in before the next one is issued: the 128 output registers leave no
    room for a second 32-register product in flight (two in flight ran 0.750 against 0.562 ms at
    64 x 16k x 128 on an H100).
    """
    ratio = lax.broadcast_in_dim(plgpu.load(fac_ref.at[0], layout=COL), (BLOCK_M, HALF), [1])
    new_accs = []
    for k, acc in enumerate(accs):
        i, t = divmod(k, 2)
        chunk = kv_slot.at[wg * CHUNKS_PER_WG + i]
        a_operand = (chunk.at[:, pl.ds(t * HALF, HALF)].transpose((1, 0)) if interpret
                     else load_vt_quads(chunk, t, visible))

        def product(acc_ref, a_operand=a_operand):
            plgpu.wgmma(acc_ref, a_operand, p8_ref.transpose((1, 0)))
            return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)

        fresh = pl.run_scoped(product, plgpu.ACC((BLOCK_M, HALF), jnp.float32))
        new_accs.append(acc * ratio + fresh)
    return new_accs


def initial_carry(acc_shape=(BLOCK_M, CHUNK), rows_axis: int = 0, num_accs: int = CHUNKS_PER_WG) -> tuple:
    """The step loop's carry: ``num_accs`` zero f32 accumulators of ``acc_shape``, and
    m = -inf, l = 0 per query row, the accumulators' axis ``rows_axis`` (0 here; 1 for the
    transposed accumulators of ``mla_decode_mgpu_small``)."""
    zeros = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
    rows, layout = acc_shape[rows_axis], plgpu.Layout.WGMMA.reduce(1 - rows_axis)
    return ((zeros,) * num_accs
            + (plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), layout),
               plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), layout)))


def walk_steps(step, carry, where: Where, consumed_bar, *, issuer: int | None = 0,
               relocate: Callable[[], Where] | None = None) -> tuple:
    """Run ``step(j, carry, where=..., masked=...)`` over the steps of the CTA at ``where``
    (``locate_cta``): the unmasked ones, then the masked tail (``split_plan.item_steps``); then
    ``drain_consumed`` (``issuer`` None: a producer warpgroup drains). Returns the final carry.

    ``relocate``: None, or ``locate_cta`` over the same refs, called again after the unmasked
    loop: the masked tail then takes its bounds from it and ``step`` gets it as ``where``.
    For a step whose unmasked calls read none of the item's values (the consumers of a kernel
    with a producer warpgroup), nothing loaded from the plan then stays live across the
    unmasked loop, where ptxas would keep it in registers or spill it (2 spilled words a step
    fewer in the 64-row FP8 kernel).
    """
    carry = lax.fori_loop(0, where.unmasked_steps, functools.partial(step, where=where, masked=False), carry)
    if relocate is not None:
        where = relocate()
    carry = lax.fori_loop(where.unmasked_steps, where.num_steps, functools.partial(step, where=where, masked=True),
                          carry)
    if issuer is not None:
        drain_consumed(where.wg, where.num_steps, consumed_bar, issuer=issuer)
    return carry


def produce_steps(issue, first_step, num_steps, consumed_bar, pages_of: Callable | None = None) -> None:
    """The producer warpgroup's loop: step j (from 1; ``start_cta`` issued step 0) goes into
    slot j % 2 once both consumers have finished step j - 2's P'.V there, then the last two
    steps' consumption is observed (``drain_consumed``). ``pages_of(step)``, where given, loads
    a step's page ids before the wait for its slot, so that the load's latency runs under the
    wait; ``issue(step, slot, pages)`` then copies from them."""
    def body(j, carry):
        slot = lax.rem(j, NUM_SLOTS)
        pages = None if pages_of is None else pages_of(first_step + j)

        # Named scopes: phases for tools/profile_mgpu_steps.py, as in the consumers' step.
        with jax.named_scope("produce_wait"):
            @pl.when(j >= NUM_SLOTS)
            def _():
                plgpu.barrier_wait(consumed_bar.at[slot])
        with jax.named_scope("produce_issue"):
            issue(first_step + j, slot) if pages is None else issue(first_step + j, slot, pages)
        return carry

    lax.fori_loop(1, num_steps, body, 0)
    drain_consumed(0, num_steps, consumed_bar, issuer=0)


def drain_consumed(wg, num_steps, consumed_bar, *, issuer: int = 0) -> None:
    """The issuing warpgroup observes the consumption of the last two steps too (the loop waited
    for steps 0 .. num_steps - 3 only): a barrier phase nobody waits for is left dangling (the
    interpreter rejects that)."""
    @pl.when(wg == issuer)
    def _():
        for back in (2, 1):
            @pl.when(num_steps >= back)
            def _():
                plgpu.barrier_wait(consumed_bar.at[lax.rem(num_steps - back, NUM_SLOTS)])


class OutputTarget(NamedTuple):
    """Where a CTA's normalised output and lse go (``split_plan``): row b of the call's output
    when b's row is one item (count 1), the item's partial slot when it is one of several (an
    unused item's CTA returns before writing: ``for_used_items``). ``part_o`` / ``part_lse``
    None: every row is one item (a plan of one split)."""
    o: jax.Array  # ref [B, rows, 512]
    lse: jax.Array  # ref [B, rows] f32
    part_o: jax.Array | None  # ref [W, rows, 512] (or [W, 512, rows])
    part_lse: jax.Array | None  # ref [W, rows] f32
    b: jax.Array
    item: jax.Array
    count: jax.Array

    def copy(self, src, lse: bool, *index) -> None:
        """TMA src (SMEM) to [*index] of the output (``lse``: of the lse) of this CTA's row or item."""
        final, part = (self.lse, self.part_lse) if lse else (self.o, self.part_o)
        if part is None:
            plgpu.copy_smem_to_gmem(src, final.at[(self.b, *index)])
            return

        @pl.when(self.count == 1)
        def _():
            plgpu.copy_smem_to_gmem(src, final.at[(self.b, *index)])

        @pl.when(self.count > 1)
        def _():
            plgpu.copy_smem_to_gmem(src, part.at[(self.item, *index)])


def output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, *, partials: bool) -> OutputTarget:
    """The ``OutputTarget`` of this CTA's work item over the kernel's four output refs; ``partials``
    False: the plan has one item a row and the partial refs are placeholders, never written.

    Call it where the outputs are written, after the step loop: it reads the item's row and
    count from items_ref [3 or 6, W] again rather than keeping ``locate_cta``'s values live across
    the consumers' loop.
    """
    item = cta_item(items_ref, lax.axis_index("w"))
    return OutputTarget(o_ref, lse_ref, part_o_ref if partials else None, part_lse_ref if partials else None,
                        items_ref[0, item], item, items_ref[2, item])


def write_outputs(accs, m, l, o_s, lse_s, target: OutputTarget, row0, wg) -> None:
    """This warpgroup's columns of the output rows row0:row0 + 64 (accs [64, 128] / l) and, from
    warpgroup 0, the rows' lse, to ``target``; call once both warpgroups are past their last QK.
    (The BF16 twin's output; this kernel's O^T tiles leave through ``write_outputs_t``.)

    o_s: the staging tiles (the query's bytes), [2, 64, 128] for a 2-byte output (or bf16
    partials) or [2, 64, 64] for float32 ones.
    """
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    inv_l = lax.broadcast_in_dim(1.0 / l_safe, (BLOCK_M, CHUNK), [0])
    my_o = o_s.at[wg]
    cols = my_o.shape[1]
    pieces = [(i * CHUNK + c, acc[:, c:c + cols] if cols < CHUNK else acc)
              for i, acc in enumerate(accs) for c in range(0, CHUNK, cols)]
    for k, (col, piece) in enumerate(pieces):
        if k:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous piece has left the staging tile
        normalised = piece * inv_l[:, :cols]
        my_o[...] = normalised.astype(my_o.dtype)
        plgpu.commit_smem()
        col0 = wg * CHUNKS_PER_WG * CHUNK + col
        target.copy(my_o, False, pl.ds(row0, BLOCK_M), pl.ds(col0, cols))
    write_lse_and_wait(wg, m, l_safe, seen, lse_s, target, row0)


def write_outputs_t(accs, m, l, scale_col, o_s, lse_s, target: OutputTarget, row0, wg, *,
                    interpret: bool) -> None:
    """``write_outputs`` for ``pv_update_t``'s O^T tiles [64 features, R rows] (R = 64 here, 16 or 32
    in ``mla_decode_mgpu_small``): each tile * scale goes out as rows row0:row0 + R, its 64
    features, through this warpgroup's staging tile o_s[wg] ([R, 64], ``output_transforms``), put
    back into row-major order and its features into their places by ``store_feature_pairs`` (the
    interpreter: a transpose). m, l [R] (for the lse), scale_col [R] per row in ``COL``."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    inv_l = lax.broadcast_in_dim(scale_col, accs[0].shape, [1])
    my_o = o_s.at[wg]
    for k, acc in enumerate(accs):
        if k:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile has left the staging tile
        normalised = acc * inv_l
        if interpret:
            my_o[...] = normalised.T.astype(my_o.dtype)
        else:
            store_feature_pairs(normalised, my_o)
        plgpu.commit_smem()
        col0 = wg * CHUNKS_PER_WG * CHUNK + k * HALF
        target.copy(my_o, False, pl.ds(row0, my_o.shape[0]), pl.ds(col0, HALF))
    write_lse_and_wait(wg, m, l_safe, seen, lse_s, target, row0)


def write_lse_and_wait(wg, m, l_safe, seen, lse_s, target: OutputTarget, row0) -> None:
    """From warpgroup 0, the block's lse (natural log; -inf for rows that saw no token) to
    rows row0:row0 + rows of ``target``'s lse through lse_s f32 [rows]; then every copy out of
    SMEM has finished."""
    @pl.when(wg == 0)
    def _():
        lse_s[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
        plgpu.commit_smem()
        target.copy(lse_s, True, pl.ds(row0, lse_s.shape[0]))

    plgpu.wait_smem_to_gmem(0)


def for_used_items(cta: Callable) -> Callable:
    """A Mosaic decode kernel that runs ``cta`` (refs, then keyword parameters; its second ref is
    the plan's items_ref [3, W]) for used work items only: an unused one (``split_plan``: count 0)
    returns at once, without loading its query or waiting on a barrier (a balanced plan's budget
    may leave a third to a half of its items unused)."""
    @functools.wraps(cta)
    def kernel(*refs, **params):
        items_ref = refs[1]
        pl.when(items_ref[2, cta_item(items_ref, lax.axis_index("w"))] > 0)(lambda: cta(*refs, **params))
    return kernel


@for_used_items
def _kernel(seq_lens_ref, items_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref, part_o_ref, part_lse_ref,
            q_union, qr_s, qsc_s, lse_s, kv8_s, rope_s, ksc_s, p8_s, stats_s, lsum_s, fac_s,
            step_bar, qk_done_bar, stats_bar, pexch_bar, consumed_bar, q_bar, end_bar,
            *, s_q: int, num_heads: int, scale_log2: float, partials: bool, num_pages: int, page_size: int,
            interpret: bool, qk_promotion: int):
    """One CTA: (work item w: a run of steps of batch row b, row block r), two consumer warpgroups
    and the producer (wg 2, ``PRODUCER_WG``); shapes in the module docstring, outputs as
    ``OutputTarget`` (``partials``: whether the plan has rows of several items).

    SMEM (shared by both warpgroups): q_union = (q8_s e4m3 [4, 64, 128] | o_s
    [2, 64, 64] output staging, one tile per warpgroup, ``output_transforms``), qr_s
    bf16 [64, 64], qsc_s f32 [64], lse_s f32 [64], kv8_s e4m3 [2, 4, 128, 128]
    (slot, chunk, step row, feature: K, and V as it is), rope_s bf16 [2, 128, 64],
    ksc_s f32 [2, 3, 128] (a slot's token scales, their log2, their reciprocals), p8_s
    e4m3 [2, 64, 128] (a slot's P', both warpgroups' columns, the B operand of both),
    stats_s f32 [2 slots, 2 warpgroups, 1, 64] (the row max of log_pv, ``softmax_frame``),
    lsum_s f32 [2, 64] (each warpgroup's partial l, after the loop), fac_s f32 [2, 1, 64]
    (each warpgroup's per-row ratio, after the loop its 1 / l, read back one per column).
    """
    q8_s, o_s = q_union
    where, issue = begin_cta(
        seq_lens_ref, items_ref, bt_ref, off_ref, q8_ref, qr_ref, qsc_ref, latp_ref, ropep_ref, ksc_ref,
        q8_s, qr_s, qsc_s, kv8_s, rope_s, ksc_s, step_bar, q_bar, s_q=s_q, num_pages=num_pages,
        page_size=page_size, issuer=NUM_WGS if PRODUCER_WG else 0,
        by_warps=producer_by_warps(page_size) if PRODUCER_WG else None)
    _, wg, _, row0, first_step, num_steps, _ = where
    # With a producer warpgroup the consumers' unmasked steps read nothing of the item: its
    # masked tail locates the CTA again (``walk_steps``).
    relocate = (functools.partial(locate_cta, seq_lens_ref, items_ref, bt_ref, q8_s.shape[1], s_q=s_q,
                                  page_size=page_size) if PRODUCER_WG else None)

    # Nothing is written over a slot on the GPU; the interpreter masks V in place once both
    # warpgroups have read the slot as K (``qk_done``).
    named_sync = NAMED_SYNC and not interpret
    num_accs = 2 * CHUNKS_PER_WG  # O^T tiles [64 features, 64 rows]

    # The slots' token scales [NUM_SLOTS, STEP]: plane 0 of ksc_s (1: their log2, 2: 1 / them).
    ksc_scales = ksc_s.at[:, 0]

    def consume():
        my_rows = aligned(wg * HALF, HALF)  # this warpgroup's half of each step's SMEM rows
        q_scale = plgpu.load(qsc_s, layout=ROW)

        def step_tail_t(slot, accs, row_state, ratio, p_scaled, t0, seq_len, *, masked: bool):
            """P' to SMEM in ``vt_step_row`` order, the fold's ratio (per row) to the column layout,
            then O^T += V^T.P'^T (``pv_update_t``); returns the carry (the accumulators, then
            ``row_state``)."""
            with jax.named_scope("p_store"):
                # The GPU's cast saturates (``cvt.rn.satfinite.e4m3x2.f32``): P' a rounding above 448
                # becomes 448 without the clamp, which the interpreter's cast (to NaN) needs.
                p8 = (p_scaled if SATURATING_P_CAST and not interpret
                      else jnp.minimum(p_scaled, FP8_E4M3_MAX)).astype(FP8_DTYPE)
                if interpret:
                    p8_s[slot, :, pl.ds(aligned(wg * HALF, HALF), HALF)] = p8
                else:
                    store_quads(p8, p8_s.at[slot], None)  # the lane is the warpgroup's index
                # Both warpgroups hold the same ratio; each turns its own copy into columns
                # (read behind the P' exchange's barrier, written behind the statistics').
                store_rows((ratio,), fac_s.at[wg], unsynced=named_sync and UNSYNCED_ROW_STORES)
            visible = None
            if interpret:
                # V is masked in place once both warpgroups are past their QK.
                plgpu.barrier_wait(qk_done_bar.at[slot])
                if masked:
                    for i in range(CHUNKS_PER_WG):
                        ch = wg * CHUNKS_PER_WG + i
                        kv8_s[slot, ch] = v_masked_token_major(kv8_s.at[slot, ch], t0, seq_len)
            elif masked:
                visible = plgpu.layout_cast(jnp.full((BLOCK_M,), seq_len - t0, jnp.int32), ROW)
            publish_p(None if named_sync else pexch_bar.at[slot])
            with jax.named_scope("wait_p"):
                gather_p(None if named_sync else pexch_bar.at[slot])  # the other warpgroup's P'
            with jax.named_scope("pv"):
                new_accs = pv_update_t(accs, p8_s.at[slot], kv8_s.at[slot], wg, fac_s.at[wg], visible,
                                       interpret=interpret)
                plgpu.barrier_arrive(consumed_bar.at[slot])
            return (*new_accs, *row_state)

        def step(j, carry, *, where: Where, masked: bool):
            accs, m, l_part = carry[:num_accs], carry[num_accs], carry[num_accs + 1]
            t0 = (where.first_step + j) * STEP
            # The named scopes are the phases tools/profile_mgpu_steps.py times on the GPU (the
            # on-device profiler records them when ``COMPILER_PARAMS`` asks for it).
            with jax.named_scope("wait_step"):
                slot = begin_step(j, wg, where.first_step, where.num_steps, None if PRODUCER_WG else issue,
                                  step_bar, consumed_bar)

            with jax.named_scope("qk"):
                k_scale = plgpu.load(ksc_scales.at[slot, pl.ds(my_rows, HALF)], layout=COL)
                scores = step_scores(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot], q_scale, k_scale, my_rows,
                                     interpret=interpret, qk_promotion=qk_promotion)
                if interpret:
                    plgpu.barrier_arrive(qk_done_bar.at[slot])

            with jax.named_scope("stats"):
                visible = (step_visibility(row0, t0, where.seq_len, wg, s_q=s_q, num_heads=num_heads)
                           if masked else None)
                log2_k_scale = plgpu.load(ksc_s.at[slot, 1, pl.ds(my_rows, HALF)], layout=COL)
                log_pv, log_pv_max = local_stats(scores, log2_k_scale, scale_log2, visible)
                publish_stats(stats_s.at[slot, wg], None if named_sync else stats_bar.at[slot], log_pv_max)
            with jax.named_scope("wait_stats"):
                log_pv_max = gather_stats(stats_s.at[slot, 1 - wg], None if named_sync else stats_bar.at[slot],
                                          log_pv_max)
            with jax.named_scope("softmax"):
                inv_k_scale = plgpu.load(ksc_s.at[slot, 2, pl.ds(my_rows, HALF)], layout=COL)
                m_new, l_part, frame, p_scaled, ratio = softmax_frame(
                    log_pv, inv_k_scale, m, l_part, carry[-1], log_pv_max, visible)

            return step_tail_t(slot, accs, (m_new, l_part, frame), ratio, p_scaled, t0, where.seq_len,
                               masked=masked)

        carry = initial_carry((BLOCK_M, HALF), num_accs=num_accs)
        carry = carry + (plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), ROW),)  # frame
        carry = walk_steps(step, carry, where, consumed_bar, issuer=None if PRODUCER_WG else 0, relocate=relocate)
        accs, l_part = carry[:num_accs], carry[num_accs + 1]
        lsum_s[wg] = l_part
        # Both warpgroups are past their last QK (Q8's bytes become the output
        # staging) and have published their partial l.
        plgpu.barrier_arrive(end_bar)
        plgpu.barrier_wait(end_bar)
        l = l_part + plgpu.load(lsum_s.at[1 - wg], layout=ROW)
        # Per row, what the accumulators are multiplied by: 1 / l, both in the frame and 448 times
        # the softmax's (``softmax_frame``; 0 for rows that saw no token).
        seen = l > 0
        fac_s[wg, 0] = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        # lse (base 2) = frame + log2(l) - log2 448: ``write_outputs_t`` adds log2(l) to this.
        write_outputs_t(accs, carry[-1] - LOG2_FP8_MAX, l, plgpu.load(fac_s.at[wg, 0], layout=COL), o_s, lse_s,
                        output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials),
                        row0, wg, interpret=interpret)

    if not PRODUCER_WG:
        consume()
        return

    pages_of = ((lambda step: tuple(step_pages(bt_ref, where.b, step, num_pages, page_size)))
                if PRODUCER_PREFETCH_PAGES else None)
    specialize_warpgroups(wg, functools.partial(produce_steps, issue, first_step, num_steps, consumed_bar, pages_of),
                          consume,
                          PRODUCER_REGISTERS, CONSUMER_REGISTERS)


def specialize_warpgroups(wg, produce: Callable[[], None], consume: Callable[[], None], producer_registers: int,
                          consumer_registers: int) -> None:
    """The producer warpgroup (index ``NUM_WGS``) gives up registers to ``producer_registers`` a
    thread and runs ``produce``; the consumers take ``consumer_registers`` and run ``consume``
    (``check_registers`` says which splits can run)."""
    @pl.when(wg == NUM_WGS)
    def _():
        plgpu.set_max_registers(producer_registers, action="decrease")
        produce()

    @pl.when(wg < NUM_WGS)
    def _():
        plgpu.set_max_registers(consumer_registers, action="increase")
        consume()


def check_registers(producer: int, consumer: int) -> None:
    """ValueError unless a producer / consumer split of registers a thread can run: multiples of 8
    whose sum over the three warpgroups stays within the kernel's 168 a thread (above it, the
    consumers' ``set_max_registers`` waits forever for registers the producer never frees)."""
    if not PRODUCER_WG:
        return
    budget = (NUM_WGS + 1) * (65536 // (128 * (NUM_WGS + 1)) // 8 * 8)
    if producer % 8 or consumer % 8 or producer + NUM_WGS * consumer > budget:
        raise ValueError(f"PRODUCER_REGISTERS / CONSUMER_REGISTERS: expected multiples of 8 with producer + "
                         f"{NUM_WGS} x consumer <= {budget}, got {producer} / {consumer}")


def check_launch(kernel: str, q_rows, q_rope_rows, cache_arrays: tuple, *, page_size: int, num_arrays: int,
                 block_rows: int | None, num_splits, page_sizes: tuple = (PAGE,)) -> None:
    """ValueError unless a Mosaic decode kernel (``kernel``: its name and cache, for the message)
    takes these: a page_size of ``page_sizes``, rank ``RANK``, rope ``ROPE``, ``num_arrays`` cache
    arrays, query rows padded to ``block_rows`` (None: any number, the kernel pads them),
    q_rope_rows with q_rows' batch and rows, a positive int ``num_splits``."""
    batch, num_rows, rank = q_rows.shape
    if page_size not in page_sizes or rank != RANK or q_rope_rows.shape[2] != ROPE or len(cache_arrays) != num_arrays:
        sizes = " or ".join(map(str, page_sizes))
        raise ValueError(f"{kernel}, page_size {sizes}, rank {RANK}, rope {ROPE} only; got page_size {page_size}, "
                         f"rank {rank}, rope {q_rope_rows.shape[2]}")
    if q_rope_rows.shape[:2] != (batch, num_rows):
        raise ValueError(f"q_rope_rows: expected shape ({batch}, {num_rows}, {ROPE}) like q_rows, got "
                         f"{q_rope_rows.shape}")
    if block_rows is not None and num_rows % block_rows:
        raise ValueError(f"q_rows: expected rows padded to a multiple of {block_rows}, got {num_rows}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int, got {num_splits!r}")


def padded_rows(num_rows: int, block_rows: int) -> int:
    """``num_rows`` rounded up to whole blocks of ``block_rows``."""
    return -(-num_rows // block_rows) * block_rows


class KernelInputs(NamedTuple):
    """What ``prepare_inputs`` hands a Mosaic FP8 kernel, query rows padded to P (whole blocks)."""
    q8: jax.Array  # [B, P, 512] e4m3
    q_scale: jax.Array  # [B, P] f32
    q_rope: jax.Array  # [B, P, 64] bf16
    latent_pairs: jax.Array  # [N/2, 2, 512] e4m3 (a free reshape of the cache's latent)
    rope_pairs: jax.Array  # [N/2, 2, 64] bf16
    scales: jax.Array  # [B, steps * 128] f32, or [B, steps, 3, 128] (``scale_planes``)
    plan: SplitPlan


def prepare_inputs(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, *, page_size: int,
                   num_splits: int, balanced: bool, num_pages: int, block_rows: int = BLOCK_M,
                   scale_planes: bool = False, segments: int = 0, interpret: bool = False) -> KernelInputs:
    """Checks and launcher-side inputs (``block_rows``: the query rows of a CTA; ``num_pages``:
    pages in one layer, resolved by ``resolve_num_pages``), and the call's split plan:
    ``num_splits`` items a row (``uniform_plan``), or with ``balanced`` (and B > 1)
    ``split_plan.balanced_plan``'s, computed in the inputs launch, or with ``segments`` > 0
    ``split_plan.wave_plan``'s of that many segments (``plan_items``).

    q_rows [B, rows, 512] and q_rope_rows [B, rows, 64], any rows: padded here to whole blocks.
    Returns ``KernelInputs``: the quantized rows, the padded RoPE rows, the step-ordered token
    scales (with their base-2 logarithms and reciprocals if ``scale_planes``) and a balanced plan
    in one launch (``mgpu_decode_inputs.decode_inputs_and_plan``; a uniform plan is a constant).
    """
    check_launch("mla_decode_mgpu: FP8 cache", q_rows, q_rope_rows, cache_arrays, page_size=page_size,
                 num_arrays=3, block_rows=None, num_splits=num_splits, page_sizes=PAGE_SIZES)
    latent, scale, rope = cache_arrays
    batch, num_rows, _ = q_rows.shape
    rows = padded_rows(num_rows, block_rows)
    # Rows already whole blocks need no copy of q_rope; others are padded in the same launch.
    rope_rows = q_rope_rows if rows != num_rows else None
    common = dict(q_rope_rows=rope_rows, padded_rows=rows, num_pages=num_pages, page_size=page_size,
                  scale_planes=scale_planes, interpret=interpret)
    num_items = balanced_plan_size(batch, num_splits, balanced and not segments)
    if num_items is not None:
        inputs = decode_inputs_and_plan(q_rows, scale, block_table, layer_offset, seq_lens, num_items=num_items,
                                        **common)
        plan = inputs.plan
    else:
        inputs = decode_inputs(q_rows, scale, block_table, layer_offset, **common)
        plan = plan_items(seq_lens, block_table, num_splits=num_splits, balanced=False, step_tokens=STEP,
                          page_size=page_size, segments=segments, interpret=interpret)
    q_rope = q_rope_rows.astype(jnp.bfloat16) if rope_rows is None else inputs.q_rope
    return KernelInputs(inputs.q8, inputs.q_scale, q_rope, latent.reshape(latent.shape[0] // 2, 2, RANK),
                        rope.reshape(rope.shape[0] // 2, 2, ROPE), inputs.scales, plan)


def launch(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, *, softmax_scale: float,
           page_size: int, s_q: int, num_heads: int, num_splits: int, balanced: bool, num_pages: int | None,
           segments: int, interpret: bool, qk_promotion: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``_kernel`` on its grid (work item, row block) with its warpgroups, its SMEM and barriers,
    and the merge of split-KV partials. ``qk_promotion``: as ``mla_decode_mgpu``'s (None: ``QK_PROMOTION``)."""
    check_registers(PRODUCER_REGISTERS, CONSUMER_REGISTERS)
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    q8, q_scale, q_rope, latent_pairs, rope_pairs, scales, plan = prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, page_size=page_size,
        num_splits=num_splits, balanced=balanced, num_pages=num_pages, scale_planes=True, segments=segments,
        interpret=interpret)
    num_rows = q8.shape[1]  # padded to whole blocks
    out_dtype = partial_dtype(q_rows.dtype)
    slot_barrier = lambda: plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS)
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, num_pages=num_pages, page_size=page_size, interpret=interpret,
                          qk_promotion=QK_PROMOTION if qk_promotion is None else qk_promotion),
        out_type=output_types(plan, num_rows, out_dtype),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_CHUNKS, BLOCK_M, CHUNK), FP8_DTYPE),
                           plgpu.SMEM((NUM_WGS, BLOCK_M, HALF), out_dtype,
                                      transforms=() if interpret else output_transforms(out_dtype))),
            plgpu.SMEM((BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), FP8_DTYPE),
            plgpu.SMEM((NUM_SLOTS, STEP, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, 3, STEP), jnp.float32),
            # P' (``store_quads``): its 4-byte stores compute addresses for this layout.
            plgpu.SMEM((NUM_SLOTS, BLOCK_M, STEP), FP8_DTYPE, transforms=BYTE_TILE_TRANSFORMS),
            plgpu.SMEM((NUM_SLOTS, NUM_WGS, 1, BLOCK_M), jnp.float32),
            plgpu.SMEM((NUM_WGS, BLOCK_M), jnp.float32),
            plgpu.SMEM((NUM_WGS, 1, BLOCK_M), jnp.float32),  # fac_s: the fold's ratio per warpgroup
            plgpu.Barrier(num_arrivals=step_copies(page_size), num_barriers=NUM_SLOTS),
            *(slot_barrier() for _ in range(4)),  # qk_done (interpreter), stats, pexch, consumed
            plgpu.Barrier(num_arrivals=COPIES_Q),
            plgpu.Barrier(num_arrivals=NUM_WGS),
        ],
        **grid_params(plan, num_rows // BLOCK_M, "snapmla_decode_fp8_mgpu", interpret,
                      num_threads=NUM_WGS + int(PRODUCER_WG)),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, q8, q_scale, q_rope, latent_pairs, scales,
                  rope_pairs)
    out, lse = merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, interpret=interpret)
    return unpadded(out, lse, q_rows.shape[1])


def unpadded(out: jax.Array, lse: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """A kernel's out [B, P, 512] and lse [B, P] without the padding rows past ``num_rows``."""
    return out[:, :num_rows], lse[:, :num_rows]


def grid_params(plan: SplitPlan, row_blocks: int, kernel_name: str, interpret: bool,
                num_threads: int = NUM_WGS, reduction_scratch_bytes: int | None = None) -> dict:
    """``plgpu.kernel`` arguments shared by the Mosaic decode kernels: the grid (work item of
    ``plan``, row block: Mosaic GPU launches the last grid axis fastest, so the row blocks of an
    item run side by side and read its cache tiles from L2 together), ``num_threads``
    warpgroups, and ``COMPILER_PARAMS`` (if set) with ``APPROX_MATH`` and, unless None,
    ``reduction_scratch_bytes`` (the SMEM Pallas keeps for reductions across warps; 0 for a
    kernel that brings its own scratch)."""
    if plan.items.shape[1] > GRID_YZ_MAX:  # the items go to CUDA's y (the row blocks to x)
        raise ValueError(f"seq_lens: {plan.items.shape[1]} work items for {plan.item_count.shape[0]} batch rows, past "
                         f"the {GRID_YZ_MAX} a CUDA grid's y takes; decode the batch in parts")
    params = dataclasses.replace(COMPILER_PARAMS or plgpu.CompilerParams(), approx_math=APPROX_MATH)
    if reduction_scratch_bytes is not None:
        params = dataclasses.replace(params, reduction_scratch_bytes=reduction_scratch_bytes)
    extra = {} if interpret else {"compiler_params": params}
    return dict(grid=(plan.items.shape[1], row_blocks), grid_names=("w", "r"), num_threads=num_threads,
                thread_name="wg", kernel_name=kernel_name,
                interpret=plgpu.InterpretGPUParams() if interpret else None, **extra)


def balanced_plan_size(batch: int, num_splits: int, balanced: bool) -> int | None:
    """The item count W of a call's balanced plan: the budget that gives rows of equal length
    ``num_splits`` items each (``balanced_items``), or None where the call's plan is
    ``uniform_plan`` (not ``balanced``, or one row, whose balanced plan equals the uniform one)."""
    return balanced_items(batch, num_splits) if balanced and batch > 1 else None


def plan_items(seq_lens, block_table, *, num_splits: int, balanced: bool, step_tokens: int,
               page_size: int = PAGE, segments: int = 0, interpret: bool = False) -> SplitPlan:
    """The work items of a call over seq_lens [B] and block_table [B, max_pages] (pages of
    ``page_size`` tokens): with ``segments`` > 0 ``split_plan.wave_plan`` (XLA), else
    ``split_plan.balanced_plan`` (in one launch: ``balanced_plan_kernel``) of
    ``balanced_plan_size`` items, or ``uniform_plan`` (``num_splits`` items a row)."""
    batch = seq_lens.shape[0]
    if segments:
        return wave_plan(seq_lens, num_segments=segments, step_tokens=step_tokens,
                         capacity=block_table.shape[1] * page_size)
    num_items = balanced_plan_size(batch, num_splits, balanced)
    if num_items is None:
        return uniform_plan(batch, num_splits)
    return balanced_plan_kernel(seq_lens, num_items=num_items, step_tokens=step_tokens,
                                capacity=block_table.shape[1] * page_size, interpret=interpret)


def output_types(plan: SplitPlan, num_rows: int, dtype) -> tuple:
    """The four outputs of a Mosaic decode kernel (``OutputTarget``): out [B, rows, 512] in
    ``dtype``, lse [B, rows] f32, and the partials' slots [W, rows, 512] and [W, rows]
    (placeholders of one slot if the plan has none: ``SplitPlan.partials``)."""
    batch, slots = plan.item_start.shape[0], plan.items.shape[1] if plan.partials else 1
    shape = lambda n: (n, num_rows, RANK)
    return (jax.ShapeDtypeStruct(shape(batch), dtype), jax.ShapeDtypeStruct((batch, num_rows), jnp.float32),
            jax.ShapeDtypeStruct(shape(slots), dtype), jax.ShapeDtypeStruct((slots, num_rows), jnp.float32))


def merge_items(outs: tuple, plan: SplitPlan, dtype, *, num_splits: int,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The call's (out [B, rows, 512] in ``dtype``, lse [B, rows]) from a kernel's four outputs
    (``output_types``). A uniform plan of S > 1 merges its [B x S] partial slots as [B, S]
    (``combine_splits_mgpu``: counts known when it compiles, 0.5-3 us faster on an H200 than
    reading them); a balanced one merges rows of several items into the rows the kernel wrote
    directly (``combine_items_mgpu``, up to ``num_splits`` items, rounded up to a power of two,
    loaded at a time)."""
    out, lse, part_o, part_lse = outs
    batch = out.shape[0]
    if plan.partials and plan.uniform_splits is not None:
        part_o = part_o.reshape(batch, plan.uniform_splits, *part_o.shape[1:])
        out, lse = combine_splits_mgpu(part_o, part_lse.reshape(batch, plan.uniform_splits, -1), dtype,
                                       interpret=interpret)
        return out, lse
    if plan.partials:
        out, lse = combine_items_mgpu(part_o, part_lse, plan.item_start, plan.item_count, out, lse,
                                      chunk=pl.next_power_of_2(max(num_splits, 2)), interpret=interpret)
    return out.astype(dtype), lse


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "num_pages", "segments", "interpret", "qk_promotion"))
def mla_decode_mgpu(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                    seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                    s_q: int, num_heads: int, num_splits: int = 1, balanced: bool = False,
                    num_pages: int | None = None, segments: int = 0,
                    interpret: bool = False, qk_promotion: int | None = None) -> tuple[jax.Array, jax.Array]:
    """FP8 decode on Mosaic GPU; arguments and results in the module docstring.

    ``layer_offset`` must be a multiple of 64 (it is layer x pages x 64).
    Split-KV (flash decoding, ``split_plan``): ``num_splits`` > 1 cuts each row's steps into that
    many CTAs; ``balanced`` instead gives each row a number of CTAs in proportion to its
    seq_len, from a budget that gives rows of equal length ``num_splits`` each
    (``split_plan.balanced_plan``); ``segments`` > 0 instead cuts the batch's steps into that
    many equal segments (``split_plan.wave_plan``; ``num_splits`` is then the items a row is
    expected to have, for the merge). The partials of a row's CTAs
    (``combine_splits.partial_dtype``) are merged with their log-sum-exp
    (``combine_splits_mgpu.combine_items_mgpu``). ``num_pages``: pages in one layer of the
    cache (None: all of the arrays' rows); traced page ids are clipped into [0, num_pages)
    and seq_lens into the table's capacity, so that no read leaves the cache. ``qk_promotion``:
    the features a fp32 sum of the FP8 Q.K products covers (``QK_PROMOTIONS``; None:
    ``QK_PROMOTION``, one 512-feature chain).
    """
    check_qk_promotion(qk_promotion)
    return launch(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, softmax_scale=softmax_scale,
                  page_size=page_size, s_q=s_q, num_heads=num_heads, num_splits=num_splits, balanced=balanced,
                  num_pages=num_pages, segments=segments, interpret=interpret, qk_promotion=qk_promotion)


def check_qk_promotion(qk_promotion) -> None:
    """ValueError naming ``qk_promotion`` unless it is None or one of ``QK_PROMOTIONS``."""
    if qk_promotion is not None and (type(qk_promotion) is not int or qk_promotion not in QK_PROMOTIONS):
        raise ValueError(f"qk_promotion: expected None or one of {QK_PROMOTIONS} (features a float32 sum of the "
                         f"FP8 Q.K products covers), got {qk_promotion!r}")
