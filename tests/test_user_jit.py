"""write_kv and mla_decode inside a user's own jax.jit, with the cache donated.

A user decode step (write one token per row, attend over everything cached)
runs for a few steps on a donated cache; every step's output is checked
against float64 attention over the tokens the step has seen.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax import LatentCache, dequantize, write_kv
from snapmla_jax.decode import mla_decode
from snapmla_jax.paging import allocate_pages

RANK, ROPE, HEADS, PAGE = 512, 64, 4, 16
SCALE = 1 / np.sqrt(128 + 64)  # DeepSeek's softmax scale for qk_nope 128 + rope 64


def _slots(block_table: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return (block_table[np.arange(len(positions)), positions // PAGE] * PAGE + positions % PAGE).astype(np.int32)


def _attention_f64(q_latent, q_rope, latent, rope, length):
    """float64 softmax attention of one row's queries [H, R]/[H, Dr] over ``length`` tokens."""
    scores = (q_latent @ latent[:length].T + q_rope @ rope[:length].T) * SCALE
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ latent[:length]


def _queries(rng, batch):
    """q_latent [B, 1, H, R], q_rope [B, 1, H, Dr] scaled so that scores spread over
    a few units, as in a trained model: the RoPE keys' outliers (x20) meet small
    RoPE queries. (Much larger scores make softmax near one-hot, where any
    rounding of a score moves the output by about that rounding times the score.)"""
    return rng.standard_normal((batch, 1, HEADS, RANK)) * 0.3, rng.standard_normal((batch, 1, HEADS, ROPE)) * 0.05


@functools.partial(jax.jit, donate_argnums=0, static_argnames="layer")
def user_step(cache, latent, k_rope, slots, q_latent, q_rope, block_table, seq_lens, *, layer=None):
    cache = write_kv(cache, latent, k_rope, slots, layer=layer, backend="xla")
    out = mla_decode(q_latent, q_rope, cache, block_table, seq_lens, softmax_scale=float(SCALE), layer=layer,
                     backend="xla")
    return cache, out


@pytest.mark.parametrize("dtype,max_rms", [
    # Q, P and the cache rounded to bf16 (2**-9 relative each): measured <= 0.004.
    ("bf16", 2.0**-7),
    # e4m3 latent, Q and P' (values 2**-3 apart relative, rms rounding
    # 2**-3 / sqrt(12) = 0.036 per element); measured up to 0.058 where a few
    # tokens carry the weight. A wrong scale or slot gives ~1.
    ("fp8", 2.0**-3),
])
def test_user_jit_decode_steps_on_a_donated_cache(dtype, max_rms):
    rng = np.random.default_rng(0)
    prompt_lengths, steps = np.array([5, 40, 17]), 3
    batch = len(prompt_lengths)
    pages = allocate_pages(prompt_lengths, steps, page_size=PAGE)
    block_table = jnp.asarray(pages.block_table)
    total = int(prompt_lengths.max()) + steps
    # Per row, the latent and RoPE key of every position it will hold; outliers in RoPE.
    latents = rng.standard_normal((batch, total, RANK)) * rng.uniform(0.2, 3.0, (batch, total, 1))
    ropes = rng.standard_normal((batch, total, ROPE)) * 20

    cache = LatentCache.create(pages.num_pages, PAGE, dtype=dtype)
    # Prompts first (a user prefill): every prompt token, written outside the loop.
    prompt_slots = np.concatenate([_slots(pages.block_table[[b] * n], np.arange(n))
                                   for b, n in enumerate(prompt_lengths)])
    cache = write_kv(cache, jnp.asarray(np.concatenate([latents[b, :n] for b, n in enumerate(prompt_lengths)]),
                                        jnp.float32),
                     jnp.asarray(np.concatenate([ropes[b, :n] for b, n in enumerate(prompt_lengths)]), jnp.float32),
                     jnp.asarray(prompt_slots), backend="xla")

    for step in range(steps):
        positions = prompt_lengths + step
        q_latent, q_rope = _queries(rng, batch)
        new_latent = latents[np.arange(batch), positions]
        new_rope = ropes[np.arange(batch), positions]
        previous = cache
        cache, out = user_step(cache, jnp.asarray(new_latent, jnp.float32), jnp.asarray(new_rope, jnp.float32),
                               jnp.asarray(_slots(pages.block_table, positions)), jnp.asarray(q_latent, jnp.float32),
                               jnp.asarray(q_rope, jnp.float32), block_table, jnp.asarray(positions + 1, jnp.int32))
        # Donated: the input buffers were handed over to the output (updated in place).
        assert previous.latent.is_deleted() and previous.rope.is_deleted()
        out = np.asarray(out, np.float64)
        for b in range(batch):
            length = positions[b] + 1
            expected = _attention_f64(q_latent[b, 0], q_rope[b, 0], latents[b], ropes[b], length)
            rms = np.sqrt(np.mean((out[b, 0] - expected) ** 2)) / np.sqrt(np.mean(expected ** 2))
            assert rms <= max_rms, (step, b, rms)


def test_user_jit_traced_layer_of_a_layered_cache():
    # The layer index is a traced scalar inside the user's fori_loop over layers.
    rng = np.random.default_rng(1)
    layers, lengths = 3, np.array([9, 30])
    pages = allocate_pages(lengths, 0, page_size=PAGE)
    latent = rng.standard_normal((layers, int(lengths.sum()), RANK))
    rope = rng.standard_normal((layers, int(lengths.sum()), ROPE)) * 20
    slots = np.concatenate([_slots(pages.block_table[[b] * n], np.arange(n)) for b, n in enumerate(lengths)])
    q_latent, q_rope = _queries(rng, 2)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill_and_decode(cache, latent, rope, slots, q_latent, q_rope, block_table, seq_lens):
        def body(layer, carry):
            cache, outs = carry
            cache = write_kv(cache, latent[layer], rope[layer], slots, layer=layer, backend="xla")
            out = mla_decode(q_latent, q_rope, cache, block_table, seq_lens, softmax_scale=float(SCALE),
                             layer=layer, backend="xla")
            return cache, outs.at[layer].set(out)

        outs = jnp.zeros((layers, *q_latent.shape), q_latent.dtype)
        return jax.lax.fori_loop(0, layers, body, (cache, outs))

    cache = LatentCache.create(pages.num_pages, PAGE, dtype="bf16", num_layers=layers)
    cache, outs = fill_and_decode(cache, jnp.asarray(latent, jnp.float32), jnp.asarray(rope, jnp.float32),
                                  jnp.asarray(slots), jnp.asarray(q_latent, jnp.float32),
                                  jnp.asarray(q_rope, jnp.float32), jnp.asarray(pages.block_table),
                                  jnp.asarray(lengths, jnp.int32))
    stored, _ = dequantize(cache)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for layer in range(layers):
        np.testing.assert_allclose(stored.reshape(layers, -1, RANK)[layer, slots], latent[layer], rtol=2**-8)
        for b, (start, n) in enumerate(zip(starts, lengths)):
            expected = _attention_f64(q_latent[b, 0], q_rope[b, 0], latent[layer, start:start + n],
                                      rope[layer, start:start + n], n)
            got = np.asarray(outs[layer, b, 0], np.float64)
            # bf16 cache, Q and P (2**-9 relative each): 2**-7 rms leaves 4x room.
            assert np.sqrt(np.mean((got - expected) ** 2)) <= 2**-7 * np.sqrt(np.mean(expected ** 2))
