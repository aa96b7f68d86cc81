"""The Triton launch ``write_kv_pallas`` replaced, kept for one side-by-side timing.

``python -m snapmla_jax.bench write --backends pallas triton xla`` times it beside the Mosaic GPU
kernel (``write_kv.py``); delete this module once that measurement is in the docs. Same
arguments and bytes as ``write_kv.write_kv_pallas``: one program takes 4 tokens in turn, one warp
a token (amax by shuffles, scale, saturated cast, stores to the row given at run time).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_tr

from snapmla_jax.pallas_kernels.fp8 import quantize_per_token

# H100, fp8 cache, 256k tokens: 4 tokens x 1 warp reached 0.81 of copy bandwidth; 1 token x
# 2 warps 0.74; 4 warps 0.59-0.64.
TOKENS_PER_PROGRAM = 4  # tokens handled in turn by one program (unrolled)
NUM_WARPS = 1  # one warp holds a token's 512 values (16 per thread); amax by shuffles


def _write_kv_kernel(rows_ref, latent_ref, rope_ref, *refs, quantize: bool, num_tokens: int,
                     tokens_per_program: int):
    """A block of new tokens, one after the other.

    rows_ref   [T] int32 (whole array) flattened cache row per token, -1 = skip
    latent_ref [TPP, R]   this block's latents (bf16/f32; rows past T undefined)
    rope_ref   [TPP, Dr]  this block's RoPE keys (bf16/f32)
    refs       aliased cache inputs (unused: same buffers as the outputs), then outputs:
               latent_out [N, R] (e4m3 or bf16), [scale_out [N] f32,] rope_out [N, Dr] bf16

    Each token is stored under its own ``pl.when`` rather than as one masked
    scatter of the block: a skipped token then stores nothing at all, so no
    masked-off lane can alias a row that another token writes.
    """
    outs = refs[-(3 if quantize else 2):]
    for i in range(tokens_per_program):
        token = pl.program_id(0) * tokens_per_program + i
        row = rows_ref[jnp.minimum(token, num_tokens - 1)]

        @pl.when((row >= 0) & (token < num_tokens))
        def _store():
            latent = latent_ref[i, :].astype(jnp.float32)
            if quantize:
                latent_out, scale_out, rope_out = outs
                q, scale = quantize_per_token(latent)
                latent_out[row, :] = q
                scale_out[row] = scale
            else:
                latent_out, rope_out = outs
                latent_out[row, :] = latent.astype(latent_out.dtype)
            rope_out[row, :] = rope_ref[i, :].astype(rope_out.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv_triton(cache_arrays: tuple, latent: jax.Array, k_rope: jax.Array, rows: jax.Array,
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
    tpp = TOKENS_PER_PROGRAM
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_write_kv_kernel, quantize=quantize, num_tokens=num_tokens,
                               tokens_per_program=tpp)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, tpp),),
        in_specs=[
            whole,
            pl.BlockSpec((tpp, rank), lambda i: (i, 0)),
            pl.BlockSpec((tpp, rope_dim), lambda i: (i, 0)),
            *([whole] * n_cache),
        ],
        out_specs=[whole] * n_cache,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache_arrays],
        input_output_aliases={3 + i: i for i in range(n_cache)},
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name="snapmla_write_kv_triton",
    )(rows, latent, k_rope, *cache_arrays)
