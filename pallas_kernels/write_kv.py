"""Fused per-token FP8 quantize + paged cache write (one pass over the new tokens).

Each program takes one new token: it computes amax over the latent, the scale
``max(amax, floor) / 448``, the saturated e4m3 latent, and stores latent, scale
and the BF16 RoPE part straight into the cache row given by ``rows`` (row =
flattened slot, -1 = nothing). The
cache arrays are aliased input->output, so under ``jax.jit`` with the cache
donated the write happens in place: no copy of the cache, no temporary.

Backend: Pallas' Triton lowering. The kernel is a scatter of whole rows at
computed row indices, which that lowering expresses
directly; it has no matrix products, so Mosaic GPU's warpgroup machinery buys
nothing here. The bf16 cache variant runs the same body without quantization.

Addressing: rows index a flattened [num_rows, R] view of the cache, so element
offsets are ``row * R`` in int32; LatentCache.create rejects caches past 2**31.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_tr

from snapmla_jax.quantization import quantize_per_token

NUM_WARPS = 2  # one token's 512 values: 8 per thread, the amax reduced within two warps


def _write_kv_kernel(rows_ref, latent_ref, rope_ref, *refs, quantize: bool):
    """One new token per program.

    rows_ref   [T] int32 (whole array) flattened cache row per token, -1 = skip
    latent_ref [R]        this token's latent (bf16/f32)
    rope_ref   [Dr]       this token's RoPE key (bf16/f32)
    refs       aliased cache inputs (unused: same buffers as the outputs), then outputs:
               latent_out [N, R] (e4m3 or bf16), [scale_out [N] f32,] rope_out [N, Dr] bf16

    One token per program (not a block of tokens with masked scatters): a
    skipped token then stores nothing at all, so no masked-off lane can alias
    a row that another token writes.
    """
    outs = refs[-(3 if quantize else 2):]
    row = rows_ref[pl.program_id(0)]

    @pl.when(row >= 0)
    def _store():
        latent = latent_ref[...].astype(jnp.float32)
        if quantize:
            latent_out, scale_out, rope_out = outs
            q, scale = quantize_per_token(latent)
            latent_out[row, :] = q
            scale_out[row] = scale
        else:
            latent_out, rope_out = outs
            latent_out[row, :] = latent.astype(latent_out.dtype)
        rope_out[row, :] = rope_ref[...].astype(rope_out.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv_pallas(cache_arrays: tuple, latent: jax.Array, k_rope: jax.Array, rows: jax.Array,
                    *, interpret: bool = False) -> tuple:
    """Scatter ``T`` new tokens into flattened cache arrays.

    cache_arrays: (latent [N, R] e4m3, scale [N] f32, rope [N, Dr] bf16) for an fp8
                  cache, or (latent [N, R] bf16, rope [N, Dr] bf16) for a bf16 one.
    latent [T, R], k_rope [T, Dr] (bf16/f32); rows [T] int32 in [-1, N).
    Returns the updated arrays (aliased to the inputs).
    """
    quantize = len(cache_arrays) == 3
    num_tokens, rank = latent.shape
    rope_dim = k_rope.shape[1]
    n_cache = len(cache_arrays)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_write_kv_kernel, quantize=quantize)
    return pl.pallas_call(
        kernel,
        grid=(num_tokens,),
        in_specs=[
            whole,
            pl.BlockSpec((None, rank), lambda i: (i, 0)),
            pl.BlockSpec((None, rope_dim), lambda i: (i, 0)),
            *([whole] * n_cache),
        ],
        out_specs=[whole] * n_cache,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache_arrays],
        input_output_aliases={3 + i: i for i in range(n_cache)},
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name="snapmla_write_kv",
    )(rows, latent, k_rope, *cache_arrays)


def write_kv_reference(cache_arrays: tuple, latent: jax.Array, k_rope: jax.Array, rows: jax.Array) -> tuple:
    """Pure-jnp twin of ``write_kv_pallas`` (same arguments, same math, XLA scatter)."""
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

