"""SnapMLA decode attention over the paged latent cache: one kernel body for the
FP8 cache and its BF16 twin, its launcher with split-KV combine, and the
pure-jnp reference of the same math.

Layout. The caller flattens queries to rows: ``q_rows[b, r]`` with
``r = i * H + h`` for query position ``i < s_q`` and head ``h``, padded to a
multiple of the row block. One program owns (batch row b, split, row block):
``block_m`` query rows against one contiguous range of b's tokens, walked
``block_n`` tokens at a time. s_q > 1 costs nothing extra: the s_q query
positions are more rows of the same matrix product, each with its own causal
limit (row ``i`` sees tokens ``[0, seq_len - s_q + i]``), and every cache byte
is read once per (batch row, row block).

Paging. The cache arrays are passed whole (``memory_space=pl.ANY``) as
[rows, dim] views of [L?, num_pages, page_size, dim]; a token t lives in row
``layer_offset + page * page_size + t % page_size`` with its page read from
``block_table`` inside the kernel, so a layered cache is never sliced (which
would copy it). For page sizes that are multiples of 16 a token block lies in
one page and is loaded as one contiguous tile (1.46x faster than a gather for
the BF16 twin); other page sizes gather rows token by token.

FP8 math (``quantized=True``), per token block:
  * Q content is quantized once at entry, one scale per query row (= per query
    token and head): the scale of a row factors out of that row's 512-term dot
    product exactly, so it is the finest granularity one FP8 MMA can use, and
    heads differ in magnitude, so a coarser (per token) scale would waste range.
  * scores = (Q8 . K8^T) * q_scale[row] * k_scale[col] + (Qr . Kr^T)  (FP8 x FP8
    and BF16 x BF16 products, fp32 accumulation), times softmax_scale * log2(e)
    so that the online softmax runs on exp2.
  * PV: P'[r, t] = P[r, t] * k_scale[t] (the token's V scale, a column of P);
    each row of the block is multiplied by f_r = 448 / max_t P'[r, t], cast to
    e4m3 and multiplied with the FP8 latent; the fp32 product is multiplied by
    1 / f_r. (With 64-row blocks that product runs on BF16 MMAs of the exactly
    widened e4m3 values, which Triton executes faster: DecodeConfig.pv_mma.) Without f_r a token whose scale is 1000x below its neighbours'
    would underflow e4m3; with it, ratios down to 448 / 2**-6 ~ 3e4 inside a
    block stay in e4m3's normal range.
The BF16 twin runs the same body with Q and P cast to bf16 and no scales.

Split-KV (flash-decoding): with ``num_splits > 1`` each split writes its fp32
partial output and log-sum-exp; ``combine_splits`` merges them (one Pallas launch,
reading B x splits x rows x 512 floats; pallas_kernels/combine_splits.py).

Backend: Pallas' Triton lowering. Compiled decoding on Hopper uses these kernels for the bf16
cache at few query rows and for pages other than 64 tokens; the Mosaic GPU kernels
(mla_decode_mgpu*.py) take the rest there (``snapmla_jax.decode.default_config``). Triton's ``tt.dot`` re-lays the
token-major FP8 latent for P.V through registers, so the FP8 body is register-bound.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Pallas' Triton backend as combine_splits imports it: None in a jax without it (``pallas_triton_available``).
from snapmla_jax.pallas_kernels.combine_splits import combine_splits, plgpu_tr, require_pallas_triton
from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, FP8_E4M3_MAX, quantize_per_token

LOG2E = math.log2(math.e)  # folded into the softmax scale: exp(x) = exp2(x * log2(e))
LN2 = math.log(2.0)  # converts the kernel's base-2 log-sum-exp back to natural log
# Floor on a block row's P' maximum before dividing by it (all-zero rows:
# masked tokens, or zero scales); such a row contributes 0 either way.
MIN_PV_ROW_MAX = 2.0**-100
MIN_BLOCK = 16  # smallest matrix dimension Triton's dot accepts


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of the decode kernel (chosen by measurement: scripts/tune_decode.py).

    block_m: largest number of query rows (heads x s_q) per program; a power of
             two >= 16 (Triton's dot minimum). The fp32 accumulator is
             block_m x 512 x 4 bytes and lives in registers.
    block_n: tokens per inner step, a power of two >= 16.
    pv_mma:  which tensor-core instruction multiplies P' (e4m3) by the e4m3
             latent tile in the FP8 kernel: "fp8" (an FP8 MMA, whose token-major
             B operand Triton re-lays through registers), "bf16" (both operands
             widened to bf16 first), or "auto": "bf16" for 64-row blocks, "fp8"
             for smaller ones (the faster of the two on an H100 at each size,
             scripts/tune_decode.py). e4m3 -> bf16 is exact and both MMAs
             accumulate the exact products in fp32, so the math is the same
             (measured: bit-identical outputs).
    kernel:  "triton" (this file's kernels) or "mosaic": the FP8 kernel on
             Mosaic GPU with two warpgroups per CTA
             (pallas_kernels/mla_decode_mgpu.py; fp8 cache, page_size 64;
             block_m, block_n, num_warps, num_stages and pv_mma do not apply).
             With backend="interpret" on a machine with few cores, start Python
             with JAX_NUM_CPU_DEVICES=8: the interpreter runs the two
             warpgroups as threads and can otherwise stall.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pv_mma: str = "auto"
    kernel: str = "triton"

    def __post_init__(self):
        if self.pv_mma not in ("auto", "fp8", "bf16"):
            raise ValueError(f"DecodeConfig.pv_mma: expected 'auto', 'fp8' or 'bf16', got {self.pv_mma!r}")
        if self.kernel not in ("triton", "mosaic"):
            raise ValueError(f"DecodeConfig.kernel: expected 'triton' or 'mosaic', got {self.kernel!r}")


# Measured on an H100 at B=64, ctx=16k, H=128 (scripts/tune_decode.py). The FP8
# body holds its latent tile in registers (Triton re-lays 8-bit tiles for the
# P.V product through registers), so it needs 8 warps to fit 64 rows x 512
# fp32 and the tile; the BF16 twin feeds both products from shared memory and
# runs best with 32 rows and 4 warps.
# With 64-row blocks its P'.V runs on BF16 MMAs (same products): 1.18-1.23x
# faster than the FP8 MMA at H=128 (2.57 vs 3.13 ms at B=64 x 16k); with 16 or
# 32 rows (H=16) the FP8 MMA is 1.1-1.2x faster (scripts/tune_decode.py).
FP8_CONFIG = DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, pv_mma="auto")
BF16_CONFIG = DecodeConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)
# The Mosaic GPU FP8 kernel (mla_decode_mgpu.py): what compiled decoding over an
# fp8 cache with 64-token pages uses (snapmla_jax.decode.default_config).
MOSAIC_CONFIG = DecodeConfig(kernel="mosaic")


def tokens_per_block(page_size: int, config: DecodeConfig) -> int:
    """Tokens per inner step for ``page_size``: a block never straddles a page when
    the page size is a multiple of 16 (the block is then one contiguous run of
    cache rows); other page sizes use config.block_n with a per-token gather."""
    if page_size % MIN_BLOCK:
        return config.block_n
    return math.gcd(config.block_n, page_size & -page_size)


def rows_per_block(num_rows: int, config: DecodeConfig) -> int:
    """Query rows per program for ``num_rows`` = s_q * H rows: a power of two in [16, block_m]."""
    return min(config.block_m, max(MIN_BLOCK, pl.next_power_of_2(num_rows)))


def resolve_pv_mma(config: DecodeConfig, block_m: int) -> str:
    """config.pv_mma with "auto" resolved for a block of ``block_m`` rows."""
    if config.pv_mma != "auto":
        return config.pv_mma
    return "bf16" if block_m >= 64 else "fp8"


def _fp8_pv_factor(pv_row_max: jax.Array) -> jax.Array:
    """f [M] mapping each row's largest P' onto 448, the top of e4m3's range.

    The scaled row 448 * P'/max depends only on ratios inside the block, not on
    the running softmax max, so the e4m3 rounding is the same whether the block
    is met early or late, in one split or another (up to fp32 ulps).
    """
    return FP8_E4M3_MAX / jnp.maximum(pv_row_max, MIN_PV_ROW_MAX)


def _to_fp8_p(pv: jax.Array, factor: jax.Array) -> jax.Array:
    """P' [M, N] f32 scaled by factor [M] and cast to e4m3 (clamped: rounding may cross 448)."""
    return jnp.minimum(pv * factor[:, None], FP8_E4M3_MAX).astype(FP8_DTYPE)


def _dot_nt(a, b):
    """a [M, K] . b [N, K]^T -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [M, K] . b [K, N] -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mla_decode_kernel(seq_lens_ref, block_table_ref, layer_offset_ref, q_ref, q_rope_ref, latent_ref, *refs,
                       quantized: bool, block_n: int, page_size: int, num_splits: int, num_heads: int,
                       s_q: int, scale_log2: float, num_pages: int, pv_mma: str = "fp8"):
    """One (batch row, split, row block) program.

    Traced inputs are not validated (``snapmla_jax.decode.mla_decode`` checks concrete ones),
    so every read stays inside the arrays whatever they hold: page ids are clipped into
    [0, num_pages) here, and seq_lens into [0, max_pages * page_size] by the launcher
    (``mla_decode_pallas``), as the XLA reference's gather clips them.

    seq_lens_ref     [B] int32            tokens in the cache per batch row (incl. the s_q new ones)
    block_table_ref  [B, max_pages] int32 pages of each batch row
    layer_offset_ref [1] int32            first cache row of the selected layer
    q_ref            [block_m, R]         query content rows (bf16/f32)
    q_rope_ref       [block_m, Dr]        query RoPE rows
    latent_ref       [N, R]               cache latent (e4m3 or bf16), N = layers x pages x page_size
    refs             ([scale_ref [N] f32,] rope_ref [N, Dr] bf16, o_ref [block_m, R], lse_ref [block_m] f32)
    """
    if quantized:
        scale_ref, rope_ref, o_ref, lse_ref = refs
    else:
        rope_ref, o_ref, lse_ref = refs
    b = pl.program_id(0)
    split = pl.program_id(1)
    row_block = pl.program_id(2)
    block_m, rank = q_ref.shape
    max_pages = block_table_ref.shape[1]

    seq_len = plgpu_tr.load(seq_lens_ref.at[b])  # clipped by the launcher
    # Splits take equal ranges, rounded to whole token blocks so that block
    # boundaries sit at multiples of block_n whatever the split count (the
    # reference's per-block P' factors rely on that).
    per_split = pl.cdiv(pl.cdiv(seq_len, num_splits), block_n) * block_n
    start = split * per_split
    end = jnp.minimum(seq_len, start + per_split)
    num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_n)
    layer_offset = layer_offset_ref[0]

    q = q_ref[...].astype(jnp.float32)
    if quantized:
        q_content, q_scale = quantize_per_token(q)
        row_scale = q_scale * scale_log2
    else:
        q_content = q.astype(jnp.bfloat16)
    q_rope = q_rope_ref[...].astype(jnp.bfloat16)
    rows = row_block * block_m + jnp.arange(block_m, dtype=jnp.int32)
    # Row r is query position r // H; padding rows get positions >= s_q and
    # are sliced off by the caller.
    visible_len = seq_len - s_q + rows // num_heads + 1

    def step(j, carry):
        acc, m, l = carry
        first = start + j * block_n
        t = first + jnp.arange(block_n, dtype=jnp.int32)
        in_range = t < end
        if page_size % block_n == 0:
            # The block is one run of rows inside one page: plain 2-D tile loads.
            page = jnp.clip(plgpu_tr.load(block_table_ref.at[b, first // page_size]), 0, num_pages - 1)
            first_row = layer_offset + page * page_size + first % page_size
            cache_row = first_row + jnp.arange(block_n, dtype=jnp.int32)
            tile = lambda ref: plgpu_tr.load(ref.at[pl.ds(first_row, block_n), :],
                                             mask=jnp.broadcast_to(in_range[:, None], (block_n, ref.shape[1])),
                                             other=0.0)
        else:
            page_index = jnp.where(in_range, t // page_size, 0)
            page = plgpu_tr.load(block_table_ref.at[b, page_index], mask=in_range & (page_index < max_pages),
                                 other=0)
            page = jnp.clip(page, 0, num_pages - 1)
            cache_row = layer_offset + page * page_size + t % page_size
            tile = lambda ref: plgpu_tr.load(
                ref.at[cache_row[:, None], jnp.arange(ref.shape[1], dtype=jnp.int32)[None, :]],
                mask=jnp.broadcast_to(in_range[:, None], (block_n, ref.shape[1])), other=0.0)
        kv, k_rope = tile(latent_ref), tile(rope_ref)
        scores = _dot_nt(q_content, kv)
        if quantized:
            k_scale = plgpu_tr.load(scale_ref.at[cache_row], mask=in_range, other=0.0)
            scores = scores * row_scale[:, None] * k_scale[None, :]
        else:
            scores = scores * scale_log2
        scores = scores + _dot_nt(q_rope, k_rope) * scale_log2
        visible = in_range[None, :] & (t[None, :] < visible_len[:, None])
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so
        # that no -inf - -inf = NaN appears.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.where(visible, jnp.exp2(scores - m_safe[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        if quantized:
            pv = p * k_scale[None, :]
            pv_max = jnp.max(pv, axis=1)
            p8 = _to_fp8_p(pv, _fp8_pv_factor(pv_max))
            if pv_mma == "bf16":  # exact widening: the same products on BF16 MMAs
                p8, values = p8.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)
            else:
                values = kv
            pv_out = _dot_nn(p8, values) * (pv_max / FP8_E4M3_MAX)[:, None]
        else:
            pv_out = _dot_nn(p.astype(jnp.bfloat16), kv)
        return acc * alpha[:, None] + pv_out, m_new, l

    init = (jnp.zeros((block_m, rank), jnp.float32), jnp.full((block_m,), -jnp.inf, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, num_blocks, step, init)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)


def resolve_num_pages(num_pages: int | None, num_rows: int, page_size: int) -> int:
    """Pages in one layer of a cache of ``num_rows`` flat rows: ``num_pages``, or all of them (None)."""
    if num_pages is None:
        return num_rows // page_size
    if not isinstance(num_pages, int) or not 0 < num_pages * page_size <= num_rows:
        raise ValueError(f"num_pages: expected None or a positive int with num_pages x page_size <= {num_rows} "
                         f"cache rows, got {num_pages!r}")
    return num_pages


@functools.partial(jax.jit, static_argnames=("softmax_scale", "page_size", "s_q", "num_heads", "num_splits",
                                             "config", "num_pages", "interpret"))
def mla_decode_pallas(q_rows: jax.Array, q_rope_rows: jax.Array, cache_arrays: tuple, block_table: jax.Array,
                      seq_lens: jax.Array, layer_offset: jax.Array, *, softmax_scale: float, page_size: int,
                      s_q: int, num_heads: int, num_splits: int, config: DecodeConfig = DecodeConfig(),
                      num_pages: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Run the decode kernel on flattened query rows.

    q_rows        [B, rows, R] bf16/f32, rows = s_q * num_heads padded to a multiple
                  of ``rows_per_block(s_q * num_heads, config)``; row i * H + h.
    q_rope_rows   [B, rows, Dr]
    cache_arrays  (latent [N, R] e4m3, scale [N] f32, rope [N, Dr] bf16) or
                  (latent [N, R] bf16, rope [N, Dr] bf16): the cache as flat rows.
    block_table   [B, max_pages] int32; seq_lens [B] int32; layer_offset [1] int32.
    num_pages     pages in one layer of the cache (None: N / page_size, a cache of one layer);
                  traced page ids are clipped into [0, num_pages), seq_lens into the table's
                  capacity, so that no read leaves the cache.
    Returns out [B, rows, R] in q_rows' dtype and lse [B, rows] float32 (natural log).
    """
    require_pallas_triton("mla_decode_pallas")
    batch, num_rows, rank = q_rows.shape
    num_pages = resolve_num_pages(num_pages, cache_arrays[0].shape[0], page_size)
    rope_dim = q_rope_rows.shape[2]
    block_m = rows_per_block(s_q * num_heads, config)
    if num_rows % block_m:
        raise ValueError(f"q_rows: expected rows padded to a multiple of {block_m}, got {num_rows}")
    quantized = len(cache_arrays) == 3
    out_dtype = q_rows.dtype if num_splits == 1 else jnp.float32
    # seq_lens are clipped here, not in the kernel: the same clip of the loaded seq_len inside
    # the kernel (as jnp.clip, min/max or where) made the BF16 twin 1.24-1.27x slower at
    # B = 64 x 4k-16k x 128 heads on an H100 (1.58 vs 1.27 ms; outputs identical), and this
    # XLA clip costs 1% there (1.28 ms).
    seq_lens = jnp.clip(seq_lens, 0, block_table.shape[1] * page_size)
    kernel = functools.partial(
        _mla_decode_kernel, quantized=quantized, block_n=tokens_per_block(page_size, config), page_size=page_size,
        num_splits=num_splits, num_heads=num_heads, s_q=s_q, scale_log2=softmax_scale * LOG2E,
        num_pages=num_pages, pv_mma=resolve_pv_mma(config, block_m))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, num_splits, num_rows // block_m),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, block_m, rank), lambda b, s, r: (b, r, 0)),
            pl.BlockSpec((None, block_m, rope_dim), lambda b, s, r: (b, r, 0)),
            *([whole] * len(cache_arrays)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_m, rank), lambda b, s, r: (b, s, r, 0)),
            pl.BlockSpec((None, None, block_m), lambda b, s, r: (b, s, r)),
        ],
        out_shape=[jax.ShapeDtypeStruct((batch, num_splits, num_rows, rank), out_dtype),
                   jax.ShapeDtypeStruct((batch, num_splits, num_rows), jnp.float32)],
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name="snapmla_decode_fp8" if quantized else "snapmla_decode_bf16",
    )(seq_lens, block_table, layer_offset, q_rows, q_rope_rows, *cache_arrays)
    if num_splits == 1:
        return out[:, 0], lse[:, 0]
    return combine_splits(out, lse, q_rows.dtype, interpret=interpret)


def mla_decode_reference(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, scale: jax.Array | None,
                         rope: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *, softmax_scale: float,
                         block_n: int = DecodeConfig.block_n) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp decode with the kernel's roundings (the "xla" backend).

    q_latent [B, s_q, H, R], q_rope [B, s_q, H, Dr] (bf16/f32); one layer of the
    cache: latent [P, S, R] (e4m3 with scale [P, S] f32, or bf16 with scale None),
    rope [P, S, Dr] bf16; block_table [B, max_pages] int32; seq_lens [B] int32.
    Returns out [B, s_q, H, R] in q_latent's dtype and lse [B, s_q, H] f32.

    The pages of each row are gathered (a copy: fine for a reference and on
    CPU). FP8: Q quantized per row, P' quantized per row and ``block_n``-token
    block with the kernel's power-of-two factors; the factor of a block depends
    only on ratios within it, so this global-max formulation rounds P' as the
    kernel's online softmax does (up to fp32 differences in exp2).
    BF16: bf16 operands, fp32 accumulation and softmax.
    """
    batch, s_q, num_heads, rank = q_latent.shape
    page_size = latent.shape[1]
    num_tokens = block_table.shape[1] * page_size
    padded_tokens = pl.cdiv(num_tokens, block_n) * block_n
    gather = lambda a: jnp.take(a, block_table, axis=0, mode="clip").reshape(batch, num_tokens, *a.shape[2:])
    pad = lambda a: jnp.pad(a, [(0, 0), (0, padded_tokens - num_tokens)] + [(0, 0)] * (a.ndim - 2))
    # Slots past seq_len hold whatever the pages hold: zero them so that a 0 weight
    # never meets a NaN.
    in_seq = (jnp.arange(padded_tokens)[None, :] < seq_lens[:, None])[..., None]
    kv = jnp.where(in_seq, pad(gather(latent)), 0).astype(latent.dtype)
    k_rope = jnp.where(in_seq, pad(gather(rope)), 0).astype(rope.dtype)
    scale_log2 = softmax_scale * LOG2E
    quantized = scale is not None
    dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    if quantized:
        k_scale = jnp.where(in_seq[..., 0], pad(gather(scale)), 0.0)
        q_content, q_scale = quantize_per_token(q_latent.astype(jnp.float32))
        # e4m3 x e4m3 products are exact in fp32, so an fp32 einsum is the FP8 MMA.
        kv32 = kv.astype(jnp.float32)
        scores = (dot("bihd,btd->biht", q_content.astype(jnp.float32), kv32)
                  * (q_scale * scale_log2)[..., None] * k_scale[:, None, None, :])
    else:
        scores = dot("bihd,btd->biht", q_latent.astype(jnp.bfloat16), kv) * scale_log2
    scores = scores + dot("bihd,btd->biht", q_rope.astype(jnp.bfloat16), k_rope) * scale_log2
    t = jnp.arange(padded_tokens)
    visible_len = seq_lens[:, None] - s_q + jnp.arange(s_q)[None, :] + 1  # [B, s_q]
    visible = (t[None, None, :] < visible_len[..., None])[:, :, None, :]
    scores = jnp.where(visible, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.where(visible, jnp.exp2(scores - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    if quantized:
        pv = (p * k_scale[:, None, None, :]).reshape(batch, s_q, num_heads, padded_tokens // block_n, block_n)
        pv_max = jnp.max(pv, axis=-1, keepdims=True)
        p8 = (jnp.minimum(pv * _fp8_pv_factor(pv_max), FP8_E4M3_MAX).astype(FP8_DTYPE).astype(jnp.float32)
              * (pv_max / FP8_E4M3_MAX))
        out = dot("biht,btd->bihd", p8.reshape(p.shape), kv32)
    else:
        out = dot("biht,btd->bihd", p.astype(jnp.bfloat16), kv)
    seen = l > 0
    out = out / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)
    return out.astype(q_latent.dtype), lse
