"""Block-scaled FP8 GEMM for many tokens (prefill, large decode batches) on Mosaic GPU: output
tiles of 64 x ``compute_wgs`` tokens by 128 weight rows, a producer warpgroup streaming the
operands and one consumer warpgroup per 64 tokens.

The same sum as ``fp8_gemm_mgpu`` (DeepSeek's recipe: W [N, K] e4m3 with one float32 scale per
128 x 128 block, x [M, K] quantized per token and 128 channels):

  y[m, n] = sum_kb  x_scale[m, kb] * w_scale[n // 128, kb] * sum_{k in kb} x8[m, k] * w8[n, k]

Where ``fp8_gemm_mgpu`` puts the few tokens of a decode step on the wgmma N dimension and reads
W once, here the tokens are many and the tile is square-ish: x is the A operand (64 tokens a
warpgroup), W the B operand (128 rows: one scale block, so W's scale is one number a step), both
K-major as the checkpoint and the quantization store them. Each pipeline step brings one
128-channel block; a consumer multiplies it into a fresh accumulator, waits, scales it by its
tokens' scales times the weight block's and adds it to its running float32 sum, so Hopper's FP8
accumulator (~14 significant bits) never carries more than 128 channels. While one consumer
scales, the other's product runs on the tensor cores. Consecutive CTAs (the grid's first axis)
walk the token tiles of one weight tile, so W streams from HBM about once and x stays in L2.

Groups (``fp8_grouped_gemm_tiles_mgpu``): G products in one launch, group g multiplying its tokens
(or tokens all groups share) by matrix ``matrices[g]`` of a stack [E, N, K], read where it lies
(negative ids skip the group), or by matrix g: a MoE layer's experts (the dense dispatch's gate
and up, the sorted dispatch's chunks). Several stacks of one shape (gate and up) share a launch.

Measured (``scripts/bench_fp8_gemm.py``, H200, docs/benchmarks/fp8_gemm_tiles_h200.md): at 4096
tokens 796 TFLOP/s at V3's MLP shapes (1.12-1.17x the bf16 GEMM, 73% of cuBLAS' FP8 product with
per-tensor scales) and 90-97% of cuBLAS' at 1536-2048-channel shapes; at 128-512 tokens 1.08-1.76x
``fp8_gemm_mgpu``. Three consumers, two blocks a step or five steps in flight were no faster.

Arguments of ``fp8_gemm_tiles_mgpu`` (``fp8_gemm_mgpu.fp8_gemm_reference`` is its float32 twin;
``fp8_grouped_gemm_tiles_mgpu`` runs G such products in one launch, a MoE layer's experts):

  x8        [M, K] e4m3, M a multiple of the tile's tokens (``tile_tokens``)
  x_scales  [K / 128, M] float32 (``fp8_weights.quantize_activations``)
  w8        [N, K] e4m3, N a multiple of 128, K of 128
  w_scales  [N / 128, K / 128] float32
  -> y [M, N] in ``out_dtype`` (float32 or bfloat16)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# BLOCK: the channels (and weight rows) a scale covers: a pipeline step's K, a CTA's weight rows.
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import BLOCK, check_stacks, run_on_stack
from snapmla_jax.pallas_kernels.mgpu_bytes import BYTE_TILE_TRANSFORMS

WG_TOKENS = 64  # tokens a consumer warpgroup: one wgmma M
SMEM_BYTES = 227 * 1024  # shared memory a CTA may use on Hopper
# Beside the slots and the output tile: the pipeline's barriers (six 128-token slots and a bf16
# tile, computed to fit, overflowed by 96 bytes).
BARRIER_BYTES = 1024
ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector with one value per accumulator row (token)


@dataclasses.dataclass(frozen=True)
class TilesConfig:
    """compute_wgs: consumer warpgroups, 64 tokens each (the tile's tokens); kb_per_step:
    128-channel blocks a pipeline step brings (with 2, a consumer scales a step's first block
    while the product of its second runs: a second fresh accumulator, 64 registers a thread);
    depth: pipeline steps in flight (fewer where the slots and the output tile would not fit);
    splits: of K (None: ``choose_splits``)."""
    compute_wgs: int = 2
    kb_per_step: int = 1
    depth: int = 4
    splits: int | None = None

    @property
    def tile_tokens(self) -> int:
        return WG_TOKENS * self.compute_wgs


def kernel_takes(m: int, n: int, k: int, config: TilesConfig = TilesConfig()) -> bool:
    """Whether ``fp8_gemm_tiles_mgpu`` runs an [M, K] x [N, K]^T product: M whole token tiles, N
    whole 128-row blocks, K whole 128-channel blocks."""
    return (m > 0 and m % config.tile_tokens == 0 and n > 0 and n % BLOCK == 0 and k > 0
            and k % (BLOCK * config.kb_per_step) == 0)


def pipeline_depth(config: TilesConfig, out_dtype) -> int:
    """Steps in flight: ``config.depth``, or as many as fit beside the output tile."""
    tokens, kbs = config.tile_tokens, config.kb_per_step
    slot = (tokens + BLOCK) * BLOCK * kbs + 4 * tokens * kbs
    out_tile = tokens * BLOCK * jnp.dtype(out_dtype).itemsize
    return max(1, min(config.depth, (SMEM_BYTES - BARRIER_BYTES - out_tile) // slot))


def choose_splits(tiles: int, steps: int, num_sms: int) -> int:
    """Splits of K (a divisor of its ``steps``) for ``tiles`` output tiles: the most that keep one
    wave of ``num_sms`` CTAs (a CTA holds an SM), so that a call whose tiles leave SMs idle runs
    shorter CTAs on more of them; 1 where the tiles fill the SMs (past one wave, splitting would
    write float32 partials of the whole output several times to shorten only the last wave)."""
    return max(d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or tiles * d <= num_sms))


def _kernel(*refs, num_stacks: int, stack_groups: int, has_matrices: bool, shared_x: bool, steps: int, depth: int,
            compute_wgs: int, kb_per_step: int):
    """CTA (m, n, s, g): group g's tokens [m T, m T + T) (T = 64 x compute_wgs) times weight rows
    [128 n, 128 n + 128) of its matrix, over split s of K (``steps`` pipeline steps); consumer
    warpgroup wg owns tokens [64 wg, 64 wg + 64) of the tile. Grid group g is group
    g % ``stack_groups`` of stack g // ``stack_groups``; its matrix is matrices[group] (skipped
    where negative) or the group itself.

    refs: matrices (with ``has_matrices``), the stacks' e4m3 values, their scales, x, x's scales,
    the output and its SMEM tile."""
    matrices_gmem, refs = (refs[0], refs[1:]) if has_matrices else (None, refs)
    w_gmems, ws_gmems = refs[:num_stacks], refs[num_stacks:2 * num_stacks]
    x_gmem, xs_gmem, out_gmem, out_s = refs[2 * num_stacks:]
    m, n, split, gg = (lax.axis_index(name) for name in ("m", "n", "s", "g"))
    group = gg if num_stacks == 1 else lax.rem(gg, stack_groups)
    matrix = matrices_gmem[group] if has_matrices else group
    x_group = 0 if shared_x else group
    wg = lax.axis_index("wg")
    tokens = WG_TOKENS * compute_wgs
    mine = pl.ds(wg * WG_TOKENS, WG_TOKENS)
    tk = BLOCK * kb_per_step

    def run(w_gmem, ws_gmem):
        def body(indices, x_s, xs_s, w_s, total):
            (step,) = indices

            def products(*acc_refs):
                # Every block's product is issued before the first is read: block i's scaling runs
                # while the tensor cores work on the blocks after it.
                for i, acc_ref in enumerate(acc_refs):
                    channels = pl.ds(i * BLOCK, BLOCK)
                    plgpu.wgmma(acc_ref, x_s.at[mine, channels], w_s.at[:, channels].transpose((1, 0)))
                result = total
                for i, acc_ref in enumerate(acc_refs):
                    # The weight block's scale: one number, read from global memory (it is cached).
                    w_scale = ws_gmem[matrix, n, (split * steps + step) * kb_per_step + i]
                    fresh = plgpu.wgmma_accumulator_load(acc_ref, wait_n=kb_per_step - 1 - i)
                    x_scale = plgpu.load(xs_s.at[i, mine], layout=ROW) * w_scale
                    result = result + fresh * lax.broadcast_in_dim(x_scale, (WG_TOKENS, BLOCK), [0])
                return result

            return pl.run_scoped(products,
                                 *[plgpu.ACC((WG_TOKENS, BLOCK), jnp.float32) for _ in range(kb_per_step)])

        def compute(run_pipeline):
            zeros = plgpu.layout_cast(jnp.zeros((WG_TOKENS, BLOCK), jnp.float32), plgpu.Layout.WGMMA)
            total = run_pipeline(zeros)
            out_s[wg] = total.astype(out_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s.at[wg], out_gmem.at[split, gg, pl.ds(m * tokens + wg * WG_TOKENS, WG_TOKENS),
                                                              pl.ds(n * BLOCK, BLOCK)])
            plgpu.wait_smem_to_gmem(0)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=compute_wgs,
            max_concurrent_steps=min(depth, steps), compute_context=compute,
            in_specs=[plgpu.BlockSpec((tokens, tk), lambda k: (0, k), transforms=BYTE_TILE_TRANSFORMS),
                      plgpu.BlockSpec((kb_per_step, tokens), lambda k: (k, 0)),
                      plgpu.BlockSpec((BLOCK, tk), lambda k: (0, k), transforms=BYTE_TILE_TRANSFORMS)])
        k_steps = pl.ds(split * steps * tk, steps * tk)
        kb_steps = pl.ds(split * steps * kb_per_step, steps * kb_per_step)
        pipeline(x_gmem.at[x_group, pl.ds(m * tokens, tokens), k_steps],
                 xs_gmem.at[x_group, kb_steps, pl.ds(m * tokens, tokens)],
                 w_gmem.at[matrix, pl.ds(n * BLOCK, BLOCK), k_steps])

    run_stack = functools.partial(run_on_stack, lambda refs: run(*refs), tuple(zip(w_gmems, ws_gmems)), gg,
                                  stack_groups)
    if has_matrices:
        pl.when(matrix >= 0)(run_stack)
    else:
        run_stack()


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "num_sms", "interpret"))
def fp8_grouped_gemm_tiles_mgpu(x8: jax.Array, x_scales: jax.Array, w8, w_scales, matrices: jax.Array | None = None,
                                *, out_dtype=jnp.float32, config: TilesConfig = TilesConfig(), num_sms: int = 132,
                                interpret: bool = False):
    """G block-scaled products of one launch, group g multiplying its tokens x8[g] (or the one
    x8[0] all groups share) by weight matrix ``matrices[g]`` of w8 (None: g):

      x8        [X, M, K] e4m3, X = 1 (shared) or G; M a multiple of the tile's tokens
      x_scales  [X, K / 128, M] float32 (``fp8_weights.quantize_activations`` per group)
      w8        [E, N, K] e4m3, N a multiple of 128, K of 128; w_scales [E, N / 128, K / 128]
                float32; or tuples of such stacks of one shape (a MoE's gate and up: both
                products of the same tokens in one launch)
      matrices  None (G = E) or int32 [G]: each group's matrix, in [0, E) (not checked in a
                trace), or negative: the group is skipped, its output left unwritten
      -> y [G, M, N] in ``out_dtype`` (float32 or bfloat16), a tuple of them (one a stack) for
         tuples.

    Where the output's tiles fill fewer than ``num_sms`` SMs, K is split (``config.splits``,
    None: ``choose_splits``) and XLA adds the splits' float32 partials. ValueError for shapes the
    kernel does not take (``kernel_takes``).
    """
    stacked = isinstance(w8, tuple)
    w8s, w_scales_s = (tuple(w8), tuple(w_scales)) if stacked else ((w8,), (w_scales,))
    num_x, m, k = x8.shape
    num_matrices, n, _ = w8s[0].shape
    groups = num_matrices if matrices is None else matrices.shape[0]
    if not kernel_takes(m, n, k, config) or w8s[0].shape[2] != k:
        raise ValueError(f"x8, w8: the tiled FP8 GEMM takes M a multiple of {config.tile_tokens}, N of {BLOCK} and K "
                         f"of {BLOCK * config.kb_per_step}, got M={m}, N={n}, K={k} (weights K={w8s[0].shape[2]})")
    check_stacks(w8s, w_scales_s, num_x, groups)
    if x_scales.shape != (num_x, k // BLOCK, m) or any(ws.shape != (num_matrices, n // BLOCK, k // BLOCK)
                                                      for ws in w_scales_s):
        raise ValueError(f"x_scales, w_scales: expected {(num_x, k // BLOCK, m)} and "
                         f"{(num_matrices, n // BLOCK, k // BLOCK)}, got {x_scales.shape} and "
                         f"{[ws.shape for ws in w_scales_s]}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"out_dtype: expected float32 or bfloat16, got {out_dtype}")
    num_stacks = len(w8s)
    steps = k // (BLOCK * config.kb_per_step)
    grid = (m // config.tile_tokens, n // BLOCK)
    splits = config.splits or choose_splits(grid[0] * grid[1] * num_stacks * groups, steps, num_sms)
    if steps % splits:
        raise ValueError(f"config: splits={splits} must divide the {steps} pipeline steps")
    tile_dtype = out_dtype if splits == 1 else jnp.float32
    body = functools.partial(_kernel, num_stacks=num_stacks, stack_groups=groups, has_matrices=matrices is not None,
                             shared_x=num_x == 1, steps=steps // splits, depth=pipeline_depth(config, tile_dtype),
                             compute_wgs=config.compute_wgs, kb_per_step=config.kb_per_step)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, num_stacks * groups, m, n), tile_dtype),
        scratch_types=[plgpu.SMEM((config.compute_wgs, WG_TOKENS, BLOCK), tile_dtype)],
        grid=(*grid, splits, num_stacks * groups), grid_names=("m", "n", "s", "g"),
        num_threads=config.compute_wgs + 1, thread_name="wg",
        kernel_name="snapmla_fp8_gemm_tiles",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    operands = (*w8s, *(ws.astype(jnp.float32) for ws in w_scales_s), x8, x_scales)
    if matrices is not None:
        operands = (matrices.astype(jnp.int32), *operands)
    partials = kernel(*operands)
    ys = partials[0] if splits == 1 else jnp.sum(partials, axis=0).astype(out_dtype)
    if not stacked:
        return ys
    return tuple(ys.reshape(num_stacks, groups, m, n))


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "num_sms", "interpret"))
def fp8_gemm_tiles_mgpu(x8: jax.Array, x_scales: jax.Array, w8: jax.Array, w_scales: jax.Array, *,
                        out_dtype=jnp.float32, config: TilesConfig = TilesConfig(), num_sms: int = 132,
                        interpret: bool = False) -> jax.Array:
    """One product: x8 [M, K] e4m3, x_scales [K / 128, M] float32, w8 [N, K] e4m3, w_scales
    [N / 128, K / 128] float32 -> y [M, N] in ``out_dtype`` (``fp8_grouped_gemm_tiles_mgpu`` with
    one group)."""
    if x8.ndim != 2 or w8.ndim != 2 or x_scales.ndim != 2 or w_scales.ndim != 2:
        raise ValueError(f"x8, w8: expected [M, K] and [N, K] (scales [K / 128, M] and [N / 128, K / 128]), got "
                         f"{list(x8.shape)}, {list(w8.shape)}, {list(x_scales.shape)}, {list(w_scales.shape)}")
    return fp8_grouped_gemm_tiles_mgpu(x8[None], x_scales[None], w8[None], w_scales[None], out_dtype=out_dtype,
                                       config=config, num_sms=num_sms, interpret=interpret)[0]
