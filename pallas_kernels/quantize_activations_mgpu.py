"""Activations quantized for the FP8 GEMMs in one Mosaic GPU launch: per token and 128 channels.

DeepSeek's activation recipe (``fp8_weights.quantize_activations``): a row's 128-channel block
gets the scale amax * float32(1 / 448) (0 for a block of zeros) and its values x / scale cast to
e4m3 with saturation. In XLA that is three launches (the blocks' amax, the cast, the scales'
transpose to [K / 128, M]) for every FP8 product past one row; here it is one launch, with XLA's
bytes and scales (interpreted bit for bit; compiled, a quotient at an e4m3 rounding midpoint may
round to the other neighbour: the division's last bit). On an H100 a V2-Lite MoE layer ran
1.06-1.11x faster with it at 4-8 tokens, the same at 16-64, and a whole decode step the same within
run-to-run noise (docs/models.md, "The launch before the GEMM").

A CTA (one warpgroup) takes ROW_TILE rows by 256 channels (128 where K is not a multiple of
256): one tiled TMA brings them to shared memory (rows past M arrive as the copy's zeros; a tile
wholly past M is zeroed in shared memory), 8 rows x 128 channels at a time go through registers
(``write_kv.row_layout``: a row's amax is an in-thread max and five shuffles), and TMAs store the
e4m3 tile [rows, channels] and the scales [channels / 128, rows] where the GEMMs read them. A
tiled TMA copies at most 256 elements a dimension, hence 256 channels. Many small CTAs are not
what limits it: the MoE's hidden rows at V2-Lite's 128 tokens, [88, 32, 1408] bf16 in 1,936 CTAs
of 4 KiB, took 4.45 us (2.7 TB/s), and CTAs of 2, 4 or 8 groups (one TMA of [groups, 16, 128])
4.74, 5.18 and 6.27 us (H200, jax 0.11.2, kernel durations side by side in one profiler trace).

The scales may come with more columns than rows (``scale_rows``): the FP8 GEMM of few tokens reads
them in pipeline slots of whole 128-byte units (``fp8_gemm_mgpu.scale_slot_tokens``), and columns
past the rows hold 0 (zero rows) instead of a pad launch of their own.

Arguments of ``quantize_activations_mgpu`` (``fp8_weights.quantize_activations`` is its XLA twin):

  x           [M, K] or [X, M, K] bfloat16, float16 or float32, K a multiple of 128
  rows        rows of x8 (>= M; rows past M are zeros): a multiple of ROW_TILE (default M
              rounded up so)
  scale_rows  columns of the scales (>= rows, a multiple of ROW_TILE; default rows)
  -> x8 [X?, rows, K] float8_e4m3fn, scales [X?, K / 128, scale_rows] float32
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.fp8 import FP8_E4M3_MAX_RECIPROCAL, saturate_to_e4m3
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import BLOCK, FLOAT_DTYPES, tma_rows
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import GROUP_ROWS, by_row
from snapmla_jax.pallas_kernels.write_kv import row_layout

# Rows a CTA: small CTAs spread a decode step's few tokens over more SMs, and at every row count
# measured they beat 64-row CTAs (H100, jax 0.11.2, kernel durations side by side, K = 2048 bf16:
# 2.1 against 4.9 us at 128 rows, 2.6 against 5.1 at 512, 3.4 against 5.4 at 1,024, 7.8 against
# 9.2 at 4,096).
ROW_TILE = 16
MAX_COLUMNS = 256  # channels a CTA: a tiled TMA copies at most 256 elements a dimension


def padded_rows(m: int) -> int:
    """``m`` rounded up to whole row tiles (ROW_TILE)."""
    return -(-m // ROW_TILE) * ROW_TILE


def _kernel(x_gmem, x8_gmem, scales_gmem, x_s, x8_s, scales_s, loaded, *, m: int, rows: int,
            interpret: bool):
    """Rows [tile r, tile r + tile) by channels [C c, C c + C) of group g, tile = ROW_TILE, C =
    x_s.shape[1]."""
    tile = ROW_TILE
    g, r, c = (lax.axis_index(name) for name in ("g", "r", "c"))
    blocks = x8_s.shape[0]
    row0, col0 = r * tile, c * blocks * BLOCK

    @pl.when(row0 < m)
    def _():
        plgpu.copy_gmem_to_smem(x_gmem.at[g, pl.ds(row0, tile), pl.ds(col0, blocks * BLOCK)], x_s, loaded)
        plgpu.barrier_wait(loaded)

    @pl.when(row0 >= m)
    def _():
        x_s[...] = jnp.zeros(x_s.shape, x_s.dtype)
        plgpu.commit_smem()  # the zeros before other threads load them

    layout = row_layout(BLOCK, x_s.dtype)
    for kb in range(blocks):
        for group in range(tile // GROUP_ROWS):
            block_rows = pl.ds(group * GROUP_ROWS, GROUP_ROWS)
            x = plgpu.load(x_s.at[block_rows, pl.ds(kb * BLOCK, BLOCK)], layout=layout).astype(jnp.float32)
            # XLA's arithmetic (``fp8_weights.quantize_blocks``): scale = amax * (1 / 448), and a
            # block of zeros divided by 1 (its scale stays 0).
            scale = jnp.max(jnp.abs(x), axis=-1) * FP8_E4M3_MAX_RECIPROCAL
            divisor = by_row(jnp.where(scale > 0, scale, 1.0), x.shape, layout, interpret)
            if interpret:
                # XLA on the CPU turns a division by a broadcast into a product with the reciprocal
                # (one rounding more: a quotient next to an e4m3 midpoint then rounds the other way
                # than XLA's own quantizer, whose divisor is no plain broadcast); the barrier keeps
                # the division.
                divisor = lax.optimization_barrier(jnp.broadcast_to(divisor, x.shape))
            x8_s[kb, block_rows, :] = saturate_to_e4m3(x / divisor)
            scales_s[kb, block_rows] = scale
    plgpu.commit_smem()  # the stores before the TMAs (the async proxy) read them

    @pl.when(row0 < rows)  # scale columns may run past x8's rows
    def _():
        for kb in range(blocks):
            plgpu.copy_smem_to_gmem(x8_s.at[kb], x8_gmem.at[g, pl.ds(row0, tile), pl.ds(col0 + kb * BLOCK, BLOCK)],
                                    commit_group=False)

    plgpu.copy_smem_to_gmem(scales_s, scales_gmem.at[g, pl.ds(c * blocks, blocks), pl.ds(row0, tile)],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads


@functools.partial(jax.jit, static_argnames=("rows", "scale_rows", "interpret"))
def quantize_activations_mgpu(x: jax.Array, rows: int | None = None, scale_rows: int | None = None, *,
                              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [M, K] or [X, M, K] -> (x8 [X?, rows, K] e4m3, scales [X?, K / 128, scale_rows] float32):
    ``fp8_weights.quantize_activations`` of x padded with zero rows to ``rows``, the scales padded
    with zero columns to ``scale_rows`` (module docstring). ValueError for other shapes or dtypes."""
    if x.ndim not in (2, 3) or x.dtype not in FLOAT_DTYPES or x.shape[-1] % BLOCK or not x.shape[-2]:
        raise ValueError(f"x: expected [M, K] or [X, M, K] bfloat16, float16 or float32 with M > 0 and K a multiple "
                         f"of {BLOCK}, got {x.dtype} {list(x.shape)}")
    stacked = x.ndim == 3
    x3 = x if stacked else x[None]
    num_x, m, k = x3.shape
    rows = padded_rows(m) if rows is None else rows
    scale_rows = rows if scale_rows is None else scale_rows
    if rows < m or scale_rows < rows or rows % ROW_TILE or scale_rows % ROW_TILE:
        raise ValueError(f"rows, scale_rows: expected M={m} <= rows <= scale_rows, both multiples of {ROW_TILE}, got "
                         f"rows={rows}, scale_rows={scale_rows}")
    columns = MAX_COLUMNS if k % MAX_COLUMNS == 0 else BLOCK
    blocks = columns // BLOCK
    # Compiled, Mosaic GPU refuses a tiled TMA of an array whose rows are neither fewer than nor a
    # multiple of 8 (``fp8_gemm_mgpu.tma_rows``): such an x gets zero rows to whole 8s first.
    x3 = jnp.pad(x3, ((0, 0), (0, tma_rows(m) - m), (0, 0)))
    kernel = plgpu.kernel(
        functools.partial(_kernel, m=m, rows=rows, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((num_x, rows, k), jnp.float8_e4m3fn),
                  jax.ShapeDtypeStruct((num_x, k // BLOCK, scale_rows), jnp.float32)),
        scratch_types=[plgpu.SMEM((ROW_TILE, columns), x.dtype),
                       plgpu.SMEM((blocks, ROW_TILE, BLOCK), jnp.float8_e4m3fn),
                       plgpu.SMEM((blocks, ROW_TILE), jnp.float32), plgpu.Barrier(num_arrivals=1)],
        grid=(num_x, scale_rows // ROW_TILE, k // columns), grid_names=("g", "r", "c"),
        kernel_name="snapmla_quantize_activations",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    x8, scales = kernel(x3)
    return (x8, scales) if stacked else (x8[0], scales[0])
