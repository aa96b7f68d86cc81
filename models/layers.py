"""Small building blocks of the MLA model: RMSNorm, rotary embeddings (with
YaRN), the SwiGLU MLP, and the bias-free linear layer they all use."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax.models.config import MLAConfig


class Linear(nnx.Linear):
    """``nnx.Linear`` that never multiplies a single row.

    XLA's GPU compiler rewrites a one-row product (a decode step of one token) into
    an elementwise multiply and a reduce fusion, which at these shapes runs ~3x slower
    than its GEMM: in the 27-layer feed-forward stack of V2-Lite shapes on an H100 the
    dense and shared-expert MLPs took ~1.7 ms at one token against ~0.55 at two, and the
    stack 3.64 ms against 2.39 with this class (scripts/bench_ffn_stack.py --profile). A one-row input is
    duplicated into two rows and the first row of the product kept.

    inputs [..., in_features] -> [..., out_features], as ``nnx.Linear``.
    """

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if math.prod(inputs.shape[:-1]) != 1:
            return super().__call__(inputs)
        row = inputs.reshape(1, inputs.shape[-1])
        out = super().__call__(jnp.concatenate([row, row]))[:1]
        return out.reshape(*inputs.shape[:-1], out.shape[-1])


def linear(in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs) -> Linear:
    """A bias-free ``Linear`` (kernel [in, out]) computing and storing in ``dtype``.

    DeepSeek's projections carry no bias (``attention_bias``/``mlp_bias`` other
    than false are refused by ``MLAConfig.from_hf``).
    """
    return Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` over the last axis, the statistics in float32.

    x [..., dim] any float dtype -> same shape and dtype.
    """

    def __init__(self, dim: int, *, eps: float, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward ``down(silu(gate(x)) * up(x))``: x [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = linear(intermediate, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(cfg: MLAConfig) -> np.ndarray:
    """Inverse frequencies [qk_rope_head_dim // 2] float32 of the RoPE part, YaRN-corrected.

    YaRN keeps the high-frequency dimensions (many rotations within the
    original context) as they were, divides the low-frequency ones by
    ``rope_factor``, and ramps linearly between the two. Computed in float64.
    """
    dim = cfg.qk_rope_head_dim
    extrapolated = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if cfg.rope_type != "yarn":
        return extrapolated.astype(np.float32)
    interpolated = extrapolated / cfg.rope_factor

    def dim_of_rotations(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dim_of_rotations(cfg.rope_beta_fast), dim_of_rotations(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: dimension keeps its original frequency
    return (interpolated * ramp + extrapolated * keep).astype(np.float32)


class RotaryEmbedding(nnx.Module):
    """Rotates the RoPE part of queries and keys by their positions.

    ``interleave=True`` rotates adjacent pairs (x0, x1), (x2, x3), ...
    (DeepSeek's layout) and returns them in the same places; False rotates the
    two halves against each other. Both outputs are multiplied by YaRN's
    ``rope_cos_sin_factor``. The layout of the result is what the cache holds,
    so queries and keys must go through the same instance.
    """

    def __init__(self, cfg: MLAConfig):
        self.interleave = cfg.rope_interleave
        self.factor = cfg.rope_cos_sin_factor
        # A tuple, so that it stays static config (not checkpointed state).
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [..., S, (heads,)? dim], positions [..., S] int -> rotated x, same shape and dtype.

        ``positions`` broadcasts against x without its trailing axes: pass
        [B, S] for x [B, S, dim]; for x [B, S, H, dim], pass positions[..., None].
        """
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq, jnp.float32)
        cos, sin = jnp.cos(angles) * self.factor, jnp.sin(angles) * self.factor
        x32 = x.astype(jnp.float32)
        half = x.shape[-1] // 2
        if self.interleave:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
            out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
        else:
            x1, x2 = x32[..., :half], x32[..., half:]
            out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)
