"""``write_kv``: put new tokens' latent and RoPE key into the paged cache,
quantizing the latent to per-token FP8 on the way for an fp8 cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax.pallas_kernels.write_kv import kernel_takes, write_kv_pallas, write_kv_reference
from snapmla_jax.backend import resolve_backend
from snapmla_jax.cache import LatentCache, check_kernel_addressable, check_layer


def _flat_arrays(cache: LatentCache) -> tuple:
    """The cache's arrays viewed as [rows, ...] (a free reshape under jit)."""
    rows = cache.latent.shape[:-1]
    n = int(np.prod(rows))
    arrays = [cache.latent.reshape(n, cache.kv_lora_rank)]
    if cache.scale is not None:
        arrays.append(cache.scale.reshape(n))
    arrays.append(cache.rope.reshape(n, cache.rope_dim))
    return tuple(arrays)


def _unflatten(cache: LatentCache, arrays: tuple) -> LatentCache:
    latent = arrays[0].reshape(cache.latent.shape)
    rope = arrays[-1].reshape(cache.rope.shape)
    scale = arrays[1].reshape(cache.scale.shape) if cache.scale is not None else None
    return LatentCache(latent=latent, scale=scale, rope=rope)


def _validate(cache: LatentCache, latent, k_rope, slot_mapping, layer) -> None:
    if not isinstance(cache, LatentCache):
        raise ValueError(f"cache: expected a LatentCache, got {type(cache).__name__}")
    if latent.ndim != 2 or latent.shape[1] != cache.kv_lora_rank:
        raise ValueError(f"latent: expected shape [T, {cache.kv_lora_rank}], got {list(latent.shape)}")
    if k_rope.ndim != 2 or k_rope.shape[1] != cache.rope_dim:
        raise ValueError(f"k_rope: expected shape [T, {cache.rope_dim}], got {list(k_rope.shape)}")
    if k_rope.shape[0] != latent.shape[0]:
        raise ValueError(f"k_rope: expected {latent.shape[0]} tokens like latent, got {k_rope.shape[0]}")
    for name, arr in (("latent", latent), ("k_rope", k_rope)):
        if not jnp.issubdtype(arr.dtype, jnp.floating) or jnp.dtype(arr.dtype).itemsize < 2:
            raise ValueError(f"{name}: expected a bfloat16/float16/float32 array, got {arr.dtype}")
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != latent.shape[0]:
        raise ValueError(f"slot_mapping: expected shape [{latent.shape[0]}], got {list(slot_mapping.shape)}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping: expected integer slot ids (int32; other integer types are converted), "
                         f"got {slot_mapping.dtype}")
    check_layer(cache, layer)
    if not isinstance(slot_mapping, jax.core.Tracer):
        slots = np.asarray(slot_mapping)  # in its own dtype: an int64 id past int32 is caught, not wrapped
        bad = (slots < -1) | (slots >= cache.num_slots)
        if bad.any():
            raise ValueError(
                f"slot_mapping: expected slots in [-1, {cache.num_slots}) (-1 = padding), "
                f"got {int(slots[bad][0])} at index {int(np.flatnonzero(bad)[0])}")


def _int32_slots(slot_mapping, num_slots: int) -> jax.Array:
    """slot_mapping (any integer dtype) as int32, an id outside [-1, num_slots) becoming -1
    before the cast (a traced int64 id past int32 must not wrap into a valid slot)."""
    if slot_mapping.dtype == jnp.int32:
        return jnp.asarray(slot_mapping)
    if not isinstance(slot_mapping, jax.core.Tracer):  # numpy int64 (np.arange), validated above
        return jnp.asarray(np.asarray(slot_mapping).astype(np.int32))
    inside = (slot_mapping >= -1) & (slot_mapping < num_slots)
    return jnp.where(inside, slot_mapping, -1).astype(jnp.int32)


def write_kv(cache: LatentCache, latent: jax.Array, k_rope: jax.Array, slot_mapping: jax.Array, *,
             layer: int | jax.Array | None = None, backend: str = "auto") -> LatentCache:
    """Write T new tokens into ``cache`` and return the updated cache.

    Args:
      cache: a LatentCache (fp8 or bf16, with or without a layer axis).
      latent: [T, kv_lora_rank] bfloat16/float16/float32, the tokens' compressed KV.
      k_rope: [T, rope_dim] bfloat16/float16/float32, the already-rotated RoPE keys.
      slot_mapping: [T] int32, slot = page * page_size + offset per token; -1 marks
        a padding token, for which nothing is written. Other integer dtypes (int64 from
        ``np.arange``, uint8, ...) are converted; floats are refused.
      layer: None for a cache without layer axis; else the layer (int or traced
        int32 scalar) to write.
      backend: "auto" | "pallas" | "interpret" | "xla" (see snapmla_jax.backend). The
        kernel takes kv_lora_rank and rope_dim multiples of 64; other widths run the XLA
        scatter under every backend (the same bytes).

    An fp8 cache receives the e4m3 latent with one float32 scale per token
    (``max(amax, 1e-30) * float32(1 / 448)``, saturating: never inf/NaN for finite input) and
    the RoPE key in bf16; a bf16 cache receives both in bf16. Slots not named are
    untouched. Two tokens naming the same slot leave it unspecified (bytes of either).
    Under ``jax.jit`` with the cache donated the write is in place; an eager call
    copies the cache once.

    Raises ValueError naming the argument for wrong shapes/dtypes (a non-integer
    slot_mapping), a layer out of range, or (when slot_mapping is concrete) a slot outside
    [-1, num_slots).
    Under jit, a slot or traced layer out of range writes nothing (never out of
    bounds).
    """
    _validate(cache, latent, k_rope, slot_mapping, layer)
    backend = resolve_backend(backend)
    if backend != "xla":
        check_kernel_addressable(cache)  # token rows: the write kernel is Mosaic GPU (TMA row coordinates)
    if backend == "xla" or not kernel_takes(cache.kv_lora_rank, cache.rope_dim):
        scatter = write_kv_reference
    else:
        scatter = functools.partial(write_kv_pallas, interpret=backend == "interpret")
    return write_rows(cache, latent, k_rope, slot_mapping, layer, scatter)


def write_rows(cache: LatentCache, latent: jax.Array, k_rope: jax.Array, slot_mapping, layer, scatter) -> LatentCache:
    """``write_kv`` after validation, with the scatter given: ``scatter(flat cache arrays, latent,
    k_rope, rows [T] int32)`` -> arrays, rows being flat cache rows (-1: nothing). The benchmark
    passes other kernels through it, so that they run inside the same XLA program as write_kv's."""
    slots = _int32_slots(slot_mapping, cache.num_slots)
    valid = (slots >= 0) & (slots < cache.num_slots)
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
        valid &= (layer >= 0) & (layer < cache.num_layers)
        slots = slots + layer * cache.num_slots
    rows = jnp.where(valid, slots, -1)
    return _unflatten(cache, tuple(scatter(_flat_arrays(cache), latent, k_rope, rows)))
