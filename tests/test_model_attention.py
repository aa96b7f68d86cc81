"""The full (prefill/training) attention form: query blocks give the same result as one block,
and their size keeps the compiled program's memory bounded."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import snapmla_jax.models.attention

from snapmla_jax import models
from snapmla_jax.models import MLAConfig, MLAModel


def _tiny_config():
    return MLAConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=None)


def test_query_blocks_match_one_block_including_a_ragged_last_block(monkeypatch):
    model = MLAModel(_tiny_config(), rngs=nnx.Rngs(3), dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(4), (2, 11), 0, 64)
    whole = model(ids)
    monkeypatch.setattr(models.attention, "MAX_QUERY_CHUNK", 4)  # 11 queries: blocks of 4, 4, 3 (+1 padding)
    blocked = model(ids)
    # Same float32 operations per row; only XLA's fusion of the blocks may differ.
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(whole[:, -1]), np.asarray(whole[:, 0]))  # the rows do differ


def test_query_chunk_is_the_largest_power_of_two_whose_scores_fit(monkeypatch):
    monkeypatch.setattr(models.attention, "SCORE_BLOCK_BYTES", 1 << 20)
    chunk = models.attention.query_chunk
    assert chunk(1, 2, 64) == 1024  # 8 KiB of scores a query: capped at MAX_QUERY_CHUNK
    assert chunk(1, 16, 4096) == 4  # 256 KiB a query: 4 fit in 1 MiB
    assert chunk(3, 16, 4096) == 1  # 768 KiB a query: one fits, two do not
    assert chunk(8, 16, 4096) == 1  # not even one fits: one query at a time
    for batch, heads, seq in ((1, 16, 4096), (2, 8, 3000), (5, 7, 999)):  # 1 to 7 queries fit
        c = chunk(batch, heads, seq)
        assert c & (c - 1) == 0 and batch * heads * c * seq * 4 <= 1 << 20 < batch * heads * 2 * c * seq * 4


def _attention_temp_bytes(heads: int, seq: int) -> int:
    """Bytes of temporaries XLA's compiled full attention holds for one [1, seq] prompt."""
    cfg = MLAConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=heads, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    attn = nnx.eval_shape(lambda: models.attention.MLAAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(attn)
    fn = jax.jit(lambda state, x, pos: nnx.merge(graphdef, state).full_attention(x, pos)[0])
    compiled = fn.lower(state, jax.ShapeDtypeStruct((1, seq, 32), jnp.float32),
                        jax.ShapeDtypeStruct((1, seq), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_query_blocks_bound_the_compiled_attention_memory(monkeypatch):
    heads, seq = 16, 4096
    budget = 4 << 20
    monkeypatch.setattr(models.attention, "SCORE_BLOCK_BYTES", 1 << 40)
    unbounded = _attention_temp_bytes(heads, seq)  # 1024-query blocks: 256 MiB of scores each
    monkeypatch.setattr(models.attention, "SCORE_BLOCK_BYTES", budget)
    bounded = _attention_temp_bytes(heads, seq)  # 16-query blocks
    # A block's scores, their exponentials and the weights live together (~3 budgets); the
    # per-head keys and values (2 x 2 MiB here) and the output come on top. Measured: 24 MiB
    # bounded, 780 MiB with 1024-query blocks.
    assert bounded <= 6 * budget + 8 * seq * heads * 8 * 4, bounded
    assert unbounded >= 2 * heads * 1024 * seq * 4, unbounded  # the control: the knob is what bounds it
