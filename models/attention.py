"""Multi-head Latent Attention (MLA) with its two execution forms.

Per token, keys and values come from one shared latent ``c_kv`` [kv_lora_rank]
(after ``kv_a_layernorm``) and one shared RoPE key ``k_pe`` [qk_rope_head_dim]:

    k_nope[h] = c_kv @ W_UK[h]       v[h] = c_kv @ W_UV[h]
    score[h]  = (q_nope[h] . k_nope[h] + q_pe[h] . k_pe) * softmax_scale

``W_UK`` [R, H, qk_nope] and ``W_UV`` [R, H, v_head] are the two halves of
DeepSeek's ``kv_b_proj``, split once at load time. On request they are block-FP8
(``models.layers.quantize_weights(absorbed=True)``): one e4m3 matrix a head, [H, R, qk_nope] and
[H, v_head, R], multiplied per head by ``fp8_grouped_matmul`` (groups = heads).

* Full form (training, prefill): expand keys and values per head and run
  ordinary causal attention; this is what Hugging Face's model computes.
* Absorbed form (decode): fold W_UK into the query,
  ``q_latent[h] = q_nope[h] @ W_UK[h]^T`` [R], attend over the cached latent
  itself (K = [c_kv, k_pe], V = c_kv) with ``snapmla_jax.mla_decode``, and
  apply W_UV to the R-dim output. The cache never holds per-head keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from snapmla_jax.decode import mla_decode
from snapmla_jax.fp8_weights import BlockFP8Weight, dequantize_weight, fp8_grouped_matmul
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.layers import ABSORBED_WEIGHTS, RMSNorm, RotaryEmbedding, linear
from snapmla_jax.write import write_kv

# The full form's attention runs in query blocks whose float32 scores [B, H, C, S] stay
# under SCORE_BLOCK_BYTES: the compiled program holds about three such temporaries (scores,
# their exponentials, the weights in the value dtype). One 16k-token prompt with V3's 128
# heads: 3.5 GiB of temporaries (mostly the per-head keys and values) instead of 26.8 GiB
# with 1024-query blocks (XLA's memory analysis of the compiled attention, on the CPU).
SCORE_BLOCK_BYTES = 256 << 20
MAX_QUERY_CHUNK = 1024  # queries per block at most: beyond it the products gain nothing


def per_head_fp8_product(x: jax.Array, w: BlockFP8Weight, backend: str) -> jax.Array:
    """x [..., H, in] times each head's matrix of the block-FP8 stack w [H, out, in]:
    [..., H, out] float32 (``fp8_grouped_matmul`` with one group of tokens a head: on a Hopper GPU
    or in the interpreter one FP8 GEMM launch, x quantized per row and 128 channels)."""
    heads, width = x.shape[-2:]
    rows = x.reshape(-1, heads, width).swapaxes(0, 1)
    product = fp8_grouped_matmul(rows, w, backend=backend)
    return product.swapaxes(0, 1).reshape(*x.shape[:-1], w.shape[-2])


def query_chunk(batch: int, heads: int, seq: int) -> int:
    """Queries per block of the full form for [batch, seq] tokens and ``heads`` heads: the
    largest power of two <= MAX_QUERY_CHUNK whose float32 scores [batch, heads, C, seq] fit
    SCORE_BLOCK_BYTES, and 1 when not even one query's do (memory then grows as batch x heads
    x seq)."""
    fit = SCORE_BLOCK_BYTES // (batch * heads * seq * 4)
    return 1 if fit < 1 else min(MAX_QUERY_CHUNK, 1 << (fit.bit_length() - 1))


class MLAAttention(nnx.Module):
    """One MLA layer's attention; ``hidden`` = cfg.hidden_size, ``H`` = heads, ``R`` = kv_lora_rank."""

    def __init__(self, cfg: MLAConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        heads, hidden, rank = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = linear(hidden, heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = linear(hidden, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, dtype=dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = linear(hidden, rank + cfg.qk_rope_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(rank, eps=cfg.rms_norm_eps, dtype=dtype)
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
        self.w_uk = nnx.Param(init(rngs.params(), (rank, heads, cfg.qk_nope_head_dim), dtype))
        self.w_uv = nnx.Param(init(rngs.params(), (rank, heads, cfg.v_head_dim), dtype))
        self.o_proj = linear(heads * cfg.v_head_dim, hidden, dtype=dtype, rngs=rngs)
        self.rope = RotaryEmbedding(cfg)

    def queries(self, x: jax.Array, positions: jax.Array, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
        """x [B, S, hidden], positions [B, S] -> (q_nope [B, S, H, qk_nope], rotated q_pe [B, S, H, rope]);
        ``backend`` runs block-FP8 projections (``Linear``)."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x, backend)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, backend)), backend)
        q = q.reshape(*x.shape[:-1], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        return q_nope, self.rope(q_pe, positions[..., None])

    def latents(self, x: jax.Array, positions: jax.Array, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
        """x [B, S, hidden], positions [B, S] -> (c_kv [B, S, R] normalized, rotated k_pe [B, S, rope]):
        exactly what the cache stores per token; ``backend`` as ``queries``'."""
        kv = self.kv_a_proj_with_mqa(x, backend)
        rank = self.cfg.kv_lora_rank
        return self.kv_a_layernorm(kv[..., :rank]), self.rope(kv[..., rank:], positions)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Full causal attention: x [B, S, hidden], positions [B, S] int32 -> [B, S, hidden]."""
        return self.full_attention(x, positions)[0]

    def full_attention(self, x: jax.Array, positions: jax.Array,
                       backend: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
        """Full causal attention over the S tokens of each row (token i sees tokens <= i).

        Returns (out [B, S, hidden], c_kv [B, S, R], k_pe [B, S, rope]); the
        latents are returned so prefill can write them into the cache.
        Scores and softmax run in float32, ``query_chunk`` queries at a time; ``backend`` runs
        block-FP8 projections.
        """
        q_nope, q_pe = self.queries(x, positions, backend)
        c_kv, k_pe = self.latents(x, positions, backend)
        k_nope = jnp.einsum("bkr,rhn->bkhn", c_kv, self.dense_weight("w_uk", c_kv.dtype))
        values = jnp.einsum("bkr,rhv->bkhv", c_kv, self.dense_weight("w_uv", c_kv.dtype))
        batch, seq = x.shape[:2]
        chunk = query_chunk(batch, self.cfg.num_attention_heads, seq)
        # Under a gradient, each block's scores and probabilities [B, H, C, S] are recomputed in the
        # backward pass rather than kept: kept, they are the [B, H, S, S] the blocks avoid (8 GiB in
        # float32 a layer for two 16k-token windows with 4 heads). Without one it changes nothing.
        attend = jax.checkpoint(self._attend)
        if seq <= chunk:
            out = attend(q_nope, q_pe, k_nope, k_pe, values, 0)
        else:
            # Query blocks in sequence: scores [B, H, chunk, S] live one block at a
            # time instead of [B, H, S, S] (4 GiB in float32 for one 8k-token prompt
            # with 16 heads). Rows are independent, so the result is the same as in
            # one block.
            chunks = -(-seq // chunk)
            pad = ((0, 0), (0, chunks * chunk - seq), (0, 0), (0, 0))
            blocked = lambda q: jnp.pad(q, pad).reshape(batch, chunks, chunk, *q.shape[2:]).swapaxes(0, 1)
            out = jax.lax.map(
                lambda args: attend(args[0], args[1], k_nope, k_pe, values, args[2]),
                (blocked(q_nope), blocked(q_pe), jnp.arange(chunks) * chunk))
            out = out.swapaxes(0, 1).reshape(batch, chunks * chunk, *out.shape[3:])[:, :seq]
        return self.o_proj(out.reshape(batch, seq, -1), backend), c_kv, k_pe

    def dense_weight(self, name: str, dtype) -> jax.Array:
        """``w_uk`` or ``w_uv`` as stored [R, H, d], a block-FP8 one dequantized to ``dtype`` (the
        full form expands keys and values per head from it)."""
        weight = getattr(self, name).get_value()
        if not isinstance(weight, BlockFP8Weight):
            return weight
        inverse = tuple(sorted(range(3), key=ABSORBED_WEIGHTS[name].__getitem__))
        return dequantize_weight(weight, dtype).transpose(inverse)

    def _attend(self, q_nope, q_pe, k_nope, k_pe, values, first_query):
        """Causal attention of queries [B, C, H, *] at positions first_query + (0..C-1)
        over all S keys [B, S, ...] -> [B, C, H, v_head] (float32 scores and softmax)."""
        scores = (jnp.einsum("bqhn,bkhn->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32)
                  + jnp.einsum("bqhr,bkr->bhqk", q_pe, k_pe, preferred_element_type=jnp.float32))
        causal = (first_query + jnp.arange(q_nope.shape[1]))[:, None] >= jnp.arange(k_nope.shape[1])[None, :]
        scores = jnp.where(causal, scores * self.cfg.softmax_scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        return jnp.einsum("bhqk,bkhv->bqhv", probs, values)

    def absorbed_decode(self, x: jax.Array, positions: jax.Array, cache, block_table: jax.Array,
                        seq_lens: jax.Array, slots: jax.Array, *, backend: str, kv_transform=None,
                        q_transform=None, query_terms: int = 1, qk_promotion: int | None = None):
        """Decode step in absorbed form over the paged latent cache.

        x [B, s_q, hidden]; positions [B, s_q] int32; cache a single-layer
        ``LatentCache``; block_table [B, max_pages] int32; seq_lens [B] int32
        (cached tokens including these s_q); slots [B * s_q] int32 (-1: skip).
        Writes the new tokens' latents at ``slots`` and attends with
        ``mla_decode``. Returns (out [B, s_q, hidden], new cache,
        latent attention output [B, s_q, H, R] before W_UV). ``kv_transform``
        (see ``MLAModel.decode``) maps (c_kv, k_pe) before they are written,
        ``q_transform`` the latent query before it attends; ``query_terms`` and ``qk_promotion``
        as ``mla_decode``'s.
        """
        cfg = self.cfg
        q_nope, q_pe = self.queries(x, positions, backend)
        w_uk = self.w_uk.get_value()
        if isinstance(w_uk, BlockFP8Weight):
            q_latent = per_head_fp8_product(q_nope, w_uk, backend).astype(q_nope.dtype)
        else:
            q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk)
        if q_transform is not None:
            q_latent = q_transform(q_latent).astype(q_latent.dtype)
        c_kv, k_pe = self.latents(x, positions, backend)
        if kv_transform is not None:
            c_kv, k_pe = kv_transform(c_kv, k_pe)
        cache = write_kv(cache, c_kv.reshape(-1, cfg.kv_lora_rank), k_pe.reshape(-1, cfg.qk_rope_head_dim),
                         slots, backend=backend)
        latent_out = mla_decode(q_latent, q_pe, cache, block_table, seq_lens,
                                softmax_scale=cfg.softmax_scale, backend=backend, query_terms=query_terms,
                                qk_promotion=qk_promotion)
        w_uv = self.w_uv.get_value()
        if isinstance(w_uv, BlockFP8Weight):
            out = per_head_fp8_product(latent_out, w_uv, backend).astype(latent_out.dtype)
        else:
            out = jnp.einsum("bshr,rhv->bshv", latent_out, w_uv)
        return self.o_proj(out.reshape(*x.shape[:-1], -1), backend), cache, latent_out
