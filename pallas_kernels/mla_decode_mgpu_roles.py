"""SnapMLA FP8 MLA decode on Mosaic GPU, 64 query rows a CTA: one warpgroup scores, two multiply.

The 64-row kernel (``mla_decode_mgpu``) runs each step's phases one after another in both of
its consumers: Q.K, the statistics exchange, the softmax, the P' store, P'.V. Its 64 x 256 fp32
output (128 registers a thread) leaves no room to overlap them. Here the roles are split
between warpgroups instead of the output's columns alone:

- the scorer (warpgroup 0, ``SCORER_REGISTERS``) issues the TMA ring, computes Q.K of a whole
  64-token page (64 x 64 scores: no statistics to exchange), the page's softmax and P', and
  hands P' and the per-row fold ratio over through SMEM;
- the multipliers (warpgroups 1 and 2, ``MULTIPLIER_REGISTERS``), each owning 256 of the 512
  output features (``mla_decode_mgpu.pv_update_t``'s O^T tiles), run P'.V of the page the
  scorer finished before, while the scorer works on the next one.

So the softmax of page k runs under the products of page k - 1. The math is the 64-row
kernel's (its module docstring), with a frame a page (64 tokens) instead of a step:
``mla_decode_reference(..., block_n=64)`` rounds as this kernel does.

Ring: four one-page slots (``NUM_SLOTS``): the scorer on one, the multipliers on the one
before, two in flight. A slot's rows are its page's even tokens, then its odd ones (the TMA
reads strided boxes of the [N/2, 2, 512] token-pair view, as the 64-row kernel does), and its
token scales come in the same order (``mgpu_decode_inputs.step_token_order(page_major=True)``).
The split plan's items are runs of 128-token steps, two pages each.

Barriers: ``page_bar`` (TMA, a slot), ``ready_bar`` (P' of a page stored, a P' buffer),
``consumed_bar`` (both multipliers done with a slot and its page's P' buffer; the scorer
waits for it before reusing either), ``end_bar`` (the scorer's l and frame stored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels import mla_decode_mgpu as base
from snapmla_jax.pallas_kernels.combine_splits import partial_dtype
from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from snapmla_jax.pallas_kernels.mgpu_bytes import HALF_BYTE_TILE_TRANSFORMS, output_transforms, store_quads
from snapmla_jax.pallas_kernels.mla_decode import LOG2E, resolve_num_pages

PAGE = base.PAGE
STEP = base.STEP
BLOCK_M = base.BLOCK_M
CHUNK = base.CHUNK
NUM_CHUNKS = base.NUM_CHUNKS
ROPE = base.ROPE
ROW, COL = base.ROW, base.COL
NUM_SLOTS = 4  # ring slots, a page each
NUM_MULTIPLIERS = 2
# TMA copies arriving on a slot's barrier: per token parity the 4 latent chunks and the RoPE
# rows; plus one box of the page's token scales, their log2 and reciprocals.
COPIES_PAGE = 2 * (NUM_CHUNKS + 1) + 1
# Registers a thread: the kernel starts at 168 (65536 over 384 threads); scorer + 2 x multiplier
# must stay <= 504. A multiplier holds the 128-register output, a 32-register product and the
# 16-register ratio; the scorer 64 x 64 scores (32) and three token-scale vectors (16 each).
SCORER_REGISTERS = 104
MULTIPLIER_REGISTERS = 200
# Whether a fourth warpgroup (PRODUCER_REGISTERS a thread) issues the ring instead of the scorer;
# the kernel then starts at 128 registers a thread and the four must stay <= 512.
PRODUCER_WG = False
PRODUCER_REGISTERS = 24
RATIO_PER_TILE = False


def page_visibility(row0, t0, seq_len, page: int, *, s_q: int, num_heads: int) -> jax.Array:
    """bool [64, 64]: which of a slot's 64 columns each query row may see; column c holds token
    t0 + 64 page + 2 (c % 32) + c // 32 (the slot's even tokens, then its odd ones)."""
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, PAGE), 1, layout=plgpu.Layout.WGMMA)
    tokens = t0 + PAGE * page + 2 * lax.rem(col, PAGE // 2) + lax.div(col, PAGE // 2)
    if s_q == 1:
        return tokens < seq_len
    rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, PAGE), 0, layout=plgpu.Layout.WGMMA)
    visible_len = jnp.minimum(seq_len - s_q + lax.div(row0 + rows, jnp.int32(num_heads)) + 1, seq_len)
    return tokens < visible_len


def v_masked_page(chunk_ref, t0, seq_len, page: int) -> jax.Array:
    """Interpreter path: a slot's V chunk e4m3 [64, 128] with the tokens past seq_len zeroed."""
    rows = plgpu.broadcasted_iota(jnp.int32, (PAGE, CHUNK), 0, layout=plgpu.Layout.WGMMA)
    tokens = t0 + PAGE * page + 2 * lax.rem(rows, PAGE // 2) + lax.div(rows, PAGE // 2)
    return jnp.where(tokens < seq_len, chunk_ref[...].astype(jnp.float32), 0.0).astype(FP8_DTYPE)


def page_id(bt_ref, b, step, page: int, num_pages: int):
    """The cache page of page ``page`` (0 or 1) of a step of batch row b, clipped into the cache."""
    return jnp.clip(bt_ref[b, base.step_page_columns(step, bt_ref.shape[1])[page]], 0, num_pages - 1)


def page_issuer(latp_ref, ropep_ref, ksc_ref, b, layer_offset, kv8_s, rope_s, ksc_s, page_bar):
    """``issue(step, page, slot, page_id)``: the TMA of page ``page`` (0 or 1) of a step of batch
    row b, cache page ``page_id``, into a ring slot, arriving on ``page_bar[slot]``: warps 0 and 1
    the even and odd tokens' latent chunks and RoPE rows, warp 2 the page's token scales ([3, 64]
    of ksc_ref [B, steps, 3, 128], page-major)."""
    def issue(step, page: int, slot, page_id):
        # Box starts computed here: ``pl.multiple_of`` does not lower in a warp's code.
        first_pair = base.aligned((layer_offset + page_id * PAGE) // 2, PAGE // 2)
        bar = page_bar.at[slot]

        src = pl.ds(first_pair, PAGE // 2)
        dst = lambda parity: pl.ds(parity * (PAGE // 2), PAGE // 2)
        copies = [functools.partial(plgpu.copy_gmem_to_smem, latp_ref.at[src, parity, pl.ds(ch * CHUNK, CHUNK)],
                                    kv8_s.at[slot, ch, dst(parity)], bar)
                  for parity in range(2) for ch in range(NUM_CHUNKS)]
        copies += [functools.partial(plgpu.copy_gmem_to_smem, ropep_ref.at[src, parity], rope_s.at[slot, dst(parity)],
                                     bar) for parity in range(2)]
        copies.append(functools.partial(plgpu.copy_gmem_to_smem, ksc_ref.at[b, step, :, pl.ds(page * PAGE, PAGE)],
                                        ksc_s.at[slot], bar))

        def per_warp(warp):
            for w in range(4):  # the 11 copies dealt over the four warps
                @pl.when(warp == w)
                def _():
                    for copy in copies[w::4]:
                        copy()

        plgpu.warp_map(per_warp)
    return issue


@base.for_used_items
def _kernel(seq_lens_ref, items_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref, part_o_ref, part_lse_ref,
            q_union, qr_s, qsc_s, lse_s, kv8_s, rope_s, ksc_s, p8_s, fac_s, end_s,
            page_bar, ready_bar, consumed_bar, q_bar, end_bar,
            *, s_q: int, num_heads: int, scale_log2: float, partials: bool, num_pages: int, interpret: bool):
    """One CTA: (work item w, row block r), the scorer (wg 0) and two multipliers (wg 1, 2).

    SMEM: q_union = (q8_s e4m3 [4, 64, 128] | o_s [2, 64, 64] output staging, one tile a
    multiplier), qr_s bf16 [64, 64], qsc_s f32 [64], lse_s f32 [64], kv8_s e4m3
    [4 slots, 4 chunks, 64, 128], rope_s bf16 [4, 64, 64], ksc_s f32 [4, 3, 64] (a slot's token
    scales, their log2, their reciprocals), p8_s e4m3 [2, 64, 64] (a page's P', buffer = page
    of the step), fac_s f32 [2, 1, 64] (the page's fold ratio per row), end_s f32 [3, 64] (the
    lse's frame, l, 1 / l).
    """
    q8_s, o_s = q_union
    where = base.locate_cta(seq_lens_ref, items_ref, bt_ref, BLOCK_M, s_q=s_q)
    b, wg, seq_len, row0, first_step, num_steps, unmasked_steps = where

    issue = page_issuer(latp_ref, ropep_ref, ksc_ref, b, off_ref[0], kv8_s, rope_s, ksc_s, page_bar)
    step_pages = lambda step: tuple(page_id(bt_ref, b, step, page, num_pages) for page in range(2))

    def produce():
        base.issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, q_bar)

        def body(j, carry):
            pair = 2 * lax.rem(j, 2)
            pages = step_pages(first_step + j)
            for page in range(2):
                slot = pair + page
                with jax.named_scope("produce_wait"):
                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(consumed_bar.at[slot])
                with jax.named_scope("produce_issue"):
                    issue(first_step + j, page, slot, pages[page])
            return carry

        lax.fori_loop(0, num_steps, body, 0)
        for back in (2, 1):  # the last two steps' slots: observed all the same
            @pl.when(num_steps >= back)
            def _():
                for page in range(2):
                    plgpu.barrier_wait(consumed_bar.at[2 * lax.rem(num_steps - back, 2) + page])

    def score():
        if not PRODUCER_WG:
            base.issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, q_bar)

            @pl.when(num_steps > 0)
            def _():
                for page, pid in enumerate(step_pages(first_step)):
                    issue(first_step, page, page, pid)

        plgpu.barrier_wait(q_bar)
        q_scale = plgpu.load(qsc_s, layout=ROW)

        def step(j, carry, *, masked: bool):
            m, l, frame, next_pages = carry[0], carry[1], carry[2], carry[3:]
            # The pages of the step after the next, loaded a step before their TMA is issued: the
            # block table's load latency stays off the scorer's path.
            after_next = () if PRODUCER_WG else step_pages(first_step + j + 2)
            t0 = (first_step + j) * STEP
            pair = 2 * lax.rem(j, 2)
            for page in range(2):
                slot, next_slot = pair + page, 2 - pair + page

                def wait_free():
                    with jax.named_scope("wait_free"):
                        @pl.when(j >= 1)
                        def _():  # page (j - 1, page) multiplied: its slot and P' buffer are free
                            plgpu.barrier_wait(consumed_bar.at[next_slot])

                if not PRODUCER_WG:
                    wait_free()
                    with jax.named_scope("issue"):
                        @pl.when(j + 1 < num_steps)
                        def _():
                            issue(first_step + j + 1, page, next_slot, next_pages[page])

                with jax.named_scope("wait_page"):
                    plgpu.barrier_wait(page_bar.at[slot])
                with jax.named_scope("qk"):
                    k_scale = plgpu.load(ksc_s.at[slot, 0], layout=COL)
                    scores = base.step_scores(q8_s, kv8_s.at[slot], qr_s, rope_s.at[slot], q_scale, k_scale, 0,
                                              interpret=interpret)
                with jax.named_scope("softmax"):
                    visible = (page_visibility(row0, t0, seq_len, page, s_q=s_q, num_heads=num_heads)
                               if masked else None)
                    log_pv, log_pv_max = base.local_stats(scores, plgpu.load(ksc_s.at[slot, 1], layout=COL),
                                                          scale_log2, visible)
                    m, l, frame, p_scaled, ratio = base.softmax_frame(
                        log_pv, plgpu.load(ksc_s.at[slot, 2], layout=COL), m, l, frame, log_pv_max, visible)
                if PRODUCER_WG:
                    wait_free()
                with jax.named_scope("p_store"):
                    # The GPU's cast saturates; the interpreter's would give NaN above 448.
                    p8 = (p_scaled if base.SATURATING_P_CAST and not interpret
                          else jnp.minimum(p_scaled, FP8_E4M3_MAX)).astype(FP8_DTYPE)
                    if interpret:
                        p8_s[page] = p8
                    else:
                        store_quads(p8, p8_s.at[page], 0)
                    fac_s[page, 0] = ratio
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ready_bar.at[page])
            return m, l, frame, *after_next

        row_vector = lambda value: plgpu.layout_cast(jnp.full((BLOCK_M,), value, jnp.float32), ROW)
        carry = (row_vector(-jnp.inf), row_vector(0.0), row_vector(-jnp.inf),
                 *(() if PRODUCER_WG else step_pages(first_step + 1)))
        carry = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), carry)
        _, l, frame, *_ = lax.fori_loop(unmasked_steps, num_steps, functools.partial(step, masked=True), carry)

        # The last step's pages were waited for by no later step: drain them (every phase of a
        # barrier is waited for), then nothing reads Q8 again and the multipliers may stage
        # their outputs over it.
        @pl.when(num_steps >= 1)
        def _():
            last = 2 * lax.rem(num_steps - 1, 2)
            for page in range(2):
                plgpu.barrier_wait(consumed_bar.at[last + page])

        seen = l > 0
        end_s[0] = frame - base.LOG2_FP8_MAX  # lse (base 2) = this + log2 l
        end_s[1] = l
        end_s[2] = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        plgpu.commit_smem()
        plgpu.barrier_arrive(end_bar)

    def multiply():
        mine = wg - 1  # which 256 output features: chunks 2 mine, 2 mine + 1

        def step(j, accs, *, masked: bool):
            t0 = (first_step + j) * STEP
            pair = 2 * lax.rem(j, 2)
            for page in range(2):
                slot = pair + page
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(page_bar.at[slot])  # the TMA's bytes, seen by this warpgroup too
                    plgpu.barrier_wait(ready_bar.at[page])
                visible = None
                if interpret:
                    if masked:  # the scorer is past this slot's Q.K
                        for i in range(base.CHUNKS_PER_WG):
                            ch = mine * base.CHUNKS_PER_WG + i
                            kv8_s[slot, ch] = v_masked_page(kv8_s.at[slot, ch], t0, seq_len, page)
                elif masked:
                    visible = plgpu.layout_cast(jnp.full((BLOCK_M,), seq_len - t0, jnp.int32), ROW)
                with jax.named_scope("pv"):
                    accs = base.pv_update_t(accs, p8_s.at[page], kv8_s.at[slot], mine, fac_s.at[page], visible,
                                            interpret=interpret, page=page, ratio_per_tile=RATIO_PER_TILE)
                    plgpu.barrier_arrive(consumed_bar.at[slot])
            return tuple(accs)

        zeros = plgpu.layout_cast(jnp.zeros((BLOCK_M, PAGE), jnp.float32), plgpu.Layout.WGMMA)
        accs = (zeros,) * (2 * base.CHUNKS_PER_WG)  # O^T tiles [64 features, 64 rows]
        accs = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), accs)
        accs = lax.fori_loop(unmasked_steps, num_steps, functools.partial(step, masked=True), accs)
        plgpu.barrier_wait(end_bar)
        target = base.output_target(o_ref, lse_ref, part_o_ref, part_lse_ref, items_ref, partials=partials)
        base.write_outputs_t(accs, plgpu.load(end_s.at[0], layout=ROW), plgpu.load(end_s.at[1], layout=ROW),
                             plgpu.load(end_s.at[2], layout=COL), o_s, lse_s, target, row0, mine,
                             interpret=interpret)

    @pl.when(wg == 0)
    def _():
        plgpu.set_max_registers(SCORER_REGISTERS, action="decrease")
        score()

    @pl.when((wg > 0) & (wg <= NUM_MULTIPLIERS))
    def _():
        plgpu.set_max_registers(MULTIPLIER_REGISTERS, action="increase")
        multiply()

    if PRODUCER_WG:
        @pl.when(wg == 1 + NUM_MULTIPLIERS)
        def _():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            produce()


def launch(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, *, softmax_scale: float,
           page_size: int, s_q: int, num_heads: int, num_splits: int, balanced: bool, num_pages: int | None,
           interpret: bool) -> tuple[jax.Array, jax.Array]:
    """``_kernel`` on its grid (work item, row block) with its warpgroups, SMEM and barriers, and
    the merge of split-KV partials (``mla_decode_mgpu.merge_items``)."""
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    q8, q_scale, q_rope, latent_pairs, rope_pairs, scales, plan = base.prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, page_size=page_size,
        num_splits=num_splits, balanced=balanced, num_pages=num_pages, scale_planes=True, page_major=True,
        interpret=interpret)
    num_rows = q8.shape[1]
    out_dtype = partial_dtype(q_rows.dtype)
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          partials=plan.partials, num_pages=num_pages, interpret=interpret),
        out_type=base.output_types(plan, num_rows, out_dtype),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_CHUNKS, BLOCK_M, CHUNK), FP8_DTYPE),
                           plgpu.SMEM((NUM_MULTIPLIERS, BLOCK_M, PAGE), out_dtype,
                                      transforms=() if interpret else output_transforms(out_dtype))),
            plgpu.SMEM((BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, PAGE, CHUNK), FP8_DTYPE),
            plgpu.SMEM((NUM_SLOTS, PAGE, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, 3, PAGE), jnp.float32),
            plgpu.SMEM((2, BLOCK_M, PAGE), FP8_DTYPE, transforms=HALF_BYTE_TILE_TRANSFORMS),
            plgpu.SMEM((2, 1, BLOCK_M), jnp.float32),
            plgpu.SMEM((3, BLOCK_M), jnp.float32),
            plgpu.Barrier(num_arrivals=COPIES_PAGE, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
            plgpu.Barrier(num_arrivals=NUM_MULTIPLIERS, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=base.COPIES_Q),
            plgpu.Barrier(num_arrivals=1),
        ],
        **base.grid_params(plan, num_rows // BLOCK_M, "snapmla_decode_fp8_mgpu_roles", interpret,
                           num_threads=1 + NUM_MULTIPLIERS + int(PRODUCER_WG)),
    )
    outs = kernel(seq_lens, plan.items, block_table, layer_offset, q8, q_scale, q_rope, latent_pairs, scales,
                  rope_pairs)
    out, lse = base.merge_items(outs, plan, q_rows.dtype, num_splits=num_splits, interpret=interpret)
    return base.unpadded(out, lse, q_rows.shape[1])


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "balanced", "num_pages", "interpret"))
def mla_decode_mgpu_roles(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                          seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                          s_q: int, num_heads: int, num_splits: int = 1, balanced: bool = False,
                          num_pages: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 decode on Mosaic GPU with a scorer and two multiplier warpgroups: the arguments and
    results of ``mla_decode_mgpu.mla_decode_mgpu``."""
    return launch(q_rows, q_rope_rows, cache_arrays, block_table, seq_lens, layer_offset, softmax_scale=softmax_scale,
                  page_size=page_size, s_q=s_q, num_heads=num_heads, num_splits=num_splits, balanced=balanced,
                  num_pages=num_pages, interpret=interpret)
