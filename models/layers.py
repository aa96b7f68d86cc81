"""Small building blocks of the MLA model: RMSNorm, rotary embeddings (with
YaRN), the SwiGLU MLP, and the bias-free linear layer they all use (with a
plain or a block-FP8 kernel, ``quantize_weights``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax import fp8_weights
from snapmla_jax.backend import resolve_backend
from snapmla_jax.fp8_weights import (DEFAULT_BLOCK, BlockFP8Weight, QuantizedTokens, fp8_grouped_matmul, fp8_matmul,
                                     kernel_runs, quantize_blocks, tiles_run)
from snapmla_jax.models.config import MLAConfig


class Linear(nnx.Linear):
    """``nnx.Linear`` whose kernel may be block-FP8, and that never multiplies a single row of a
    plain kernel.

    The kernel is a plain [in, out] array, or a ``BlockFP8Weight`` (values float8_e4m3fn
    [out, in], float32 block scales; ``quantize_weights``) multiplied by ``fp8_matmul``.

    XLA's GPU compiler rewrites a one-row product (a decode step of one token) into
    an elementwise multiply and a reduce fusion, which at these shapes runs ~3x slower
    than its GEMM on a plain [in, out] kernel (the reduction runs across its rows): in the
    27-layer feed-forward stack of V2-Lite shapes on an H100 the dense and shared-expert MLPs
    took ~1.7 ms at one token against ~0.55 at two, and the stack 3.64 ms against 2.39 with
    this class (scripts/bench_ffn_stack.py --profile). A one-row input of a plain kernel is
    duplicated into two rows and the first row of the product kept. A block-FP8 kernel is
    [out, in], each output a reduction along a contiguous row of e4m3 bytes, and
    ``fp8_matmul`` runs that one-row fusion itself (``fp8_weights.XLA_MAX_ROWS``).

    inputs [..., in_features] -> [..., out_features], as ``nnx.Linear``; ``backend``
    (snapmla_jax.backend) runs a block-FP8 kernel's product (``fp8_matmul``).
    """

    def __call__(self, inputs: jax.Array, backend: str = "auto") -> jax.Array:
        kernel = self.kernel.get_value()
        if math.prod(inputs.shape[:-1]) != 1 or (isinstance(kernel, BlockFP8Weight) and fp8_weights.XLA_MAX_ROWS):
            return self._product(inputs, backend)
        row = inputs.reshape(1, inputs.shape[-1])
        out = self._product(jnp.concatenate([row, row]), backend)[:1]
        return out.reshape(*inputs.shape[:-1], out.shape[-1])

    def _product(self, inputs: jax.Array, backend: str) -> jax.Array:
        kernel = self.kernel.get_value()
        if isinstance(kernel, BlockFP8Weight):
            return fp8_matmul(inputs if self.dtype is None else inputs.astype(self.dtype), kernel, backend=backend)
        return super().__call__(inputs)


def linear(in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs) -> Linear:
    """A bias-free ``Linear`` (kernel [in, out]) computing and storing in ``dtype``.

    DeepSeek's projections carry no bias (``attention_bias``/``mlp_bias`` other
    than false are refused by ``MLAConfig.from_hf``).
    """
    return Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


# The MoE's stacked routed-expert weights [E, in, out] (``models.moe.MoE``), FP8-eligible beside
# the ``Linear`` kernels.
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
# MLA's per-head absorbed weights (``models.attention.MLAAttention``, kv_b_proj split per head):
# name -> the axes that turn the stored [R, H, d] into the FP8 stack [H, out, in] of the absorbed
# products, one matrix a head: w_uk [H, R, qk_nope] (q_latent = q_nope @ W_UK^T: in = qk_nope) and
# w_uv [H, v, R] (out = latent_out @ W_UV: in = R).
ABSORBED_WEIGHTS = {"w_uk": (1, 0, 2), "w_uv": (1, 2, 0)}


def fp8_eligible_weights(model: nnx.Module) -> dict[str, nnx.Variable]:
    """The weights ``quantize_weights`` may convert, by path: every ``Linear`` kernel but the LM
    head's ("layers/0/self_attn/q_a_proj/kernel"; DeepSeek's FP8 releases keep the LM head in
    BF16, as the embedding and the router), each attention's absorbed ``w_uk`` / ``w_uv``
    ("layers/0/self_attn/w_uk"; kv_b_proj in the releases) and the MoE layers' stacked
    routed-expert weights ("layers/1/mlp/w_gate"). Each is a float array ([..., in, out]; [R, H, d]
    for w_uk / w_uv), or already a ``BlockFP8Weight`` [..., out, in] (``fp8_layout``)."""
    found = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path[:1] != ("lm_head",):
            found["/".join(map(str, (*path, "kernel")))] = module.kernel
        # By class name: models.moe and models.attention import this module.
        elif type(module).__name__ == "MoE":
            for name in EXPERT_WEIGHTS:
                found["/".join(map(str, (*path, name)))] = getattr(module, name)
        elif type(module).__name__ == "MLAAttention":
            for name in ABSORBED_WEIGHTS:
                found["/".join(map(str, (*path, name)))] = getattr(module, name)
    return found


def weight_elements(weight) -> int:
    """Elements of a weight: a float array's, or a ``BlockFP8Weight``'s values'."""
    return math.prod((weight.values if isinstance(weight, BlockFP8Weight) else weight).shape)


def is_absorbed_weight(path: str) -> bool:
    """Whether the weight path names an attention's w_uk or w_uv ("layers/0/self_attn/w_uk")."""
    return path.rsplit("/", 1)[-1] in ABSORBED_WEIGHTS


def fp8_layout(path: str, weight):
    """The FP8-eligible float weight at ``path`` (a numpy or jax array in the model's layout)
    as the [..., out, in] matrix or stack its ``BlockFP8Weight`` quantizes: a kernel or expert
    stack [..., in, out] with its last two axes swapped, w_uk / w_uv [R, H, d] as the per-head
    stacks of ``ABSORBED_WEIGHTS``."""
    axes = ABSORBED_WEIGHTS.get(path.rsplit("/", 1)[-1])
    return weight.swapaxes(-1, -2) if axes is None else weight.transpose(axes)


# The fewest elements of a weight (a matrix, or a stack the model multiplies in one launch) from
# which its block-FP8 product beats bf16 in a decode step on an H100: below, the product is the
# cost of its launches (~7-10 us at 576 x 2048 to 3072 x 2048 in either format), and FP8 adds the
# activations' quantization and the partial sums' launches to the bytes it saves. Measured
# (scripts/bench_fp8_gemm.py, 4-64 tokens, FP8 / bf16): 0.65-1.43x at 1.2-6.3M elements (V2-Lite's
# attention projections), 0.73-0.96x at V3's q_a (11M), 0.88-1.13x at 7168 x 2048 (14.7M),
# 1.05-1.17x at 10944 x 2048 (22M), 1.29-1.48x at 24576 x 1536 (38M), 1.61-1.72x at 7168 x 16384.
# End to end (V2-Lite shapes, FP8 cache, 4k, B = 1-64) the step with the weights below it in bf16
# (attention projections, shared experts) took 0.15-0.54 ms less than with them in FP8, and still
# 0.28-0.43 ms less at B = 16-128 once the split count counted its partials (which made 7168 x 2048
# 1.35-1.43x bf16 alone). docs/models.md has the tables.
DECODE_MIN_FP8_ELEMENTS = 1 << 24


def check_min_elements(value, name: str) -> None:
    """ValueError naming the argument ``name`` unless ``value`` is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


def quantize_weights(model: nnx.Module, block: tuple[int, int] = DEFAULT_BLOCK, *,
                     paths=None, absorbed: bool = False, min_elements: int = 0) -> nnx.Module:
    """Convert ``model``'s FP8-eligible weights to ``BlockFP8Weight`` in place; returns ``model``.

    Converted (``fp8_eligible_weights``): the attention projections (q / q_a / q_b,
    kv_a_proj_with_mqa, o_proj), the dense MLPs, the MoE layers' shared experts (every ``Linear``
    but the LM head), the routed experts' stacked weights and, with ``absorbed``, the attention's
    ``w_uk`` / ``w_uv``. Each becomes values [..., out, in] (``fp8_layout``: the checkpoint's
    layout for the kernels and experts, one matrix a head for w_uk / w_uv) with one scale per
    ``block`` of each matrix (``quantize_blocks``). Left in the model's dtype: the embedding, the
    LM head, the norms, the router and, unless ``absorbed``, w_uk / w_uv: their FP8 products
    run 0.41-0.64x XLA's bf16 einsums at V2-Lite's 16 heads and 0.59x at V3's 128 heads and one
    token (1.11-1.17x at 16-64 tokens; H100, scripts/bench_fp8_absorbed.py), for 1-3% of a step's
    weight bytes. ``paths``: a subset of the weight paths to convert (None: all those above);
    ValueError naming a path that is not an eligible weight. ``min_elements``: with ``paths``
    None, weights of fewer elements (a routed-expert or absorbed stack counted whole: one launch
    multiplies it) stay in the model's dtype; ``DECODE_MIN_FP8_ELEMENTS`` keeps those whose FP8
    products are slower than bf16 in a decode step (0: every eligible weight, the bytes' minimum).
    Weights already FP8 are left as they are.
    """
    check_min_elements(min_elements, "min_elements")
    eligible = fp8_eligible_weights(model)
    if paths is None:
        paths = [path for path, weight in eligible.items() if (absorbed or not is_absorbed_weight(path))
                 and weight_elements(weight.get_value()) >= min_elements]
    chosen = set(paths)
    unknown = sorted(set(chosen) - set(eligible))
    if unknown:
        raise ValueError(f"paths: not weights that can be FP8: {unknown[:8]}")
    for path in chosen:
        weight = eligible[path]
        if not isinstance(weight.get_value(), BlockFP8Weight):
            weight.set_value(quantize_blocks(fp8_layout(path, weight.get_value()), block))
    return model


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

    def __call__(self, x, backend: str = "auto") -> jax.Array:
        """``backend`` (snapmla_jax.backend) runs the block-FP8 products: where both gate and up
        kernels are block-FP8, whether they run as one FP8 GEMM launch ("pallas" on Hopper,
        "interpret"); each ``Linear`` on its own otherwise. x may come quantized
        (``fp8_weights.QuantizedTokens`` [..., hidden]) where ``takes_quantized`` says so."""
        backend = resolve_backend(backend)
        gate_up = self._fp8_gate_up(x, backend)
        if gate_up is None:
            if isinstance(x, QuantizedTokens):
                raise ValueError("x: quantized tokens need gate and up on the FP8 GEMM (MLP.takes_quantized)")
            return self.down_proj(jax.nn.silu(self.gate_proj(x, backend)) * self.up_proj(x, backend), backend)
        gate, up = gate_up
        dtype = x.dtype if self.up_proj.dtype is None else self.up_proj.dtype
        return self.down_proj((jax.nn.silu(gate) * up).astype(dtype), backend)

    def takes_quantized(self, x: jax.Array, backend: str) -> bool:
        """Whether this call on x [..., hidden] may be given x quantized as
        ``fp8_weights.quantize_tokens`` quantizes it (rows quantized once for several products, as
        a MoE's routed and shared experts are): gate and up run as one FP8 GEMM launch that would
        quantize x itself to the same bytes (no cast to another dtype first). ``backend`` resolved."""
        dtype = self.gate_proj.dtype
        return (dtype is None or dtype == x.dtype) and self._gate_up_stacks(math.prod(x.shape[:-1]), backend) is not None

    def _gate_up_stacks(self, rows: int, backend: str) -> tuple[BlockFP8Weight, BlockFP8Weight] | None:
        """Gate and up as stacks of one matrix when both kernels are block-FP8 and a kernel runs a
        product of ``rows`` rows with them (``fp8_weights.tiles_run`` or ``kernel_runs``,
        ``backend`` resolved); else None."""
        kernels = [linear.kernel.get_value() for linear in (self.gate_proj, self.up_proj)]
        if not all(isinstance(k, BlockFP8Weight) for k in kernels):
            return None
        stacks = tuple(BlockFP8Weight(k.values[None], k.scales[None], k.block) for k in kernels)
        if not all(tiles_run(stack, rows, backend) or kernel_runs(stack, rows, backend) for stack in stacks):
            return None
        return stacks

    def _fp8_gate_up(self, x, backend: str) -> tuple[jax.Array, jax.Array] | None:
        """gate(x) and up(x) in float32 from one FP8 GEMM launch (x quantized once, or given
        quantized) where ``_gate_up_stacks`` finds them; else None."""
        rows = math.prod(x.shape[:-1])
        stacks = self._gate_up_stacks(rows, backend)
        if stacks is None:
            return None
        if isinstance(x, QuantizedTokens):
            if x.ndim != 2:
                raise ValueError(f"x: quantized tokens come as [M, hidden], got {list(x.shape)}")
            x2 = x.expand_dims()
        else:
            dtype = self.gate_proj.dtype
            x2 = (x if dtype is None else x.astype(dtype)).reshape(1, rows, x.shape[-1])
        gate, up = fp8_grouped_matmul(x2, stacks, backend=backend)
        return gate.reshape(*x.shape[:-1], -1), up.reshape(*x.shape[:-1], -1)


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
