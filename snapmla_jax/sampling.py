"""Choosing the next token from logits: greedy, temperature, top-k and top-p.

Every random draw takes an explicit ``jax.random`` key, so a run is a pure
function of (model, prompts, settings, key) and repeats exactly for a fixed seed.

Order of operations (the usual one): divide by the temperature, keep the
``top_k`` largest logits, then keep the smallest set of those whose
probabilities sum to at least ``top_p`` (always the most likely token), and
draw from what is left, renormalised. ``temperature == 0`` means greedy
(argmax) and ignores top-k/top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings; hashable, so jitted code takes it as a static argument.

    temperature: >= 0; 0 = greedy.   top_k: >= 0; 0 = no top-k cut.
    top_p: in (0, 1]; 1 = no nucleus cut.
    Raises ValueError naming the field for a value outside its range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a float >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def truncate(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The candidates top-k/top-p leave, most likely first.

    logits [B, V] float -> (candidate logits [B, K] float32, token ids [B, K] int32)
    with K = top_k if top_k > 0 else V (all tokens when neither cut is on).
    Candidates removed by top-p get logit -inf. Ties at the k-th logit are
    broken by lower token id (``lax.top_k``'s rule).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits: expected shape [B, V], got {list(logits.shape)}")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if top_k > 0 and top_k < vocab:
        values, ids = jax.lax.top_k(logits, top_k)
    elif top_p < 1:
        ids = jnp.argsort(-logits, axis=-1, stable=True)
        values = jnp.take_along_axis(logits, ids, axis=-1)
    else:
        return logits, jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), logits.shape)
    if top_p < 1:
        probs = jax.nn.softmax(values, axis=-1)
        # Mass strictly before each candidate: a candidate stays while the ones
        # above it hold less than top_p, so the first one always stays.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        values = jnp.where(mass_before < top_p, values, -jnp.inf)
    return values, ids.astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """Next token per row: logits [B, V] float, key a ``jax.random`` key -> [B] int32.

    Greedy ignores the key. Rows draw independently (one categorical draw per row).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits: expected shape [B, V], got {list(logits.shape)}")
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    values, ids = truncate(logits.astype(jnp.float32) / config.temperature, top_k=config.top_k,
                           top_p=config.top_p)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
