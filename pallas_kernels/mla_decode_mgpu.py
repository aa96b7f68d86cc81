"""SnapMLA FP8 MLA decode on Mosaic GPU (Hopper wgmma + TMA): first version.

Status (2026-11-23): lowers for CUDA (its buffers take 213,504 B of SMEM, the
H100 allows 232,448) and matches ``mla_decode_reference`` in the Mosaic GPU
interpreter on CPU. NOT yet run on a GPU (no device was lent in the session
that made it fit), so it is not wired into ``snapmla_jax.mla_decode``. The
parts the interpreter cannot check are the V transpose and the P' packing,
both through ``RefUnion`` views; the V transpose was verified on an H100 in
isolation (scripts/probe_mgpu_transpose.py). Plan and history:
docs/mosaic_gpu_decode_plan.md.

Same inputs and outputs as ``pallas_kernels.mla_decode.mla_decode_pallas`` with
an FP8 cache, ``page_size == 64`` and ``num_splits == 1``:

  q_rows       [B, rows, 512] bf16/f32, rows = s_q * H padded to a multiple of 64
  q_rope_rows  [B, rows, 64]
  cache_arrays (latent [N, 512] e4m3, scale [N] f32, rope [N, 64] bf16), flat rows
  block_table  [B, max_pages] int32, seq_lens [B] int32,
  layer_offset [1] int32, a multiple of 64 (layer x pages x 64)
  -> out [B, rows, 512] (q_rows' dtype), lse [B, rows] f32 (natural log)

Math (as the Triton FP8 kernel, so ``mla_decode_reference(..., block_n=128)``
is its reference): Q quantized per row (in the launcher, one XLA fusion, with
``quantize_per_token``); scores = Q8.K8^T * q_scale * k_scale + Qr.Kr^T (FP8
and BF16 wgmma, fp32 accumulation) in base 2; online softmax on exp2; P' = P *
k_scale per token, scaled per row by 448 / max over the 128-token step, cast
e4m3, FP8 wgmma with V^T, the factor undone in fp32.

Layout of the work. Grid (batch row, block of 64 query rows, column quarter).
One warpgroup per CTA owns 128 of the 512 output columns (fp32 acc 64 x 128 =
64 registers a thread). Each CTA computes the whole 64 x 128 score tile (the QK
product is done 4 times, once per quarter; the 4 CTAs of a (b, row block) run
next to each other so that their cache reads mostly hit L2). Why quarters: no
cross-warpgroup exchange of P, no register pressure, and each CTA transposes
exactly one 128-column V chunk, the width at which the transposed 16-bit store
lowers. It costs 2.5x the MMA work of an ideal kernel: a first correct
version, not the final design.

Step order. A step covers 128 tokens = two 64-token pages (the 16-bit WGMMA
layout of the transposed store needs 64 rows of token pairs). The TMA brings
the even tokens of the step to SMEM rows 0..63 and the odd ones to rows
64..127 (strided boxes from a free [N/2, 2, 512] reshape of the cache), so
row c holds token 2c (c < 64) or 2(c - 64) + 1 (``step_token_order``). Scores,
RoPE rows and token scales all follow that order; the token scales are
gathered per batch row in step order by the launcher (a TMA cannot read every
other float; 8 B a token against the cache's 644 B).

V transpose and P' packing. An FP8 wgmma needs its B operand K-major (tokens
contiguous for P'.V), and Mosaic GPU has no 8-bit transpose. Rows k and 64 + k
of the step's V chunk are tokens 2k and 2k + 1: loaded as two [64, 128] tiles
and packed into uint16 words (low byte = token 2k), they are stored through
the transposed view of a uint16 [128, 64] buffer whose ``RefUnion`` e4m3
[128, 128] view is V^T in token order. P' is packed the same way (word k of a
row = columns k and 64 + k) into a uint16 [64, 64] buffer whose e4m3 [64, 128]
view is P' in token order, the wgmma's A operand. No second copy of the tile.

Pipelining: the 4 latent chunks (QK operand) have a 2-slot TMA ring, requested
one step ahead; rope and scales have one buffer, refilled for step j + 1 after
step j's P'.V. No warp specialisation yet.

Layout inference: every dynamic TMA start is marked with ``pl.multiple_of``
(``_aligned``). Without it, Mosaic GPU cannot prove that a box starts on a
whole SMEM tile and its layout search runs out of fuel ("Layout inference
failed to find a solution"): that, not SMEM bookkeeping, was what made earlier
versions of this kernel fail whenever a buffer was added or removed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX, quantize_per_token
from pallas_kernels.mla_decode import LN2, LOG2E, MIN_PV_ROW_MAX


PAGE = 64  # cache page size this kernel supports
STEP = 128  # tokens per inner step: two pages (see the module docstring)
HALF = STEP // 2
BLOCK_M = 64  # query rows per CTA (one wgmma M)
CHUNK = 128  # output columns per CTA, and the K width of each QK wgmma
RANK = 512
ROPE = 64
NUM_CHUNKS = RANK // CHUNK
NUM_SLOTS = 2  # kv ring; every other buffer is single
# TMA copies that arrive on a barrier per step (each copy arrives once):
# kv, per page and token parity: 4 latent chunks; vr, per page and parity: the
# rope rows, plus one box of step-ordered token scales.
COPIES_KV = 2 * 2 * NUM_CHUNKS
COPIES_VR = 2 * 2 + 1
COPIES_Q = NUM_CHUNKS + 2  # Q8 chunks, Q rope, q scale


def _as_u16(x: jax.Array) -> jax.Array:
    """The bits of an 8-bit array, widened to uint16."""
    return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint16)


def _aligned(index, multiple: int):
    """``index`` marked as a multiple of ``multiple`` for layout inference (python ints pass through).

    Without it, a dynamic TMA start is only known to be a multiple of 1, and
    Mosaic GPU's layout inference cannot pick a tiled SMEM layout for the
    destination: it searches until its fuel runs out ("failed to find a
    solution").
    """
    return index if isinstance(index, int) else pl.multiple_of(index, multiple)


def step_token_order(num_tokens: int) -> jax.Array:
    """Token offset held by each SMEM row of a step, for ``num_tokens`` = k * STEP positions.

    Within a step, rows 0..63 hold the even tokens and rows 64..127 the odd ones
    (row c < 64: token 2c; row c >= 64: token 2(c - 64) + 1).
    """
    c = jnp.arange(num_tokens) % STEP
    base = jnp.arange(num_tokens) - c
    return base + jnp.where(c < HALF, 2 * c, 2 * (c - HALF) + 1)


def step_scales(scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array) -> jax.Array:
    """Token scales [B, steps * 128] f32 of each batch row's pages, in step order.

    scale [N] f32 (flat cache rows), block_table [B, max_pages] int32,
    layer_offset [1] int32. A TMA cannot read every other float, so the
    launcher gathers them (8 B a token of extra traffic against the cache's
    644 B); positions past the table read its last page (masked in the kernel).
    """
    max_pages = block_table.shape[1]
    positions = step_token_order(pl.cdiv(max_pages * PAGE, STEP) * STEP)
    pages = jnp.take(block_table, jnp.minimum(positions // PAGE, max_pages - 1), axis=1)
    return jnp.take(scale, layer_offset[0] + pages * PAGE + positions % PAGE, mode="clip")


def step_iotas(row0, seq_len, *, s_q: int, num_heads: int):
    """Per-step constants: (token offset within the step of each score column [64, 128],
    visible length per row (a scalar at s_q = 1, [64, 128] otherwise), word row ids [64, 128])."""
    row_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, STEP), 0, layout=plgpu.Layout.WGMMA)
    col_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, STEP), 1, layout=plgpu.Layout.WGMMA)
    col_tokens = jnp.where(col_ids < HALF, 2 * col_ids, 2 * (col_ids - HALF) + 1)  # step order
    if s_q == 1:
        visible_len = seq_len  # padding rows see all tokens too; the caller slices them off
    else:
        # Row i * H + h is query position i: causal limit seq_len - s_q + i + 1.
        visible_len = seq_len - s_q + lax.div(row0 + row_ids, jnp.int32(num_heads)) + 1
    # Word k of a packed V tile holds tokens 2k (low byte) and 2k + 1.
    word_ids = plgpu.broadcasted_iota(jnp.int32, (HALF, CHUNK), 0, layout=plgpu.Layout.WGMMA)
    return col_tokens, visible_len, word_ids


def page_boxes(bt_ref, b, step, layer_offset):
    """TMA boxes of a step, yielding (parity, source token pairs, destination rows):
    per page of the step and token parity, the pairs ``pl.ds`` in the [N/2, 2, ...]
    pair views and the 32 step-order rows (even tokens to rows 0..63) they fill.

    Pages past the table's end (only in a partial last step) are clamped; their
    tokens are masked.
    """
    max_pages = bt_ref.shape[1]
    for half in range(2):
        page = bt_ref[b, jnp.minimum(step * 2 + half, max_pages - 1)]
        # layer_offset is a multiple of PAGE: the TMA boxes start on whole pages.
        first_pair = _aligned((layer_offset + page * PAGE) // 2, PAGE // 2)
        for parity in range(2):
            yield parity, pl.ds(first_pair, PAGE // 2), pl.ds(parity * HALF + half * (PAGE // 2), PAGE // 2)


def issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, bar) -> None:
    """TMA of a row block's query tiles: 4 FP8 chunks, the RoPE part and the per-row scale."""
    for ch in range(NUM_CHUNKS):
        plgpu.copy_gmem_to_smem(q8_ref.at[b, pl.ds(row0, BLOCK_M), pl.ds(ch * CHUNK, CHUNK)], q8_s.at[ch], bar)
    plgpu.copy_gmem_to_smem(qr_ref.at[b, pl.ds(row0, BLOCK_M)], qr_s, bar)
    plgpu.copy_gmem_to_smem(qsc_ref.at[b, pl.ds(row0, BLOCK_M)], qsc_s, bar)


def qk_products(q8_s, kv_slot, qr_s, rope_slot) -> tuple[jax.Array, jax.Array]:
    """A step's scores before scaling: (Q8 . K8^T over the 4 chunks of ``kv_slot`` (e4m3
    [4, 128, 128]), Qr . Kr^T with ``rope_slot`` (bf16 [128, 64])), both f32 [64, 128]."""
    def qk8(acc_ref):
        for ch in range(NUM_CHUNKS):
            plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch].transpose((1, 0)))
        return acc_ref[...]

    def qk_rope(acc_ref):
        plgpu.wgmma(acc_ref, qr_s, rope_slot.transpose((1, 0)))
        return acc_ref[...]

    return (pl.run_scoped(qk8, plgpu.ACC((BLOCK_M, STEP), jnp.float32)),
            pl.run_scoped(qk_rope, plgpu.ACC((BLOCK_M, STEP), jnp.float32)))


def softmax_step(s8, sr, q_row_scale, k_scale, visible, m, l, scale_log2: float):
    """One step's online softmax and P' (module docstring, "Math").

    s8, sr [64, 128] f32 (FP8 and RoPE products), q_row_scale [64], k_scale
    [128], visible [64, 128] bool, running m, l [64]. Returns (m_new, alpha,
    l_new, p8 e4m3 [64, 128] in step order, pv_max [64]: the factor to undo).
    """
    k_scale_b = lax.broadcast_in_dim(k_scale, (BLOCK_M, STEP), [1])
    scores = s8 * lax.broadcast_in_dim(q_row_scale, (BLOCK_M, STEP), [0]) * k_scale_b + sr * scale_log2
    scores = jnp.where(visible, scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.where(visible, jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0])), 0.0)
    l = l * alpha + p.sum(axis=1)
    pv = jnp.where(visible, p * k_scale_b, 0.0)  # select: masked slots may hold any bytes
    pv_max = pv.max(axis=1)
    factor = FP8_E4M3_MAX / jnp.maximum(pv_max, MIN_PV_ROW_MAX)
    p8 = jnp.minimum(pv * lax.broadcast_in_dim(factor, pv.shape, [0]), FP8_E4M3_MAX).astype(FP8_DTYPE)
    return m_new, alpha, l, p8, pv_max


def pack_p(p8: jax.Array) -> jax.Array:
    """P' e4m3 [64, 128] in step order -> uint16 [64, 64] words in token order
    (word k = column k: token 2k, low byte; column 64 + k: token 2k + 1)."""
    bits = _as_u16(p8)
    return bits[:, :HALF] | (bits[:, HALF:] << 8)


def v_words(chunk_ref, t0, seq_len, word_ids) -> jax.Array:
    """A step's V chunk (SMEM e4m3 [128, 128] in step order) as uint16 [64, 128] token-pair
    words (rows k and 64 + k are tokens 2k and 2k + 1); tokens past seq_len are zeroed
    (0 * NaN would poison the P'.V sum)."""
    even = (t0 + 2 * word_ids) < seq_len
    odd = (t0 + 2 * word_ids + 1) < seq_len
    lo = _as_u16(plgpu.load(chunk_ref.at[pl.ds(0, HALF)], layout=plgpu.Layout.WGMMA))
    hi = _as_u16(plgpu.load(chunk_ref.at[pl.ds(HALF, HALF)], layout=plgpu.Layout.WGMMA))
    return jnp.where(even, lo, jnp.uint16(0)) | jnp.where(odd, hi << 8, jnp.uint16(0))


def v_masked_token_major(chunk_ref, t0, seq_len) -> jax.Array:
    """Interpreter path: the V chunk e4m3 [128, 128] in step order with tokens past
    seq_len zeroed (the interpreter's FP8 wgmma accepts a token-major B operand)."""
    v_rows = plgpu.broadcasted_iota(jnp.int32, (STEP, CHUNK), 0, layout=plgpu.Layout.WGMMA)
    v_tokens = t0 + jnp.where(v_rows < HALF, 2 * v_rows, 2 * (v_rows - HALF) + 1)
    return jnp.where(v_tokens < seq_len, chunk_ref[...].astype(jnp.float32), 0.0).astype(FP8_DTYPE)


def prepare_inputs(q_rows, q_rope_rows, cache_arrays, block_table, layer_offset, *, softmax_scale: float,
                   page_size: int, name: str):
    """Checks and launcher-side inputs shared by the Mosaic kernels.

    Returns (q8 e4m3 [B, rows, 512], q_row_scale f32 [B, rows] (times softmax
    scale * log2 e), latent pairs e4m3 [N/2, 2, 512], rope pairs bf16 [N/2, 2,
    64] (free reshapes), step-ordered token scales f32 [B, steps * 128]).
    """
    num_rows, rank = q_rows.shape[1:]
    if page_size != PAGE or rank != RANK or q_rope_rows.shape[2] != ROPE or len(cache_arrays) != 3:
        raise ValueError(f"{name}: FP8 cache, page_size {PAGE}, rank {RANK}, rope {ROPE} only")
    if num_rows % BLOCK_M:
        raise ValueError(f"q_rows: expected rows padded to a multiple of {BLOCK_M}, got {num_rows}")
    latent, scale, rope = cache_arrays
    q8, q_scale = quantize_per_token(q_rows.astype(jnp.float32))
    return (q8, q_scale * (softmax_scale * LOG2E), latent.reshape(latent.shape[0] // 2, 2, RANK),
            rope.reshape(rope.shape[0] // 2, 2, ROPE), step_scales(scale, block_table, layer_offset))


def _kernel(seq_lens_ref, bt_ref, off_ref, q8_ref, qsc_ref, qr_ref, latp_ref, ksc_ref, ropep_ref,
            o_ref, lse_ref,
            q_union, qr_s, kv_s, rope_s, ksc_s, vt_union, p_union, kv_bar, vr_bar, q_bar,
            *, s_q: int, num_heads: int, scale_log2: float, interpret: bool):
    """One CTA: (batch row b, row block r, column quarter c); shapes in the module docstring.

    SMEM: q_union = (q8_s e4m3 [4, 64, 128] | (o_s [64, 128], lse_s f32 [64])),
    qr_s bf16 [64, 64], kv_s e4m3 [2, 4, 128, 128] (slot, chunk, step row, feature),
    rope_s bf16 [128, 64], ksc_s f32 [128] (rows in step order, see
    ``step_token_order``), vt_union = (uint16 [128, 64] | e4m3 [128, 128]),
    p_union = (p16_s uint16 [64, 64] | p8_s e4m3 [64, 128] | qsc_s f32 [64]).
    """
    b = lax.axis_index("b")
    r = lax.axis_index("r")
    c = lax.axis_index("c")
    vt16_s, vt8_s = vt_union
    # The output tile and lse reuse Q8's bytes after the loop; P' reuses the q
    # scales' (read into registers before the loop).
    q8_s, (o_s, lse_s) = q_union
    p16_s, p8_s, qsc_s = p_union
    seq_len = seq_lens_ref[b]
    layer_offset = off_ref[0]
    num_steps = (seq_len + (STEP - 1)) // STEP
    row0 = _aligned(r * BLOCK_M, BLOCK_M)

    issue_query(q8_ref, qr_ref, qsc_ref, b, row0, q8_s, qr_s, qsc_s, q_bar)

    def issue_kv(step, slot):
        """The 4 latent chunks of a step (2 slots): even tokens to rows 0..63, odd to 64..127."""
        for parity, src, dst in page_boxes(bt_ref, b, step, layer_offset):
            for ch in range(NUM_CHUNKS):
                plgpu.copy_gmem_to_smem(latp_ref.at[src, parity, pl.ds(ch * CHUNK, CHUNK)], kv_s.at[slot, ch, dst],
                                        kv_bar.at[slot])

    def issue_vr(step):
        """Rope rows (same order as kv) and token scales (1 slot, SMEM is short).

        Issued for step j + 1 only after step j has read both buffers.
        """
        for parity, src, dst in page_boxes(bt_ref, b, step, layer_offset):
            plgpu.copy_gmem_to_smem(ropep_ref.at[src, parity], rope_s.at[dst], vr_bar)
        plgpu.copy_gmem_to_smem(ksc_ref.at[b, pl.ds(_aligned(step * STEP, STEP), STEP)], ksc_s, vr_bar)

    @pl.when(num_steps > 0)
    def _():
        issue_kv(0, 0)

    plgpu.barrier_wait(q_bar)
    q_row_scale = plgpu.load(qsc_s, layout=plgpu.Layout.WGMMA.reduce(1))

    @pl.when(num_steps > 0)
    def _():
        issue_vr(0)
    col_tokens, visible_len, word_ids = step_iotas(row0, seq_len, s_q=s_q, num_heads=num_heads)

    def step(j, carry):
        acc, m, l = carry
        t0 = j * STEP
        slot = lax.rem(j, NUM_SLOTS)
        plgpu.barrier_wait(kv_bar.at[slot])
        plgpu.barrier_wait(vr_bar)

        @pl.when(j + 1 < num_steps)
        def _():
            issue_kv(j + 1, 1 - slot)  # the other slot was read by step j - 1

        s8, sr = qk_products(q8_s, kv_s.at[slot], qr_s, rope_s)

        # This CTA's V chunk, read before the slot is refilled: token-pair words
        # for the transpose (the interpreter, which does not alias RefUnion
        # views, keeps V token-major instead).
        if not interpret:
            word = v_words(kv_s.at[slot, c], t0, seq_len, word_ids)
        else:
            v_tile = v_masked_token_major(kv_s.at[slot, c], t0, seq_len)

        k_scale = plgpu.load(ksc_s, layout=plgpu.Layout.WGMMA.reduce(0))
        m_new, alpha, l, p8, pv_max = softmax_step(s8, sr, q_row_scale, k_scale, (t0 + col_tokens) < visible_len,
                                                   m, l, scale_log2)
        if not interpret:
            p16_s[...] = pack_p(p8)
            vt16_s.transpose((1, 0))[...] = plgpu.layout_cast(word, plgpu.Layout.WGMMA)
            v_operand = vt8_s.transpose((1, 0))
        else:
            p8_s[...] = p8
            vt8_s[...] = v_tile
            v_operand = vt8_s
        plgpu.commit_smem()  # generic-proxy stores (P', V^T) -> visible to wgmma

        def pv_mma(acc_ref):
            plgpu.wgmma(acc_ref, p8_s, v_operand)
            return acc_ref[...]

        pv_out = pl.run_scoped(pv_mma, plgpu.ACC((BLOCK_M, CHUNK), jnp.float32))

        @pl.when(j + 1 < num_steps)
        def _():
            issue_vr(j + 1)  # rope_s and ksc_s are no longer read in this step
        undo = lax.broadcast_in_dim(pv_max * (1.0 / FP8_E4M3_MAX), (BLOCK_M, CHUNK), [0])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out * undo
        return acc, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((BLOCK_M, CHUNK), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
    acc, m, l = lax.fori_loop(0, num_steps, step, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_s[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_s.dtype)
    lse_s[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(row0, BLOCK_M), pl.ds(c * CHUNK, CHUNK)])

    @pl.when(c == 0)
    def _():
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, pl.ds(row0, BLOCK_M)])

    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "interpret"))
def mla_decode_mgpu(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                    seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                    s_q: int, num_heads: int, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 decode on Mosaic GPU; arguments and results as ``mla_decode_pallas`` (module docstring).

    ``layer_offset`` must be a multiple of 64 (it is layer x pages x 64).
    """
    batch, num_rows, _ = q_rows.shape
    q8, q_row_scale, latent_pairs, rope_pairs, scales = prepare_inputs(
        q_rows, q_rope_rows, cache_arrays, block_table, layer_offset, softmax_scale=softmax_scale,
        page_size=page_size, name="mla_decode_mgpu")
    out_dtype = q_rows.dtype
    kernel = plgpu.kernel(
        functools.partial(_kernel, s_q=s_q, num_heads=num_heads, scale_log2=softmax_scale * LOG2E,
                          interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, num_rows, RANK), out_dtype),
                  jax.ShapeDtypeStruct((batch, num_rows), jnp.float32)),
        scratch_types=[
            plgpu.RefUnion(plgpu.SMEM((NUM_CHUNKS, BLOCK_M, CHUNK), FP8_DTYPE),
                           (plgpu.SMEM((BLOCK_M, CHUNK), out_dtype), plgpu.SMEM((BLOCK_M,), jnp.float32))),
            plgpu.SMEM((BLOCK_M, ROPE), jnp.bfloat16),
            plgpu.SMEM((NUM_SLOTS, NUM_CHUNKS, STEP, CHUNK), FP8_DTYPE),
            plgpu.SMEM((STEP, ROPE), jnp.bfloat16),
            plgpu.SMEM((STEP,), jnp.float32),
            plgpu.RefUnion(plgpu.SMEM((CHUNK, HALF), jnp.uint16), plgpu.SMEM((CHUNK, STEP), FP8_DTYPE)),
            plgpu.RefUnion(plgpu.SMEM((BLOCK_M, HALF), jnp.uint16), plgpu.SMEM((BLOCK_M, STEP), FP8_DTYPE),
                           plgpu.SMEM((BLOCK_M,), jnp.float32)),
            plgpu.Barrier(num_arrivals=COPIES_KV, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=COPIES_VR),
            plgpu.Barrier(num_arrivals=COPIES_Q),
        ],
        grid=(batch, num_rows // BLOCK_M, NUM_CHUNKS),
        grid_names=("b", "r", "c"),
        kernel_name="snapmla_decode_fp8_mgpu",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(seq_lens, block_table, layer_offset, q8, q_row_scale, q_rope_rows.astype(jnp.bfloat16),
                  latent_pairs, scales, rope_pairs)
