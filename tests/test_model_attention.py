"""The full (prefill/training) attention form: query blocks give the same result as one block."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models.attention
from models import MLAConfig, MLAModel


def _tiny_config():
    return MLAConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=None)


def test_query_blocks_match_one_block_including_a_ragged_last_block(monkeypatch):
    model = MLAModel(_tiny_config(), rngs=nnx.Rngs(3), dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(4), (2, 11), 0, 64)
    whole = model(ids)
    monkeypatch.setattr(models.attention, "QUERY_CHUNK", 4)  # 11 queries: blocks of 4, 4, 3 (+1 padding)
    blocked = model(ids)
    # Same float32 operations per row; only XLA's fusion of the blocks may differ.
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(whole[:, -1]), np.asarray(whole[:, 0]))  # the rows do differ
