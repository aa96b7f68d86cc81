"""BF16 grouped GEMMs for decode-sized token counts on Mosaic GPU: a MoE layer's experts, each
matrix read by id where it lies.

The BF16 sibling of ``fp8_gemm_mgpu`` (its grid, token tiles and split choice), without block
scales. The weights are a bf16 model's expert stacks as the model holds them, [E, K, N] (in, out).
Tokens go on the wgmma N dimension and the weight's output columns on M ("swap AB"), so a few
tokens pad only to TOKEN_MULTIPLE, not to 64: a CTA computes y^T for TILE_N = 64 output columns
of one matrix and one token tile over one split of K, the weight tile [BLOCK_K, 64] the
transposed (N-major) A operand a 16-bit wgmma takes from shared memory, the tokens' tile the
K-major B operand. A BF16 wgmma accumulates in float32 without loss, so the products accumulate
in place across the pipeline's steps; the splits' partial sums [splits, G, N, M] float32 are
added by XLA.

Arguments of ``grouped_gemm_mgpu`` (``grouped_gemm_reference`` is its float32 twin):

  x         [X, M, K] bf16, X = 1 (shared by every group) or G; M as ``fp8_gemm_mgpu.pad_tokens``
            leaves it
  w         [E, K, N] bf16, or a tuple of such stacks of one shape (gate and up)
  matrices  None (G = E) or int32 [G]: each group's matrix in [0, E) (not checked in a trace:
            the caller clips them), or negative: the group is skipped (its CTAs exit at once and
            its output rows are left unwritten: a caller sizing its groups for the worst case
            reads none of the weights for the groups it does not use)
  -> [G, M, N] float32 (a tuple for a tuple of stacks)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import (LARGE_TILE, MAX_TOKENS, SMEM_BYTES, TILE_N, TOKEN_MULTIPLE,
                                                      choose_splits, launch_grid, pad_tokens, run_on_stack,
                                                      summed_partials, token_tile)

BLOCK_K = 128  # contraction channels a pipeline step brings: a [128, 64] bf16 weight tile, 16 KiB


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """depth: pipeline steps in flight (fewer where SMEM_BYTES would not hold them); splits: None
    picks ``fp8_gemm_mgpu.choose_splits``."""
    depth: int = 4
    splits: int | None = None


def kernel_takes(m: int, n: int, k: int) -> bool:
    """Whether the kernel runs an [M, K] x [K, N] product (M padded by ``pad_tokens``): N a multiple
    of 64, K of BLOCK_K."""
    return m > 0 and n % TILE_N == 0 and k % BLOCK_K == 0


def pipeline_depth(config: GroupedGemmConfig, tokens: int) -> int:
    """``config.depth``, or fewer steps in flight where the slots (weight and token tiles) and the
    output tile would not fit SMEM_BYTES."""
    slot = 2 * (TILE_N + tokens) * BLOCK_K
    return max(2, min(config.depth, (SMEM_BYTES - 4 * TILE_N * tokens) // slot))


def _kernel(matrices_gmem, *refs, num_stacks: int, stack_groups: int, steps: int, shared_x: bool, depth: int,
            tokens: int):
    """One CTA of grid (g, n, s, m): output columns [64 n, 64 n + 64) of group g (of stack
    g // ``stack_groups``: matrix ``matrices[g % stack_groups]``, or g % it) times token tile m,
    over split s of K (``steps`` pipeline steps).

    refs: the ``num_stacks`` weight stacks, then x, the output and its SMEM tile."""
    w_gmems, (x_gmem, out_gmem, out_s) = refs[:num_stacks], refs[num_stacks:]
    gg, n, split, mt = (lax.axis_index(name) for name in ("g", "n", "s", "m"))
    g = gg if num_stacks == 1 else lax.rem(gg, stack_groups)
    k0 = split * steps * BLOCK_K
    matrix = g if matrices_gmem is None else matrices_gmem[g]
    x_cols = x_gmem.at[0 if shared_x else g, pl.ds(mt * tokens, tokens), pl.ds(k0, steps * BLOCK_K)]

    def run(w_gmem):
        w_rows = w_gmem.at[matrix, pl.ds(k0, steps * BLOCK_K), pl.ds(n * TILE_N, TILE_N)]

        def accumulate(acc_ref):
            # The weight tile [BLOCK_K, 64] is the A operand transposed (N-major, which 16-bit
            # wgmma operands may be); each step's product accumulates onto the last, and a slot is
            # released a step late, once the product reading it has finished.
            release = 1 if depth > 1 else 0
            plgpu.emit_pipeline(
                lambda _, w_s, x_s: plgpu.wgmma(acc_ref, w_s.transpose((1, 0)), x_s.transpose((1, 0))),
                grid=(steps,),
                in_specs=[plgpu.BlockSpec((BLOCK_K, TILE_N), lambda k: (k, 0), delay_release=release),
                          plgpu.BlockSpec((tokens, BLOCK_K), lambda k: (0, k), delay_release=release)],
                max_concurrent_steps=depth,
            )(w_rows, x_cols)
            return acc_ref[...]

        out_s[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, tokens), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_gmem.at[split, gg, pl.ds(n * TILE_N, TILE_N), pl.ds(mt * tokens, tokens)])
        plgpu.wait_smem_to_gmem(0)

    if matrices_gmem is None:
        run_on_stack(run, w_gmems, gg, stack_groups)
    else:
        pl.when(matrix >= 0)(lambda: run_on_stack(run, w_gmems, gg, stack_groups))


@functools.partial(jax.jit, static_argnames=("config", "num_sms", "interpret"))
def grouped_gemm_mgpu(x: jax.Array, w, matrices: jax.Array | None = None, *,
                      config: GroupedGemmConfig = GroupedGemmConfig(), num_sms: int = 132, interpret: bool = False):
    """G products of one launch, group g multiplying its tokens x[g] (or the x[0] all groups
    share) by matrix ``matrices[g]`` of w (None: g); arguments and result in the module
    docstring. ValueError for shapes the kernel does not take (``kernel_takes``, ``pad_tokens``).
    """
    stacked = isinstance(w, tuple)
    stacks = tuple(w) if stacked else (w,)
    num_x, m, k = x.shape
    num_matrices, k_w, n = stacks[0].shape
    if not kernel_takes(m, n, k) or m != pad_tokens(m) or k_w != k:
        raise ValueError(f"x, w: the grouped GEMM takes M a multiple of {TOKEN_MULTIPLE} up to {MAX_TOKENS} (of "
                         f"{LARGE_TILE} above), N of {TILE_N} and K of {BLOCK_K}, got M={m}, N={n}, K={k} "
                         f"(weights K={k_w})")
    if any(s.shape != stacks[0].shape or s.dtype != jnp.bfloat16 for s in stacks):
        raise ValueError(f"w: bf16 stacks of one shape, got {[f'{s.dtype}{list(s.shape)}' for s in stacks]}")
    groups = num_matrices if matrices is None else matrices.shape[0]
    if num_x not in (1, groups):
        raise ValueError(f"x: expected 1 or {groups} groups of tokens, got {num_x}")
    tokens = token_tile(m)
    n_tiles, m_tiles, steps_total = n // TILE_N, m // tokens, k // BLOCK_K
    num_stacks = len(stacks)
    splits = config.splits or choose_splits(num_stacks * groups * n_tiles * m_tiles, steps_total, num_sms)
    if steps_total % splits:
        raise ValueError(f"config: splits={splits} must divide the {steps_total} pipeline steps")
    body = functools.partial(_kernel, num_stacks=num_stacks, stack_groups=groups, steps=steps_total // splits,
                             shared_x=num_x == 1, depth=min(pipeline_depth(config, tokens), steps_total // splits),
                             tokens=tokens)
    grid, grid_names = launch_grid(num_stacks * groups, n_tiles, splits, m_tiles)
    kernel = plgpu.kernel(
        body if matrices is not None else functools.partial(body, None),
        out_type=jax.ShapeDtypeStruct((splits, num_stacks * groups, n, m), jnp.float32),
        scratch_types=[plgpu.SMEM((TILE_N, tokens), jnp.float32)],
        grid=grid, grid_names=grid_names,
        kernel_name="snapmla_grouped_gemm",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return summed_partials(kernel, (*stacks, x.astype(jnp.bfloat16)), matrices, stacked=stacked,
                           num_stacks=num_stacks, groups=groups)


def grouped_gemm_reference(x: jax.Array, w: jax.Array, matrices: jax.Array | None = None) -> jax.Array:
    """``grouped_gemm_mgpu`` for one stack in float32 with XLA: [G, M, N] (a skipped group's
    rows, negative matrix, are zeros)."""
    chosen = w if matrices is None else jnp.where((matrices >= 0)[:, None, None], w[jnp.maximum(matrices, 0)], 0)
    xs = jnp.broadcast_to(x, (chosen.shape[0], *x.shape[1:]))
    return jnp.einsum("gmk,gkn->gmn", xs.astype(jnp.float32), chosen.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
