"""Fused per-token FP8 quantize + paged cache write on Mosaic GPU (one pass over the new tokens).

Every prefill and decode step of every layer runs it once:

  cache_arrays (latent [N, R] e4m3, scale [N] f32, rope [N, Dr] bf16) for an fp8 cache,
               or (latent [N, R] bf16, rope [N, Dr] bf16) for a bf16 one: flat token rows
  latent [T, R], k_rope [T, Dr] bf16/f16/f32; rows [T] int32, the cache row of each token
  (-1: write nothing) -> the cache arrays, aliased input->output

Math (``fp8.quantize_per_token``, bit for bit): per token ``s = max(amax, 1e-30) * float32(1 / 448)`` and
``e4m3(clip(x / s, -448, 448))`` in float32 (round to nearest even); the bf16 cache stores
``bf16(x)``, and the RoPE part is stored as bf16 in both.

Work layout. A CTA of one warpgroup takes ``block_tokens`` consecutive tokens:

  1. one bulk TMA copy each brings their latent rows [bt, R] and RoPE rows [bt, Dr] (contiguous
     in the inputs) and their cache rows [bt] to SMEM;
  2. ``group_rows`` token rows at a time, one row per warp, each lane holding 16-byte vectors of
     it (``row_layout``): amax by in-thread max and lane shuffles, the scale, the division and
     the e4m3 cast in registers, the bytes stored to an SMEM staging tile;
  3. per token with a row >= 0, two bulk TMA stores from SMEM to the row given at run time (its
     latent row, R bytes of e4m3 or 2R of bf16, and its RoPE row, 2 Dr bytes), and the scale
     as a plain 4-byte store: a TMA store moves multiples of 16 bytes, and the scale plane
     [N] f32 holds 4 a token.

Where no conversion is needed (bf16 inputs into a bf16 cache; bf16 RoPE) step 2 is skipped and
the rows leave from the input tile. The last block of a call whose T is not a multiple of
``block_tokens`` loads the last ``block_tokens`` tokens (a window overlapping the block before)
and stores only its own; a call of fewer tokens loads them all. ``rows`` is padded with -1 to
whole blocks, so every CTA reads a full block of row ids.

Shapes the kernel takes (``kernel_takes``): R and Dr multiples of 64, so that any token count's
rows fill whole 128-byte TMA transfers; ``snapmla_jax.write_kv`` runs the XLA reference for
others (the same bytes).

The cache arrays are aliased input->output, so under ``jax.jit`` with the cache donated the write
happens in place: no copy of the cache, no temporary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.fp8 import per_token_scale, quantize_per_token, saturate_to_e4m3

WARPS = 4  # warps of the CTA's warpgroup: one token row each per quantize step
LANES = 32
VECTOR_BYTES = 16  # a lane's share of a row per load: one 128-bit shared-memory access
TMA_MULTIPLE = 128  # bytes: a TMA load's size is a multiple of it (its 128 threads share the arrival)
# R and Dr: multiples of 64, so that [n, R] and [n, Dr] rows of 2-byte values are whole TMA
# transfers for any token count n (the load of a call with fewer than block_tokens tokens).
DIM_MULTIPLE = TMA_MULTIPLE // 2


@dataclasses.dataclass(frozen=True)
class WriteKVConfig:
    """Launch knobs. ``block_tokens``: tokens a CTA (a multiple of 32: its row ids are one TMA
    transfer); SMEM a CTA is about block_tokens x 1.7 KB for bf16 inputs and an fp8 cache, so 32
    lets four CTAs share an SM. ``group_rows``: token rows a quantize step holds in registers (a
    multiple of 4, one row per warp in turn; 8 rows of 512 are 32 values a thread).
    ``stores_by_warps``: each warp issues the row stores of every fourth token (four threads
    issuing at once); False: one thread issues them all."""

    block_tokens: int = 32
    group_rows: int = 8
    stores_by_warps: bool = True

    def __post_init__(self):
        if self.block_tokens <= 0 or self.block_tokens % 32:
            raise ValueError(f"block_tokens: expected a positive multiple of 32, got {self.block_tokens}")
        if self.group_rows <= 0 or self.group_rows % WARPS or self.block_tokens % self.group_rows:
            raise ValueError(f"group_rows: expected a multiple of {WARPS} dividing block_tokens "
                             f"({self.block_tokens}), got {self.group_rows}")


def kernel_takes(rank: int, rope_dim: int) -> bool:
    """Whether the kernel takes a cache of latent width ``rank`` and RoPE width ``rope_dim``."""
    return rank % DIM_MULTIPLE == 0 and rope_dim % DIM_MULTIPLE == 0


def row_layout(width: int, dtype) -> plgpu.Layout:
    """Register layout of [group_rows, width] token rows: warp w holds rows w, w + 4, ...; lane l
    holds a vector of up to 16 bytes of each 32-vector segment of the row, so a row's amax is an
    in-thread max and five shuffles, and an SMEM access of a warp is one contiguous stretch."""
    vec = VECTOR_BYTES // jnp.dtype(dtype).itemsize
    while width % (LANES * vec):
        vec //= 2
    return plgpu.Layout.TILED(plgpu.Tiling(((WARPS, LANES * vec), (vec,))), warp_dims=(-3,), lane_dims=(-2,),
                              vector_dim=-1)


def _write_kv_kernel(*refs, scratch_types: list, **params):
    """The launch's body: the kernel below with its SMEM and barrier."""
    pl.run_scoped(functools.partial(_write_block, *refs, **params), *scratch_types)


def _write_block(rows_ref, latent_ref, rope_ref, *refs, quantize: bool, stage_latent: bool,
                 stage_rope: bool, num_tokens: int, config: WriteKVConfig, interpret: bool):
    """One block of ``block_tokens`` (bt) tokens.

    rows_ref   [grid x bt] int32: cache row per token, -1 = skip (padded with -1 to whole blocks)
    latent_ref [T, R], rope_ref [T, Dr]: the new tokens (bf16/f16/f32)
    refs       the cache arrays, written in place: latent_out [N, R] (e4m3 or bf16),
               [scale_out [N] f32,] rope_out [N, Dr] bf16; then SMEM: latent_s [bt, R] and
               rope_s [bt, Dr] (the inputs' dtypes), rows_s [bt] int32, [latent_stage [bt, R] (the
               cache's dtype),] [scale_s [bt] f32,] [rope_stage [bt, Dr] bf16,] and the loads' barrier
    """
    n_cache = 3 if quantize else 2
    outs, scratch = refs[:n_cache], list(refs[n_cache:])
    latent_out, rope_out = outs[0], outs[-1]
    latent_s, rope_s, rows_s = scratch[:3]
    latent_stage = scratch.pop(3) if stage_latent else latent_s
    scale_s = scratch.pop(3) if quantize else None
    rope_stage = scratch.pop(3) if stage_rope else rope_s
    loaded_bar = scratch[3]

    bt = config.block_tokens
    loaded = min(bt, num_tokens)  # a call of fewer tokens loads them all
    base = lax.axis_index("block") * bt
    start = jnp.minimum(base, num_tokens - loaded)  # the last block's window ends at T
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # whole rows: one bulk copy, no tensor map
    plgpu.copy_gmem_to_smem(latent_ref.at[pl.ds(start, loaded)], latent_s.at[pl.ds(0, loaded)], loaded_bar,
                            oob_mode=in_bounds)
    plgpu.copy_gmem_to_smem(rope_ref.at[pl.ds(start, loaded)], rope_s.at[pl.ds(0, loaded)], loaded_bar,
                            oob_mode=in_bounds)
    plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(base, bt)], rows_s, loaded_bar, oob_mode=in_bounds)
    plgpu.barrier_wait(loaded_bar)

    if stage_latent:
        group = config.group_rows
        layout = row_layout(latent_s.shape[1], latent_s.dtype)

        def convert(g, carry):
            rows = pl.ds(g * group, group)
            x = plgpu.load(latent_s.at[rows], layout=layout).astype(jnp.float32)
            if quantize:
                scale = per_token_scale(x)
                scale_b = plgpu.layout_cast(lax.broadcast_in_dim(scale, x.shape, [0]), layout)
                latent_stage[rows, :] = saturate_to_e4m3(x / scale_b)
                scale_s[rows] = scale
            else:
                latent_stage[rows, :] = x.astype(latent_stage.dtype)
            return carry

        lax.fori_loop(0, bt // group, convert, None)
    if stage_rope:
        rope_stage[...] = rope_s[...].astype(jnp.float32).astype(rope_stage.dtype)
    plgpu.commit_smem()  # the staged bytes -> visible to the TMA stores (and scale_s to all threads)

    shift = base - start  # window position of the block's first token

    def store(j):
        row = rows_s[j]

        @pl.when(row >= 0)
        def _():
            t = j + shift
            plgpu.copy_smem_to_gmem(latent_stage.at[t], latent_out.at[row], commit_group=False)
            plgpu.copy_smem_to_gmem(rope_stage.at[t], rope_out.at[row], commit_group=False)
            if quantize:
                outs[1][row] = scale_s[t]

    def store_all(first: int | jax.Array, step: int):
        lax.fori_loop(0, bt // step, lambda i, carry: store(first + i * step), None)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads

    if config.stores_by_warps and not interpret:
        plgpu.warp_map(lambda warp: store_all(warp, WARPS))  # a TMA's issuing thread waits for its own
    else:
        store_all(0, 1)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def write_kv_pallas(cache_arrays: tuple, latent: jax.Array, k_rope: jax.Array, rows: jax.Array,
                    *, interpret: bool = False, config: WriteKVConfig = WriteKVConfig()) -> tuple:
    """Scatter ``T`` new tokens into flattened cache arrays (shapes in the module docstring).

    cache_arrays: (latent [N, R] e4m3, scale [N] f32, rope [N, Dr] bf16) for an fp8
                  cache, or (latent [N, R] bf16, rope [N, Dr] bf16) for a bf16 one.
    latent [T, R], k_rope [T, Dr] (bf16/f16/f32); rows [T] int32 in [-1, N).
    Returns the updated arrays (aliased to the inputs). Two tokens naming one row leave it
    holding bytes of either (their stores are not ordered). ValueError for R or Dr not
    multiples of 64 (``kernel_takes``).
    """
    quantize = len(cache_arrays) == 3
    num_tokens, rank = latent.shape
    rope_dim = k_rope.shape[1]
    if not kernel_takes(rank, rope_dim):
        raise ValueError(f"latent, k_rope: the Mosaic write takes widths that are multiples of {DIM_MULTIPLE}, "
                         f"got {rank} and {rope_dim}; use write_kv_reference")
    if num_tokens == 0:
        return tuple(cache_arrays)
    latent_c, rope_c = cache_arrays[0], cache_arrays[-1]
    bt = config.block_tokens
    num_blocks = pl.cdiv(num_tokens, bt)
    rows = jnp.pad(rows.astype(jnp.int32), (0, num_blocks * bt - num_tokens), constant_values=-1)
    stage_latent = quantize or latent.dtype != latent_c.dtype
    stage_rope = k_rope.dtype != rope_c.dtype
    scratch = [plgpu.SMEM((bt, rank), latent.dtype), plgpu.SMEM((bt, rope_dim), k_rope.dtype),
               plgpu.SMEM((bt,), jnp.int32)]
    scratch += [plgpu.SMEM((bt, rank), latent_c.dtype)] if stage_latent else []
    scratch += [plgpu.SMEM((bt,), jnp.float32)] if quantize else []
    scratch += [plgpu.SMEM((bt, rope_dim), rope_c.dtype)] if stage_rope else []
    scratch += [plgpu.Barrier(num_arrivals=3)]
    kernel = pl.kernel(
        functools.partial(_write_kv_kernel, scratch_types=scratch, quantize=quantize, stage_latent=stage_latent,
                          stage_rope=stage_rope, num_tokens=num_tokens, config=config, interpret=interpret),
        out_type=(),
        mesh=plgpu.Mesh(grid=(num_blocks,), grid_names=("block",)),
        # Lane semantics: the row layout and the per-row copies are written for it. No automatic
        # barriers around SMEM accesses: commit_smem orders the staging stores before the reads
        # and TMA stores that follow, and nothing else is shared between threads.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        name="snapmla_write_kv",
    )

    def write(cache_refs):  # the kernel writes the cache arrays' buffers: aliased input->output
        kernel(rows, latent, k_rope, *cache_refs)

    return pl.run_state(write)(tuple(cache_arrays))


def write_kv_reference(cache_arrays: tuple, latent: jax.Array, k_rope: jax.Array, rows: jax.Array) -> tuple:
    """Pure-jnp twin of ``write_kv_pallas`` (same arguments, same math, XLA scatter; any widths)."""
    num_rows = cache_arrays[0].shape[0]
    # Out-of-range rows are dropped by the scatter: -1 becomes num_rows.
    idx = jnp.where(rows >= 0, rows, num_rows)
    if len(cache_arrays) == 3:
        latent_c, scale_c, rope_c = cache_arrays
        q, scale = quantize_per_token(latent)
        return (latent_c.at[idx].set(q, mode="drop"),
                scale_c.at[idx].set(scale, mode="drop"),
                rope_c.at[idx].set(k_rope.astype(rope_c.dtype), mode="drop"))
    latent_c, rope_c = cache_arrays
    return (latent_c.at[idx].set(latent.astype(latent_c.dtype), mode="drop"),
            rope_c.at[idx].set(k_rope.astype(rope_c.dtype), mode="drop"))
