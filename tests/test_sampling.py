"""Sampling: greedy, temperature, top-k, top-p, each with an explicit key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.sampling import SamplingConfig, sample, truncate


def _random_logits(seed: int, batch: int = 5, vocab: int = 37) -> jax.Array:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, vocab)) * 3
    logits[:, rng.integers(vocab)] += 8  # an outlier token, as trained models have
    return jnp.asarray(logits, jnp.float32)


def test_greedy_is_argmax_and_ignores_key():
    logits = _random_logits(0)
    config = SamplingConfig()
    expected = np.argmax(np.asarray(logits, np.float64), axis=-1)
    for seed in (0, 1):
        np.testing.assert_array_equal(sample(logits, jax.random.key(seed), config), expected)


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = _random_logits(1)
    greedy = sample(logits, jax.random.key(0), SamplingConfig())
    for seed in range(4):
        top1 = sample(logits, jax.random.key(seed), SamplingConfig(temperature=2.0, top_k=1))
        np.testing.assert_array_equal(top1, greedy)


def test_same_key_same_tokens_other_key_other_tokens():
    logits = jnp.zeros((64, 50), jnp.float32)  # uniform: draws depend on the key only
    config = SamplingConfig(temperature=1.0)
    a = sample(logits, jax.random.key(7), config)
    b = sample(logits, jax.random.key(7), config)
    c = sample(logits, jax.random.key(8), config)
    np.testing.assert_array_equal(a, b)
    # 64 uniform draws over 50 tokens agreeing everywhere by chance: 50**-64.
    assert (np.asarray(a) != np.asarray(c)).any()


def test_top_p_keeps_smallest_set_reaching_p_on_known_distribution():
    probs = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = jnp.asarray(np.log(probs)[None, :], jnp.float32)
    # Mass before each sorted candidate: 0, 0.5, 0.8, 0.95. Thresholds sit
    # >= 0.05 away from those sums, far beyond float32 rounding (~1e-7).
    for top_p, kept in ((0.3, {1}), (0.6, {1, 3}), (0.9, {1, 3, 2}), (1.0, {0, 1, 2, 3})):
        values, ids = truncate(logits, top_p=top_p)
        got = {int(i) for i, v in zip(ids[0], values[0]) if np.isfinite(v)}
        assert got == kept, (top_p, got)


def test_top_k_keeps_the_k_largest():
    logits = _random_logits(2)
    values, ids = truncate(logits, top_k=4)
    expected = np.argsort(-np.asarray(logits), axis=-1)[:, :4]
    np.testing.assert_array_equal(np.sort(ids, axis=-1), np.sort(expected, axis=-1))
    assert np.isfinite(values).all()


def test_top_p_draws_follow_the_renormalised_distribution():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = jnp.asarray(np.tile(np.log(probs), (20000, 1)), jnp.float32)
    draws = np.asarray(sample(logits, jax.random.key(3), SamplingConfig(temperature=1.0, top_p=0.6)))
    assert set(np.unique(draws)) <= {1, 3}
    # Kept {1: 0.5, 3: 0.3} -> P(1) = 0.625. 20000 draws: std 0.0034; 5 std = 0.017.
    assert abs(np.mean(draws == 1) - 0.625) < 0.017


def test_temperature_sharpens_and_flattens():
    probs = np.array([0.6, 0.3, 0.1])
    logits = jnp.asarray(np.tile(np.log(probs), (20000, 1)), jnp.float32)
    for temperature in (0.5, 2.0):
        draws = np.asarray(sample(logits, jax.random.key(4), SamplingConfig(temperature=temperature)))
        tempered = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
        # 20000 draws: std <= 0.0036 per frequency; 5 std = 0.018.
        np.testing.assert_allclose(np.bincount(draws, minlength=3) / draws.size, tempered, atol=0.018)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -2), ("top_k", 1.5),
                                         ("top_p", 0.0), ("top_p", 1.5)])
def test_bad_settings_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})


def test_logits_must_be_two_dimensional():
    with pytest.raises(ValueError, match="logits"):
        sample(jnp.zeros((3,)), jax.random.key(0), SamplingConfig())
