"""SnapMLA FP8 MLA decode on Mosaic GPU, paired: two CTAs of a cluster share two 64-row blocks.

Same inputs, outputs and math as ``mla_decode_mgpu`` (its docstring has the shapes; its reference
is the same ``mla_decode_reference(..., block_n=128)``), for query rows in pairs of 64-row blocks
(H = 128 at s_q = 1 or 2: 2 or 4 blocks). GPU only: the interpreter has no clusters.

Why. In ``mla_decode_mgpu`` the two consumer warpgroups of a CTA split one 64-row block: each
scores half of a step's tokens and owns half of the output features, so they exchange the step's
row statistics and P' twice a step and run in lockstep; their softmax then leaves the tensor
cores idle (~2000 of a ~6300-cycle step, docs/mosaic_gpu_decode_plan.md), and neither can run
ahead, since a warpgroup's 64 x 256 fp32 output already takes 128 of its registers. Here the
partner of each warpgroup is in the other CTA of a 2-CTA cluster, and the two warpgroups of a CTA
take two different row blocks:

- CTA c (``%cluster_ctarank``) loads, each step, all 512 features of the step's tokens of parity
  c (its "own" tokens: the even ones for c = 0, the odd ones for c = 1) and features
  [256 c, 256 c + 256) of the other parity's: 48 KB of latent a step (the single-CTA kernel
  loads 64 KB, and both row blocks of a batch row load them again).
- Its consumer warpgroup r (row block 2 p + r of the pair p) scores its own tokens over all
  features, exchanges the rows' statistics with warpgroup r of the peer CTA, stores P' of its
  own tokens in its SMEM and in the peer's (``mgpu_cluster``: ``st.shared::cluster``, mbarriers
  arrived with release at cluster scope), and multiplies P' of all 128 tokens by its 256 output
  features of V. Each warpgroup holds the same 128 output registers as before.
- The two warpgroups of a CTA share only the ring (both read each slot), not a statistic or a
  P' tile, so while one runs its softmax the other can run its products.

Features are relabelled per CTA so both CTAs keep one program: local latent chunk t is global
chunk (t + 2c) % 4 for the query and the keys alike (Q.K sums over all four; the output's two
chunks are local 0 and 1, the global features [256 c, 256 c + 256)).

Per CTA SMEM: the query of both row blocks (2 x 40 KB; after its loop, a warpgroup's first
32 KB become its output staging), a 2-slot ring of 56 KB (local chunks 0-1 for all 128 tokens,
own-parity rows first; chunks 2-3 for the own tokens; RoPE rows and token scales of the own
tokens), P' of each row block (8 KB each: this CTA's 64 columns, then the peer's), the peer's
statistics and partial l, and the exchange mbarriers.

Masking, splits and the producer warpgroup as in ``mla_decode_mgpu``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mla_decode_mgpu as single
from pallas_kernels.combine_splits import kernel_out_dtype
from pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from pallas_kernels.mgpu_bytes import BYTE_TILE_TRANSFORMS, output_transforms, store_feature_pairs
from pallas_kernels.mgpu_cluster import (P_BYTES, arrive_peer, expect_bytes, init_barriers, row_bytes, send_rows,
                                         send_rows_async, store_quads_pair, wait_local, wait_parity)
from pallas_kernels.mla_decode import LN2, LOG2E, resolve_num_pages
from pallas_kernels.mla_decode_mgpu import (BLOCK_M, CHUNK, COL, HALF, NUM_CHUNKS, NUM_SLOTS, PAGE, RANK, ROPE, ROW,
                                            STEP, _aligned, cta_steps, local_stats, softmax_half_t,
                                            step_visibility)

NUM_WGS = 2  # consumer warpgroups, one a row block
OWN_CHUNKS = 2  # latent chunks of the output a CTA owns
PAIR_ROWS = NUM_WGS * BLOCK_M  # query rows a cluster takes
# TMA copies on a slot's barrier a step: per page, the own parity's 4 chunks and RoPE rows and the
# other parity's 2 chunks; then the own token scales.
COPIES_STEP = 2 * (NUM_CHUNKS + 1 + OWN_CHUNKS) + 1
COPIES_Q = NUM_WGS * (NUM_CHUNKS + 2)
# The exchange mbarriers (``mgpu_cluster``), one word each per row block: statistics, P', l.
STATS_BAR, P_BAR, L_BAR = 0, 1, 2
# How a warpgroup hands its statistics, P' columns and l to its partner in the peer CTA:
# "async": ``st.async`` stores that complete their bytes on the partner's mbarrier, which its
# own warpgroup expects (one arrival); "release": ``st.shared::cluster`` stores, then every
# thread's ``mbarrier.arrive.release.cluster`` (128 arrivals), the partner waiting with acquire at
# cluster scope.
EXCHANGE = "async"
# Whether the two consumer warpgroups take turns issuing their step's Q.K (FA3's ping-pong: warpgroup
# 0 first, then each waits at a named barrier for the other's previous Q.K), so that one's
# elementwise work and exchanges run beside the other's products instead of in lockstep.
PINGPONG = True
PINGPONG_IDS = (10, 11)  # named barriers (0..3 are Mosaic GPU's; the 64-row kernel uses 8, 9)


def _named(op: str, barrier_id) -> None:
    """``bar.sync`` or ``bar.arrive`` of named barrier ``barrier_id`` (python int) for the two consumer
    warpgroups (256 threads)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu()
    def bar(ctx):
        del ctx
        mgpu_utils.inline_ptx(f"bar.{op} {barrier_id}, {NUM_WGS * 128};", has_side_effects=True)
    bar()


def take_turn(r, wait: bool) -> None:
    """Warpgroup r waits for its turn (``wait``) or hands the turn to the other (``PINGPONG``)."""
    for w in range(NUM_WGS):
        @pl.when(r == w)
        def _():
            _named("sync", PINGPONG_IDS[w]) if wait else _named("arrive", PINGPONG_IDS[1 - w])


def pair_scores(q8_r, kva, kvb, qr_r, rope, q_scale, k_scale, handover=None) -> jax.Array:
    """Scores before the softmax scale of the own tokens of a step, f32 [64, 64]: Q8.K8^T * q_scale *
    k_scale + Qr.Kr^T. q8_r e4m3 [4, 64, 128] (local chunks), kva e4m3 [2, 128, 128] (local chunks
    0-1, own rows 0..63), kvb e4m3 [2, 64, 128] (local chunks 2-3), qr_r bf16 [64, 64], rope bf16
    [64, 64], q_scale [64] (``ROW``), k_scale [64] (``COL``). One 512-feature wgmma chain
    (``single.QK_PROMOTION``), the RoPE wgmma accumulating onto the scaled FP8 product.
    ``handover``: called once the FP8 chain is issued (``PINGPONG``)."""
    keys = [kva.at[0, pl.ds(0, HALF)], kva.at[1, pl.ds(0, HALF)], kvb.at[0], kvb.at[1]]

    def chain(acc_ref):
        for t, k in enumerate(keys):
            plgpu.wgmma(acc_ref, q8_r.at[t], k.transpose((1, 0)))
        if handover is not None:
            handover()
        return acc_ref[...]

    s8 = pl.run_scoped(chain, plgpu.ACC((BLOCK_M, HALF), jnp.float32))
    scaled = (s8 * lax.broadcast_in_dim(q_scale, (BLOCK_M, HALF), [0])
              * lax.broadcast_in_dim(k_scale, (BLOCK_M, HALF), [1]))

    def qk_rope(acc_ref):
        plgpu.wgmma(acc_ref, qr_r, rope.transpose((1, 0)))

    return pl.run_state(qk_rope)(plgpu.ACC.init(scaled))


def _kernel(seq_lens_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref,
            q_union, qr_s, qsc_s, lse_s, kva_s, kvb_s, rope_s, ksc_s, p8_s, stats_in, fac_s, lsum_in, xbar,
            step_bar, consumed_bar, q_bar,
            *, s_q: int, num_heads: int, scale_log2: float, num_splits: int, num_pages: int):
    """One CTA of a cluster: (batch row b, KV split, row pair, rank c), consumer warpgroups 0 and 1
    (row blocks 2 pair and 2 pair + 1) and the producer (wg 2). Shapes in the module docstring."""
    q8_s, o_s = q_union
    b, split, pair, c, wg = (lax.axis_index(name) for name in ("b", "s", "r", "c", "wg"))
    seq_len = jnp.clip(seq_lens_ref[b], 0, bt_ref.shape[1] * PAGE)
    first_step, num_steps, unmasked_steps = cta_steps(seq_len, split, s_q=s_q, num_splits=num_splits)
    layer_offset = off_ref[0]
    asynchronous = EXCHANGE == "async"
    init_barriers(xbar, count=1 if asynchronous else 128)

    def exchange_rows(values, dst_ref, index, parity):
        """values (f32 [64] vectors, ``ROW``) into the partner's dst_ref; returns once the partner's have
        arrived in this CTA's dst_ref."""
        if EXCHANGE == "none":  # a timing stand-in: no exchange (wrong results)
            return
        if asynchronous:
            send_rows_async(values, dst_ref, xbar.at[wg], index)
            expect_bytes(xbar.at[wg], index, row_bytes(len(values)))
            wait_parity(xbar.at[wg], index, parity)
        else:
            send_rows(values, dst_ref)
            arrive_peer(xbar.at[wg], index)
            wait_local(xbar.at[wg], index, parity)

    def local_chunk_columns(t):
        """Global columns of local latent chunk t: chunk (t + 2c) % 4."""
        return pl.ds(_aligned(lax.rem(t + OWN_CHUNKS * c, NUM_CHUNKS) * CHUNK, CHUNK), CHUNK)

    def issue_query():
        for r in range(NUM_WGS):
            row0 = _aligned((NUM_WGS * pair + r) * BLOCK_M, BLOCK_M)
            for t in range(NUM_CHUNKS):
                plgpu.copy_gmem_to_smem(q8_ref.at[b, pl.ds(row0, BLOCK_M), local_chunk_columns(t)], q8_s.at[r, t],
                                        q_bar)
            plgpu.copy_gmem_to_smem(qr_ref.at[b, pl.ds(row0, BLOCK_M)], qr_s.at[r], q_bar)
            plgpu.copy_gmem_to_smem(qsc_ref.at[b, pl.ds(row0, BLOCK_M)], qsc_s.at[r], q_bar)

    def issue(step, slot):
        max_pages = bt_ref.shape[1]
        bar = step_bar.at[slot]
        for half in range(2):
            page = jnp.clip(bt_ref[b, jnp.minimum(step * 2 + half, max_pages - 1)], 0, num_pages - 1)
            src = pl.ds(_aligned((layer_offset + page * PAGE) // 2, PAGE // 2), PAGE // 2)
            own_rows = pl.ds(half * (PAGE // 2), PAGE // 2)
            peer_rows = pl.ds(HALF + half * (PAGE // 2), PAGE // 2)
            for t in range(NUM_CHUNKS):
                cols = local_chunk_columns(t)
                own_dst = kva_s.at[slot, t, own_rows] if t < OWN_CHUNKS else kvb_s.at[slot, t - OWN_CHUNKS, own_rows]
                plgpu.copy_gmem_to_smem(latp_ref.at[src, c, cols], own_dst, bar)
                if t < OWN_CHUNKS:
                    plgpu.copy_gmem_to_smem(latp_ref.at[src, 1 - c, cols], kva_s.at[slot, t, peer_rows], bar)
            plgpu.copy_gmem_to_smem(ropep_ref.at[src, c], rope_s.at[slot, own_rows], bar)
        plgpu.copy_gmem_to_smem(ksc_ref.at[b, step, :, pl.ds(_aligned(c * HALF, HALF), HALF)], ksc_s.at[slot], bar)

    def produce():
        issue_query()

        @pl.when(num_steps > 0)
        def _():
            issue(first_step, 0)

        def body(j, carry):
            slot = lax.rem(j, NUM_SLOTS)

            @pl.when(j >= NUM_SLOTS)
            def _():
                plgpu.barrier_wait(consumed_bar.at[slot])
            issue(first_step + j, slot)
            return carry

        lax.fori_loop(1, num_steps, body, 0)
        for back in (2, 1):  # observe the last two steps' consumption (no phase left dangling)
            @pl.when(num_steps >= back)
            def _():
                plgpu.barrier_wait(consumed_bar.at[lax.rem(num_steps - back, NUM_SLOTS)])

    def consume():
        r = wg
        row0 = _aligned((NUM_WGS * pair + r) * BLOCK_M, BLOCK_M)
        plgpu.barrier_wait(q_bar)
        q_scale = plgpu.load(qsc_s.at[r], layout=ROW)
        q8_r, qr_r, p8_r = q8_s.at[r], qr_s.at[r], p8_s.at[r]

        def hand_over(j):
            # Warpgroup 1 does not hand over after its last Q.K: no arrival is left pending.
            @pl.when((r == 0) | (j + 1 < num_steps))
            def _():
                take_turn(r, wait=False)

        if PINGPONG:
            @pl.when((r == 1) & (num_steps > 0))
            def _():
                take_turn(r, wait=False)  # warpgroup 0 goes first

        def row_vector(value, dtype):
            return plgpu.layout_cast(jnp.full((BLOCK_M,), value, dtype), ROW)

        def step(j, carry, *, masked: bool):
            accs, (m, l_part, frame) = carry[:4], carry[4:]
            t0 = (first_step + j) * STEP
            slot = lax.rem(j, NUM_SLOTS)
            parity = row_vector(lax.rem(j, 2), jnp.int32)
            with jax.named_scope("wait_step"):
                plgpu.barrier_wait(step_bar.at[slot])
            with jax.named_scope("qk"):
                k_scale = plgpu.load(ksc_s.at[slot, 0], layout=COL)
                if PINGPONG:
                    take_turn(r, wait=True)
                scores = pair_scores(q8_r, kva_s.at[slot], kvb_s.at[slot], qr_r, rope_s.at[slot], q_scale, k_scale,
                                     handover=functools.partial(hand_over, j) if PINGPONG else None)
            with jax.named_scope("stats"):
                visible = step_visibility(row0, t0, seq_len, c, s_q=s_q, num_heads=num_heads) if masked else None
                log2_k_scale = plgpu.load(ksc_s.at[slot, 1], layout=COL)
                scores, row_max, log_pv_max = local_stats(scores, log2_k_scale, scale_log2, visible)
            with jax.named_scope("wait_stats"):
                exchange_rows((row_max, log_pv_max), stats_in.at[r], STATS_BAR, parity)
                row_max = jnp.maximum(row_max, plgpu.load(stats_in.at[r, 0], layout=ROW))
                log_pv_max = jnp.maximum(log_pv_max, plgpu.load(stats_in.at[r, 1], layout=ROW))
            with jax.named_scope("softmax"):
                m_new, l_part, frame, p_scaled, ratio = softmax_half_t(
                    scores, k_scale, m, l_part, frame, row_max, log_pv_max, visible)
            with jax.named_scope("p_store"):
                # The GPU's cast saturates at 448.
                if EXCHANGE == "none":
                    single.store_quads(p_scaled.astype(FP8_DTYPE), p8_r, 0)
                else:
                    store_quads_pair(p_scaled.astype(FP8_DTYPE), p8_r, *((xbar.at[r], P_BAR) if asynchronous else ()))
                fac_s[r, 0] = ratio
                plgpu.commit_smem()
                if EXCHANGE == "release":
                    arrive_peer(xbar.at[r], P_BAR)
            with jax.named_scope("wait_p"):
                if asynchronous:
                    expect_bytes(xbar.at[r], P_BAR, P_BYTES)
                    wait_parity(xbar.at[r], P_BAR, parity)
                elif EXCHANGE == "release":
                    wait_local(xbar.at[r], P_BAR, parity)
            v_visible = None
            if masked:
                # Rows 0..63 of a slot hold the tokens of parity c, rows 64..127 the other parity:
                # token t0 + 2k + c and t0 + 2k + 1 - c (``load_vt_quads``' pair of limits).
                left = seq_len - t0
                v_visible = (row_vector(left - c, jnp.int32), row_vector(left + c, jnp.int32))
            with jax.named_scope("pv"):
                new_accs = single.pv_update_t(accs, p8_r, kva_s.at[slot], 0, fac_s.at[r], v_visible, interpret=False)
                plgpu.barrier_arrive(consumed_bar.at[slot])
            return (*new_accs, m_new, l_part, frame)

        zeros = plgpu.layout_cast(jnp.zeros((BLOCK_M, HALF), jnp.float32), plgpu.Layout.WGMMA)
        carry = (zeros,) * 4 + (row_vector(-jnp.inf, jnp.float32), row_vector(0.0, jnp.float32),
                                row_vector(-jnp.inf, jnp.float32))
        carry = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(unmasked_steps, num_steps, functools.partial(step, masked=True), carry)
        accs, (m, l_part, frame) = carry[:4], carry[4:]

        # The row's l over both CTAs' tokens (m and the frame are the same in both).
        exchange_rows((l_part,), lsum_in.at[r], L_BAR, row_vector(0, jnp.int32))
        l = l_part + plgpu.load(lsum_in.at[r, 0], layout=ROW)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        scale = jnp.where(seen, jnp.exp2(frame - m) * (1.0 / FP8_E4M3_MAX) / l_safe, 0.0)
        fac_s[r, 0] = scale
        scale_col = lax.broadcast_in_dim(plgpu.load(fac_s.at[r, 0], layout=COL), (BLOCK_M, HALF), [1])
        my_o = o_s.at[r, 0]  # over this warpgroup's own query chunks (its loop is done)
        for k, acc in enumerate(accs):
            if k:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            store_feature_pairs(acc * scale_col, my_o)
            plgpu.commit_smem()
            col0 = _aligned((OWN_CHUNKS * c) * CHUNK + k * HALF, HALF)
            plgpu.copy_smem_to_gmem(my_o, o_ref.at[b, split, pl.ds(row0, BLOCK_M), pl.ds(col0, HALF)])

        @pl.when(c == 0)
        def _():
            lse_s[r] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_s.at[r], lse_ref.at[b, split, pl.ds(row0, BLOCK_M)])

        plgpu.wait_smem_to_gmem(0)

    single.specialize_warpgroups(wg, produce, consume, single.PRODUCER_REGISTERS, single.CONSUMER_REGISTERS)


def launch(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, *, softmax_scale: float,
           page_size: int, s_q: int, num_heads: int, num_splits: int, num_pages: int | None) -> tuple[jax.Array, jax.Array]:
    """``_kernel`` on its grid (b, split, row pair) x cluster (2), and the merge of split partials."""
    batch, num_rows, _ = q_rows.shape
    if num_rows % PAIR_ROWS:
        raise ValueError(f"q_rows: expected rows padded to a multiple of {PAIR_ROWS} (pairs of 64-row blocks), "
                         f"got {num_rows}")
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    q8, q_scale, latent_pairs, rope_pairs, scales = single.prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, layer_offset, page_size=page_size, num_splits=num_splits,
        num_pages=num_pages, log2_scales=True)
    out_dtype = kernel_out_dtype(q_rows.dtype, num_splits)
    staging = 32768 // (BLOCK_M * HALF * jnp.dtype(out_dtype).itemsize)  # o_s[r, 0] starts at q8_s[r]
    params = dataclasses_replace_params()
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          num_splits=num_splits, num_pages=num_pages),
        out_type=(jax.ShapeDtypeStruct((batch, num_splits, num_rows, RANK), out_dtype),
                  jax.ShapeDtypeStruct((batch, num_splits, num_rows), jnp.float32)),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_WGS, NUM_CHUNKS, BLOCK_M, CHUNK), FP8_DTYPE),
                           plgpu.SMEM((NUM_WGS, staging, BLOCK_M, HALF), out_dtype,
                                      transforms=output_transforms(out_dtype))),
            plgpu.SMEM((NUM_WGS, BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_WGS, BLOCK_M), jnp.float32),  # qsc_s
            plgpu.SMEM((NUM_WGS, BLOCK_M), jnp.float32),  # lse_s
            plgpu.SMEM((NUM_SLOTS, OWN_CHUNKS, STEP, CHUNK), FP8_DTYPE),  # kva_s
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS - OWN_CHUNKS, HALF, CHUNK), FP8_DTYPE),  # kvb_s
            plgpu.SMEM((NUM_SLOTS, HALF, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, 2, HALF), jnp.float32),  # ksc_s: scales, log2 scales
            plgpu.SMEM((NUM_WGS, BLOCK_M, STEP), FP8_DTYPE, transforms=BYTE_TILE_TRANSFORMS),  # p8_s
            plgpu.SMEM((NUM_WGS, 2, BLOCK_M), jnp.float32),  # stats_in (written by the peer)
            plgpu.SMEM((NUM_WGS, 1, BLOCK_M), jnp.float32),  # fac_s
            plgpu.SMEM((NUM_WGS, 1, BLOCK_M), jnp.float32),  # lsum_in (written by the peer)
            plgpu.SMEM((NUM_WGS, 3), jnp.int64),  # the exchange mbarriers, per row block
            plgpu.Barrier(num_arrivals=COPIES_STEP, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=COPIES_Q),
        ],
        grid=(batch, num_splits, num_rows // PAIR_ROWS), grid_names=("b", "s", "r"),
        cluster=(2,), cluster_names=("c",), num_threads=NUM_WGS + 1, thread_name="wg",
        kernel_name="snapmla_decode_fp8_mgpu_pair", compiler_params=params,
    )
    out, lse = kernel(seq_lens, block_table, layer_offset, q8, q_scale, q_rope_rows.astype(jnp.bfloat16),
                      latent_pairs, scales, rope_pairs)
    return single.merge_splits(out, lse, q_rows.dtype)


def dataclasses_replace_params() -> plgpu.CompilerParams:
    import dataclasses
    return dataclasses.replace(single.COMPILER_PARAMS or plgpu.CompilerParams(), approx_math=single.APPROX_MATH)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "num_pages"))
def mla_decode_mgpu_pair(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                         seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                         s_q: int, num_heads: int, num_splits: int = 1,
                         num_pages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """FP8 decode on Mosaic GPU with 2-CTA clusters; arguments and results as ``mla_decode_mgpu``'s
    (no ``interpret``: the interpreter has no clusters). q_rows' rows: a multiple of 128."""
    return launch(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, softmax_scale=softmax_scale,
                  page_size=page_size, s_q=s_q, num_heads=num_heads, num_splits=num_splits, num_pages=num_pages)
