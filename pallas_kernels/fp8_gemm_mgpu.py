"""Block-scaled FP8 GEMM for decode-sized token counts on Mosaic GPU (Hopper wgmma + TMA).

DeepSeek's recipe: a weight W [N, K] stored as e4m3 with one float32 scale per 128 x 128 block,
activations x [M, K] quantized per token and 128 channels on the fly, FP8 x FP8 products summed
in float32 per 128-channel block and scaled there:

  y[m, n] = sum_kb  x_scale[m, kb] * w_scale[n // 128, kb] * sum_{k in kb} x8[m, k] * w8[n, k]

For a decode step M is a few tokens and the product reads W once: its time is W's bytes. The
tokens go on the wgmma N dimension and the weight's rows on M, so W is the A operand straight
from its K-major rows and no token padding reaches 64 ("swap AB"). Each CTA computes y^T for
TILE_N = 64 weight rows over one split of K, its weight and token tiles streaming through a TMA
pipeline; the splits' partial sums [splits, N, M] float32 are added by XLA. A CTA keeps two
[64, M] float32 accumulators: the running sum and each 128-channel block's fresh product (the
block's scale is applied before the fresh product joins the sum, so the FP8 accumulator never
carries more than 128 channels: Hopper's FP8 wgmma keeps ~14 bits).

Measured (H100, jax 0.11.2; ``scripts/bench_fp8_gemm.py``, the product chained over weight copies
of >= 384 MiB, round-robin with XLA's bf16 product of the same shape): M = 16 runs 1.64-1.76x the
bf16 GEMM at 24576 x 1536 and 18432 x 7168 / 7168 x 18432 (2.0-2.2 TB/s of weight bytes, 68-77%
of the copy ceiling); M = 64 1.63x at the two 18432 x 7168 shapes, 1.28x at 24576 x 1536. At
10944 x 2048 (V2-Lite's dense MLP) 1.30x / 1.08x, and at 2048 x 7168 and 7168 x 2048 (14 MiB,
DeepSeek-V3's experts) 1.03-1.16x: there the launches around it (the activation quantization
and the partials' sum) take what the bytes save. XLA's product with the weight dequantized in
the program (``fp8_weights.fp8_matmul`` elsewhere) runs 0.38-0.45x the bf16 GEMM. Limits: M = 8
fails the tensor map's alignment on large shapes (tokens are padded to a multiple of
TOKEN_MULTIPLE); M = 256 does not fit the pipeline in shared memory (4 slots of 64 KB token
tiles): MAX_TOKENS.

Arguments of ``fp8_gemm_mgpu`` (``fp8_gemm_reference`` is its float32 twin):

  x8        [M, K] e4m3, M a multiple of TOKEN_MULTIPLE and at most MAX_TOKENS
  x_scales  [K / 128, M] float32 (``fp8_weights.quantize_activations``: the transpose of [M, K / 128])
  w8        [N, K] e4m3, N a multiple of 64, K of 128 * kb_per_step
  w_scales  [ceil(N / 128), K / 128] float32
  -> y [M, N] float32
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.mgpu_bytes import BYTE_TILE_TRANSFORMS

BLOCK = 128  # channels (and weight rows) a scale covers
TILE_N = 64  # weight rows a CTA: one wgmma M
MAX_TOKENS = 64  # tokens (wgmma N) a call takes: the measured range (module docstring)
TOKEN_MULTIPLE = 16  # M = 8 failed the tensor map's alignment on an H100 (module docstring)
COL = plgpu.Layout.WGMMA.reduce(0)  # a vector with one value per accumulator column (token)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """kb_per_step: 128-channel blocks a pipeline step brings (its weight tile is 64 x 128 x this
    bytes); depth: pipeline steps in flight; splits: None picks ``choose_splits``."""
    kb_per_step: int = 2
    depth: int = 4
    splits: int | None = None


def choose_splits(n_tiles: int, steps: int, num_sms: int) -> int:
    """Splits of K (a divisor of ``steps``) that give at least two CTAs an SM where the weight
    rows alone give fewer: a CTA streams its tiles with ``depth`` in flight, and a memory-bound
    product needs every SM streaming."""
    target = 2 * num_sms
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]
    return next((d for d in divisors if n_tiles * d >= target), divisors[-1])


def _kernel(w_gmem, x_gmem, s_gmem, out_gmem, out_s, *, steps: int, config: GemmConfig, tokens: int):
    """One CTA: weight rows [64 n, 64 n + 64) over split s of K (``steps`` pipeline steps)."""
    n, split = lax.axis_index("n"), lax.axis_index("s")
    tk = BLOCK * config.kb_per_step
    k0 = split * steps * tk
    w_rows = w_gmem.at[pl.ds(n * TILE_N, TILE_N), pl.ds(k0, steps * tk)]
    x_cols = x_gmem.at[:, pl.ds(k0, steps * tk)]
    # The combined scales of this tile's 128-row block [K / 128, M], this split's blocks.
    s_rows = s_gmem.at[lax.div(n, BLOCK // TILE_N), pl.ds(split * steps * config.kb_per_step,
                                                          steps * config.kb_per_step)]

    def body(_, w_s, x_s, s_s, total):
        for kb in range(config.kb_per_step):
            def product(acc_ref, kb=kb):
                plgpu.wgmma(acc_ref, w_s.at[:, pl.ds(kb * BLOCK, BLOCK)],
                            x_s.at[:, pl.ds(kb * BLOCK, BLOCK)].transpose((1, 0)))
                return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)

            fresh = pl.run_scoped(product, plgpu.ACC((TILE_N, tokens), jnp.float32))
            scale = lax.broadcast_in_dim(plgpu.load(s_s.at[kb], layout=COL), (TILE_N, tokens), [1])
            total = total + fresh * scale
        return total

    zeros = plgpu.layout_cast(jnp.zeros((TILE_N, tokens), jnp.float32), plgpu.Layout.WGMMA)
    pipeline = plgpu.emit_pipeline(
        body, grid=(steps,), max_concurrent_steps=min(config.depth, steps), init_carry=zeros,
        in_specs=[plgpu.BlockSpec((TILE_N, tk), lambda k: (0, k), transforms=BYTE_TILE_TRANSFORMS),
                  plgpu.BlockSpec((tokens, tk), lambda k: (0, k), transforms=BYTE_TILE_TRANSFORMS),
                  plgpu.BlockSpec((config.kb_per_step, tokens), lambda k: (k, 0))])
    total = pipeline(w_rows, x_cols, s_rows)
    out_s[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_gmem.at[split, pl.ds(n * TILE_N, TILE_N)])
    plgpu.wait_smem_to_gmem(0)


def kernel_takes(m: int, n: int, k: int, config: GemmConfig = GemmConfig()) -> bool:
    """Whether ``fp8_gemm_mgpu`` runs an [M, K] x [N, K]^T product, M padded to a multiple of
    TOKEN_MULTIPLE."""
    return 0 < m <= MAX_TOKENS and n % TILE_N == 0 and k % (BLOCK * config.kb_per_step) == 0


def combined_scales(x_scales: jax.Array, w_scales: jax.Array) -> jax.Array:
    """x_scales [KB, M], w_scales [NB, KB] -> [NB, KB, M]: the factor of each block's product."""
    return w_scales[:, :, None] * x_scales[None, :, :]


@functools.partial(jax.jit, static_argnames=("config", "num_sms", "interpret"))
def fp8_gemm_mgpu(x8: jax.Array, x_scales: jax.Array, w8: jax.Array, w_scales: jax.Array, *,
                  config: GemmConfig = GemmConfig(), num_sms: int = 132, interpret: bool = False) -> jax.Array:
    """y [M, N] float32 = the block-scaled product (module docstring); ValueError for shapes the
    kernel does not take (``kernel_takes``)."""
    m, k = x8.shape
    n = w8.shape[0]
    if not kernel_takes(m, n, k, config) or m % TOKEN_MULTIPLE:
        raise ValueError(f"x8, w8: the FP8 GEMM takes M a multiple of {TOKEN_MULTIPLE} up to {MAX_TOKENS}, N of "
                         f"{TILE_N} and K of {BLOCK * config.kb_per_step}, got M={m}, N={n}, K={k}")
    steps_total = k // (BLOCK * config.kb_per_step)
    n_tiles = n // TILE_N
    splits = config.splits or choose_splits(n_tiles, steps_total, num_sms)
    if steps_total % splits:
        raise ValueError(f"config: splits={splits} must divide the {steps_total} pipeline steps")
    scales = combined_scales(x_scales, w_scales)
    kernel = plgpu.kernel(
        functools.partial(_kernel, steps=steps_total // splits, config=config, tokens=m),
        out_type=jax.ShapeDtypeStruct((splits, n, m), jnp.float32),
        scratch_types=[plgpu.SMEM((TILE_N, m), jnp.float32)],
        grid=(n_tiles, splits), grid_names=("n", "s"),
        kernel_name="snapmla_fp8_gemm",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    partials = kernel(w8, x8, scales)
    return jnp.sum(partials, axis=0).T


def fp8_gemm_reference(x8: jax.Array, x_scales: jax.Array, w8: jax.Array, w_scales: jax.Array) -> jax.Array:
    """The same sum in float32 with XLA: y [M, N]."""
    m, k = x8.shape
    n = w8.shape[0]
    kb = k // BLOCK
    xb = x8.astype(jnp.float32).reshape(m, kb, BLOCK)
    wb = w8.astype(jnp.float32).reshape(n, kb, BLOCK)
    partial = jnp.einsum("mbk,nbk->bmn", xb, wb, precision=lax.Precision.HIGHEST)
    row_scales = jnp.repeat(w_scales, BLOCK, axis=0)[:n]  # [N, KB]
    return jnp.einsum("bmn,bm,nb->mn", partial, x_scales, row_scales, precision=lax.Precision.HIGHEST)
