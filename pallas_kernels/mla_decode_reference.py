"""The jnp reference of every decode kernel's math (``mla_decode(..., backend="xla")``), and the
constants and helpers the Mosaic GPU decode kernels share with it.

FP8 math over the fp8 cache (SnapMLA), per row and step of ``block_n`` tokens:
  * Q content is quantized once, one scale per query row (= per query token and head): the
    scale of a row factors out of that row's 512-term dot product exactly, so it is the finest
    granularity one FP8 MMA can use, and heads differ in magnitude, so a coarser (per token)
    scale would waste range.
  * scores = (Q8 . K8^T) * q_scale[row] * k_scale[col] + (Qr . Kr^T)  (FP8 x FP8 and BF16 x BF16
    products, fp32 accumulation), times softmax_scale * log2(e) so that the softmax runs on exp2.
  * PV: P'[r, t] = P[r, t] * k_scale[t] (the token's V scale, a column of P); each row of the
    step is multiplied by f_r = 448 / max_t P'[r, t], cast to e4m3 and multiplied with the FP8
    latent; the fp32 product is multiplied by 1 / f_r. Without f_r a token whose scale is 1000x
    below its neighbours' would underflow e4m3; with it, ratios down to 448 / 2**-6 ~ 3e4 inside
    a step stay in e4m3's normal range.
The BF16 twin: Q and P in bf16, no scales.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from snapmla_jax.pallas_kernels.fp8 import (FP8_E4M3_MAX, e4m3_values_with_scale, per_token_scale, residual_per_token,
                                         round_to_e4m3)

LOG2E = math.log2(math.e)  # folded into the softmax scale: exp(x) = exp2(x * log2(e))
LN2 = math.log(2.0)  # converts a base-2 log-sum-exp back to natural log
# Floor on a step row's P' maximum before dividing by it (all-zero rows: masked tokens, or zero
# scales); such a row contributes 0 either way.
MIN_PV_ROW_MAX = 2.0**-100
STEP = 128  # tokens of a P' factor: the Mosaic FP8 kernels' step (``mla_decode_mgpu`` takes it from here)


def resolve_num_pages(num_pages: int | None, num_rows: int, page_size: int) -> int:
    """Pages in one layer of a cache of ``num_rows`` flat rows: ``num_pages``, or all of them (None)."""
    if num_pages is None:
        return num_rows // page_size
    if not isinstance(num_pages, int) or not 0 < num_pages * page_size <= num_rows:
        raise ValueError(f"num_pages: expected None or a positive int with num_pages x page_size <= {num_rows} "
                         f"cache rows, got {num_pages!r}")
    return num_pages


def _fp8_pv_factor(pv_row_max: jax.Array) -> jax.Array:
    """f [M] mapping each row's largest P' onto 448, the top of e4m3's range.

    The scaled row 448 * P'/max depends only on ratios inside the block, not on
    the running softmax max, so the e4m3 rounding is the same whether the block
    is met early or late, in one split or another (up to fp32 ulps).
    """
    return FP8_E4M3_MAX / jnp.maximum(pv_row_max, MIN_PV_ROW_MAX)


def mla_decode_reference(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, scale: jax.Array | None,
                         rope: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *, softmax_scale: float,
                         block_n: int = STEP, query_terms: int = 1) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp decode with the kernel's roundings (the "xla" backend).

    q_latent [B, s_q, H, R], q_rope [B, s_q, H, Dr] (bf16/f32); one layer of the
    cache: latent [P, S, R] (e4m3 with scale [P, S] f32, or bf16 with scale None),
    rope [P, S, Dr] bf16; block_table [B, max_pages] int32; seq_lens [B] int32.
    Returns out [B, s_q, H, R] in q_latent's dtype and lse [B, s_q, H] f32.

    The pages of each row are gathered (a copy: fine for a reference and on
    CPU). FP8: Q quantized per row, P' quantized per row and ``block_n``-token
    block with the kernel's power-of-two factors; the factor of a block depends
    only on ratios within it, so this global-max formulation rounds P' as the
    kernel's online softmax does (up to fp32 differences in exp2). ``query_terms`` 2: the query
    as two FP8 terms (``mla_decode_mgpu_small``'s), its e4m3 rounding and what that leaves
    (q - q8 * q_scale in float32) rounded per row the same way, each product scaled by its own
    row scale.
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
        # Q and P' are rounded to e4m3 values held in float32 (``round_to_e4m3``: a float8 round
        # trip would vanish under XLA's GPU compiler); e4m3 x e4m3 products are exact in fp32, so
        # an fp32 einsum is the FP8 MMA.
        q_scale = per_token_scale(q_latent)
        q_content = e4m3_values_with_scale(q_latent, q_scale)
        kv32 = kv.astype(jnp.float32)
        if query_terms == 1:
            scores = (dot("bihd,btd->biht", q_content, kv32)
                      * (q_scale * scale_log2)[..., None] * k_scale[:, None, None, :])
        else:
            rest_content, rest_scale = residual_per_token(q_latent, q_content, q_scale)
            scores = ((dot("bihd,btd->biht", q_content, kv32) * q_scale[..., None]
                       + dot("bihd,btd->biht", rest_content, kv32) * rest_scale[..., None])
                      * scale_log2 * k_scale[:, None, None, :])
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
        p8 = round_to_e4m3(jnp.minimum(pv * _fp8_pv_factor(pv_max), FP8_E4M3_MAX)) * (pv_max / FP8_E4M3_MAX)
        out = dot("biht,btd->bihd", p8.reshape(p.shape), kv32)
    else:
        out = dot("biht,btd->bihd", p.astype(jnp.bfloat16), kv)
    seen = l > 0
    out = out / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)
    return out.astype(q_latent.dtype), lse
