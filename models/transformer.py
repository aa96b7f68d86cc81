"""The DeepSeek-family MLA decoder: layers, model, LM head, and its three
entry points (full forward for training, prefill and decode over the paged
latent cache).

Every layer is pre-norm: ``x += attn(norm(x)); x += ffn(norm(x))``, where the
feed-forward is a dense SwiGLU MLP for the first ``first_k_dense_replace``
layers and a mixture of experts after (``MLAConfig.is_moe_layer``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax.cache import LatentCache
from snapmla_jax.fp8_weights import BlockFP8Weight
from snapmla_jax.models.attention import MLAAttention
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.layers import MLP, RMSNorm, linear
from snapmla_jax.models.moe import MoE
from snapmla_jax.write import write_kv


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer: x [B, S, hidden] -> same shape and dtype."""

    def __init__(self, cfg: MLAConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(cfg, dtype=dtype, rngs=rngs) if cfg.is_moe_layer(layer)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs))

    def feed_forward(self, x: jax.Array, backend: str = "xla") -> jax.Array:
        """x + the feed-forward of x; ``backend`` reaches the MoE's dispatches (``MoE.__call__``) and the
        FP8 gate and up launch of an MLP (``MLP.__call__``)."""
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h, backend=backend)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.feed_forward(x + self.self_attn(self.input_layernorm(x), positions))

    def prefill(self, x, positions, cache, slots, *, backend: str):
        """Full attention over the prompt, writing its latents into ``cache`` at ``slots`` [B*S]."""
        attn, c_kv, k_pe = self.self_attn.full_attention(self.input_layernorm(x), positions, backend)
        cache = write_kv(cache, c_kv.reshape(-1, c_kv.shape[-1]), k_pe.reshape(-1, k_pe.shape[-1]), slots,
                         backend=backend)
        return self.feed_forward(x + attn, backend), cache

    def decode(self, x, positions, cache, block_table, seq_lens, slots, *, backend: str, kv_transform=None,
               q_transform=None, query_terms: int = 1, qk_promotion: int | None = None):
        """Absorbed-form step; returns (x, cache, latent attention output [B, s_q, H, R])."""
        attn, cache, latent_out = self.self_attn.absorbed_decode(
            self.input_layernorm(x), positions, cache, block_table, seq_lens, slots, backend=backend,
            kv_transform=kv_transform, q_transform=q_transform, query_terms=query_terms, qk_promotion=qk_promotion)
        return self.feed_forward(x + attn, backend), cache, latent_out


def slot_mapping(block_table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int) -> jax.Array:
    """Cache slot of each token: ``block_table[b, pos // page_size] * page_size + pos % page_size``.

    block_table [B, max_pages] int32, positions [B, S] int32, valid [B, S] bool
    -> [B * S] int32, with -1 (write nothing) for invalid tokens, negative
    positions and positions past the block table's capacity.
    """
    page_index = positions // page_size
    usable = valid & (positions >= 0) & (page_index < block_table.shape[1])
    page = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, block_table.shape[1] - 1), axis=1)
    slots = jnp.where(usable, page * page_size + positions % page_size, -1)
    return slots.reshape(-1).astype(jnp.int32)


def _check_int_array(name: str, value, ndim: int, shape_hint: str) -> None:
    if not hasattr(value, "ndim") or value.ndim != ndim or not jnp.issubdtype(value.dtype, jnp.integer):
        got = f"{value.dtype}{list(value.shape)}" if hasattr(value, "ndim") else type(value).__name__
        raise ValueError(f"{name}: expected an integer array of shape {shape_hint}, got {got}")


class MLAModel(nnx.Module):
    """DeepSeek-V2/V3-style causal LM.

    ``MLAModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)`` creates randomly
    initialized parameters stored and computed in ``dtype`` (norm statistics,
    router logits, attention softmax and the logits stay float32).
    """

    def __init__(self, cfg: MLAConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        if not isinstance(cfg, MLAConfig):
            raise ValueError(f"cfg: expected an MLAConfig, got {type(cfg).__name__}")
        if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    # ---- shared pieces ----
    def _embed(self, input_ids: jax.Array) -> jax.Array:
        _check_int_array("input_ids", input_ids, 2, "[B, S]")
        return self.embed_tokens(input_ids)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head: hidden [B, S, hidden] -> logits [B, S, vocab] float32 (float32 accumulation)."""
        hidden = self.norm(hidden)
        if self.lm_head is None:
            return jnp.einsum("bsd,vd->bsv", hidden, self.embed_tokens.embedding[...], preferred_element_type=jnp.float32)
        return jnp.einsum("bsd,dv->bsv", hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)

    # ---- training / reference path ----
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Full causal forward: input_ids [B, S] int -> logits [B, S, vocab] float32 (positions 0..S-1)."""
        x = self._embed(input_ids)
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
        for layer in self.layers:
            x = layer(x, positions)
        return self.logits(x)

    # ---- serving path ----
    def init_cache(self, num_pages: int, page_size: int = 64, kv_cache: str = "fp8") -> tuple:
        """One empty ``LatentCache`` per layer (no layer axis, so each array stays
        under 2**31 elements for large batches): kv_cache "fp8" or "bf16"."""
        return tuple(LatentCache.create(num_pages, page_size, kv_lora_rank=self.cfg.kv_lora_rank,
                                        rope_dim=self.cfg.qk_rope_head_dim, dtype=kv_cache)
                     for _ in range(self.cfg.num_hidden_layers))

    def _check_serving_args(self, input_ids, caches, block_table, lens_name: str, lens) -> None:
        """ValueError naming the argument unless block_table, caches and the per-row
        length vector ``lens`` (called ``lens_name``) fit ``input_ids``' batch."""
        batch = input_ids.shape[0]
        _check_int_array(lens_name, lens, 1, f"[{batch}]")
        if lens.shape[0] != batch:
            raise ValueError(f"{lens_name}: expected shape [{batch}], got {list(lens.shape)}")
        _check_int_array("block_table", block_table, 2, "[B, max_pages]")
        if block_table.shape[0] != input_ids.shape[0]:
            raise ValueError(f"block_table: expected {input_ids.shape[0]} rows (one per input row), "
                             f"got {block_table.shape[0]}")
        if not isinstance(caches, (tuple, list)) or len(caches) != self.cfg.num_hidden_layers:
            got = len(caches) if isinstance(caches, (tuple, list)) else type(caches).__name__
            raise ValueError(f"caches: expected a tuple of {self.cfg.num_hidden_layers} per-layer LatentCache "
                             f"(model.init_cache), got {got}")

    def prefill(self, input_ids: jax.Array, lengths: jax.Array, caches: tuple, block_table: jax.Array, *,
                backend: str = "auto", last_only: bool = False) -> tuple[jax.Array, tuple]:
        """Run right-padded prompts with full causal attention and fill the cache.

        input_ids [B, S] int32; lengths [B] int32 (tokens of row b at positions
        >= lengths[b] are padding: not written, their logits undefined);
        caches from ``init_cache``; block_table [B, max_pages] int32.
        Token ``pos`` of row b goes to slot ``block_table[b, pos // page_size]
        * page_size + pos % page_size``. Returns (logits [B, S, vocab] float32,
        updated caches); with ``last_only=True`` the logits are those of each
        row's last prompt token only, [B, vocab] (the LM head then runs on B
        rows, not B x S: the full logits of a long prompt are gigabytes).
        Jittable; donate ``caches`` to update in place.
        """
        x = self._embed(input_ids)
        self._check_serving_args(input_ids, caches, block_table, "lengths", lengths)
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
        slots = slot_mapping(block_table, positions, positions < lengths[:, None], caches[0].page_size)
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer.prefill(x, positions, cache, slots, backend=backend)
            new_caches.append(cache)
        if last_only:
            last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None].astype(jnp.int32), axis=1)
            return self.logits(last)[:, 0], tuple(new_caches)
        return self.logits(x), tuple(new_caches)

    def decode(self, input_ids: jax.Array, caches: tuple, block_table: jax.Array, seq_lens: jax.Array, *,
               backend: str = "auto", return_attn: bool = False, kv_transform=None, q_transform=None,
               query_terms: int = 1, qk_promotion: int | None = None):
        """One absorbed-form decode step of s_q new tokens per row.

        input_ids [B, s_q] int32; caches from ``init_cache``/``prefill``;
        block_table [B, max_pages] int32; seq_lens [B] int32 counts cached
        tokens INCLUDING these s_q (new token i sits at position
        seq_len - s_q + i and sees positions <= its own). The new tokens are
        written with ``write_kv``, then ``mla_decode`` attends.
        Returns (logits [B, s_q, vocab] float32, updated caches), plus with
        ``return_attn=True`` a tuple of each layer's latent attention output
        [B, s_q, H, kv_lora_rank] (the ``mla_decode`` result, before W_UV).
        ``kv_transform``, when given, maps every layer's new (c_kv [B, s_q, R],
        k_pe [B, s_q, Dr]) to arrays of the same shapes before they are written:
        a fake quantization in a bf16 cache emulates other cache formats
        (``snapmla_jax.fidelity_long.CACHE_SCHEMES``). ``q_transform`` likewise maps every
        layer's latent query [B, s_q, H, R] before it attends (the result is cast back to the
        query's dtype): a fake quantization emulates the FP8 kernels' query rounding. Under jit
        both must be static. ``query_terms``: the FP8 query's terms over an fp8 cache, and
        ``qk_promotion``: the features a float32 sum of its FP8 Q.K products covers
        (``mla_decode``'s; static under jit).
        Jittable; donate ``caches`` to update in place.
        """
        x = self._embed(input_ids)
        self._check_serving_args(input_ids, caches, block_table, "seq_lens", seq_lens)
        s_q = input_ids.shape[1]
        positions = (seq_lens[:, None] - s_q + jnp.arange(s_q, dtype=jnp.int32)).astype(jnp.int32)
        slots = slot_mapping(block_table, positions, positions >= 0, caches[0].page_size)
        seq_lens = seq_lens.astype(jnp.int32)
        new_caches, attn_outs = [], []
        for layer, cache in zip(self.layers, caches):
            x, cache, latent_out = layer.decode(x, positions, cache, block_table, seq_lens, slots, backend=backend,
                                                kv_transform=kv_transform, q_transform=q_transform,
                                                query_terms=query_terms, qk_promotion=qk_promotion)
            new_caches.append(cache)
            attn_outs.append(latent_out)
        logits = self.logits(x)
        if return_attn:
            return logits, tuple(new_caches), tuple(attn_outs)
        return logits, tuple(new_caches)


def param_count(model: MLAModel) -> int:
    """Number of parameters (``nnx.Param`` elements) in ``model``; a block-FP8 kernel counts its
    [out, in] elements, not its scales."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, BlockFP8Weight))
    return int(sum(np.prod(p.shape) for p in leaves))


def param_bytes(model: MLAModel) -> int:
    """Bytes of every array in ``model``'s state (parameters, FP8 scales and the router's bias):
    its weights' memory footprint."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model))))
