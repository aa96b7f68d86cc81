"""The paged latent KV cache of Multi-head Latent Attention.

Per token MLA caches a latent ``c_kv`` (kv_lora_rank = 512 dims) and an already
rotated RoPE key ``k_pe`` (rope_dim = 64). SnapMLA stores the latent in FP8 with
one float32 scale per token and keeps the RoPE part in BF16: its range is far
wider (outliers around 1e2) and 64 dims cost little. Layout, with an optional
leading layer axis L so that one object can hold every layer:

    fp8 : latent  float8_e4m3fn [L?, num_pages, page_size, kv_lora_rank]
          scale   float32       [L?, num_pages, page_size]
          rope    bfloat16      [L?, num_pages, page_size, rope_dim]
    bf16: latent  bfloat16      [L?, num_pages, page_size, kv_lora_rank]
          scale   None
          rope    bfloat16      [L?, num_pages, page_size, rope_dim]

A token's slot is ``page * page_size + offset``; a request owns the pages listed
in its row of a ``block_table`` [batch, max_pages] int32. The RoPE part is stored
as it is given (not divided by the scale): the decode kernels add the BF16 RoPE
scores to the scaled FP8 content scores in fp32.

``LatentCache`` is a registered pytree (its arrays are leaves), so it passes
through ``jax.jit`` and can be donated to be updated in place.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from snapmla_jax.quantization import FP8_DTYPE, dequantize_per_token

CacheDType = Literal["fp8", "bf16"]
CACHE_DTYPES = ("fp8", "bf16")
# Every kernel names a token row with an int32 (slot ids, a layer's first row, TMA coordinates,
# the scale plane's index): one cache array holds at most this many token slots over its layers.
MAX_TOKEN_SLOTS = 2**31 - 1
INT32_LIMIT = "one cache array holds at most 2**31 - 1 token slots (int32 row indices)"


def kernel_addressable(token_slots: int) -> bool:
    """Whether one cache array of ``token_slots`` token slots (all its layers) is within the
    kernels' int32 token-row indices (``MAX_TOKEN_SLOTS``). The kernels address rows by TMA
    coordinates, not elements: compiled on an H100, decode (FP8 16 and 128 heads, the BF16 twin)
    and write_kv over a latent array of 2.29e9 elements gave the same bits as over a small pool
    (tests/test_large_cache.py, under ``pytest -m gpu``)."""
    return token_slots <= MAX_TOKEN_SLOTS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """Paged MLA latent cache; see the module docstring for shapes and dtypes."""

    latent: jax.Array
    scale: jax.Array | None
    rope: jax.Array

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_size: int = 64,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        dtype: CacheDType = "fp8",
        num_layers: int | None = None,
    ) -> "LatentCache":
        """An empty (zero-filled) cache. ``num_layers=None``: no layer axis.

        Raises ValueError for a non-positive size, an unknown ``dtype``, or a
        cache of more than 2**31 - 1 token slots over its layers (the kernels'
        int32 row indices: hold layers in separate caches instead).
        """
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_layers is not None and (not isinstance(num_layers, int) or num_layers <= 0):
            raise ValueError(f"num_layers: expected None or a positive int, got {num_layers!r}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype: expected one of {CACHE_DTYPES}, got {dtype!r}")
        lead = () if num_layers is None else (num_layers,)
        tokens = (num_layers or 1) * num_pages * page_size
        if not kernel_addressable(tokens):
            raise ValueError(f"num_pages: a cache of {tokens} token slots x {kv_lora_rank} is too large: "
                             f"{INT32_LIMIT}; use one cache per layer or fewer pages")
        pages = (*lead, num_pages, page_size)
        if dtype == "fp8":
            latent = jnp.zeros((*pages, kv_lora_rank), FP8_DTYPE)
            scale = jnp.zeros(pages, jnp.float32)
        else:
            latent = jnp.zeros((*pages, kv_lora_rank), jnp.bfloat16)
            scale = None
        return cls(latent=latent, scale=scale, rope=jnp.zeros((*pages, rope_dim), jnp.bfloat16))

    # ---- shape accounting (all static: derived from array shapes) ----
    @property
    def dtype(self) -> CacheDType:
        return "fp8" if self.scale is not None else "bf16"

    @property
    def num_layers(self) -> int | None:
        return self.latent.shape[0] if self.latent.ndim == 4 else None

    @property
    def num_pages(self) -> int:
        return self.latent.shape[-3]

    @property
    def page_size(self) -> int:
        return self.latent.shape[-2]

    @property
    def kv_lora_rank(self) -> int:
        return self.latent.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.rope.shape[-1]

    @property
    def num_slots(self) -> int:
        """Token slots per layer: num_pages * page_size."""
        return self.num_pages * self.page_size

    @property
    def nbytes_per_token(self) -> int:
        """Bytes one token occupies in one layer: 644 for fp8 (512 + 4 + 128), 1152 for bf16."""
        per = self.kv_lora_rank * self.latent.dtype.itemsize + self.rope_dim * self.rope.dtype.itemsize
        return per + (self.scale.dtype.itemsize if self.scale is not None else 0)

    @property
    def nbytes(self) -> int:
        """Total bytes of the cache's arrays."""
        return sum(int(a.size) * a.dtype.itemsize for a in (self.latent, self.scale, self.rope) if a is not None)

    def layer_arrays(self, layer: int | jax.Array | None) -> "LatentCache":
        """The single-layer view of ``layer`` (a copy under XLA; for references and tools).

        ``layer`` must be None exactly when the cache has no layer axis.
        """
        check_layer(self, layer)
        if layer is None:
            return self
        take = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
        return LatentCache(latent=take(self.latent), scale=take(self.scale), rope=take(self.rope))


def check_layer(cache: LatentCache, layer) -> None:
    """ValueError unless ``layer`` fits the cache: None without a layer axis, else an
    int in range (a traced scalar is accepted; kernels then mask out-of-range layers)."""
    if cache.num_layers is None:
        if layer is not None:
            raise ValueError(f"layer: this cache has no layer axis, expected None, got {layer!r}")
        return
    if layer is None:
        raise ValueError(f"layer: this cache holds {cache.num_layers} layers, expected an int in [0, {cache.num_layers}), got None")
    if isinstance(layer, jax.core.Tracer):
        if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise ValueError(f"layer: expected an integer scalar, got {layer.dtype}{list(layer.shape)}")
        return
    try:
        value = int(layer)
    except TypeError as err:
        raise ValueError(f"layer: expected an int, got {layer!r}") from err
    if not 0 <= value < cache.num_layers:
        raise ValueError(f"layer: expected an int in [0, {cache.num_layers}), got {value}")


def check_kernel_addressable(cache: LatentCache) -> None:
    """ValueError if the kernels cannot address ``cache`` (``kernel_addressable``), rather than an
    out-of-bounds access on the GPU. LatentCache.create refuses too many token slots; this also
    catches caches assembled from arrays."""
    slots = cache.num_slots * (cache.num_layers or 1)
    if not kernel_addressable(slots):
        raise ValueError(f"cache: its latent array {list(cache.latent.shape)} holds {slots} token slots, too many: "
                         f"{INT32_LIMIT}; split it (one cache per layer, fewer pages)")


def dequantize(cache: LatentCache, *, layer: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The cache's contents in float32: (latent [num_pages, page_size, R], rope [num_pages, page_size, Dr]).

    With ``layer=None`` on a layered cache, all layers are returned ([L, ...]).
    Never used on the decode path (the kernels read the FP8 bytes directly).
    """
    if layer is not None:
        cache = cache.layer_arrays(layer)
    if cache.scale is None:
        latent = cache.latent.astype(jnp.float32)
    else:
        latent = dequantize_per_token(cache.latent, cache.scale)
    return latent, cache.rope.astype(jnp.float32)
