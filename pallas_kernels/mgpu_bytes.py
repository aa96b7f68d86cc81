"""Byte packing for the Mosaic GPU decode kernel, one PTX instruction per 32-bit register.

The FP8 P'.V wgmma needs both operands with tokens contiguous, and Mosaic GPU
has no 8-bit transpose, so the kernel packs token pairs into 16-bit words
(``mla_decode_mgpu``'s docstring, "V transpose and P' packing"). Written with
jnp ops, that packing widens every byte to 16 bits, shifts and ORs: on an H100
it cost a third of the kernel's time (scripts/probe_mgpu_costs.py,
2026-11-23), because LLVM handles the 2 x 8-bit registers of the WGMMA layout
byte by byte. Here each 32-bit register is built by one instruction:
``interleave_bytes``, two 8-bit tiles -> uint16 words (``prmt.b32``).

(f32 -> e4m3 needs no helper: Mosaic GPU's ``astype`` already converts two
values per ``cvt.rn.satfinite.e4m3x2.f32``. A helper that also paired two
tiles' roundings into words served the kernel while each warpgroup held a
whole P' tile; since the warpgroups split the score tile, P' crosses between
them as bytes and is interleaved here.)

It takes and returns arrays in the WGMMA layout (register i of every array
holds the same two elements), runs in a warpgroup context, and exists on the
GPU only: the interpreter has no inline PTX, so the kernel's interpreter path
keeps P' unpacked and V token-major instead. Reference semantics, for tests:
``word = lo | hi << 8`` on the bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm


def _words_result(shape) -> plgpu.ShapeDtypeStruct:
    return plgpu.ShapeDtypeStruct(tuple(shape), jnp.uint16, layout=plgpu.Layout.WGMMA)


def _check_pair(lo: jax.Array, hi: jax.Array, dtypes: tuple, name: str) -> None:
    if lo.shape != hi.shape or lo.dtype != hi.dtype or lo.dtype not in dtypes:
        raise ValueError(f"{name}: expected two arrays of one shape and dtype in {dtypes}, "
                         f"got {lo.shape} {lo.dtype} and {hi.shape} {hi.dtype}")


def interleave_bytes(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """8-bit [M, N] x 2 (WGMMA layout) -> uint16 [M, N] words ``lo | hi << 8`` (bits, not values)."""
    _check_pair(lo, hi, (jnp.float8_e4m3fn, jnp.uint8), "interleave_bytes")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA), return_type=_words_result(lo.shape))
    def interleave(ctx, lo_fa, hi_fa):
        del ctx
        i16 = ir.IntegerType.get_signless(16)
        i32 = ir.IntegerType.get_signless(32)
        words_ty = ir.VectorType.get((2,), i16)
        out = np.empty_like(lo_fa.registers)
        for idx, lo_reg in np.ndenumerate(lo_fa.registers):
            widen = lambda reg: arith.extui(i32, mgpu_utils.bitcast(reg, i16))
            # prmt picks result bytes (lo0, hi0, lo1, hi1) from {hi, lo}'s bytes 0, 4, 1, 5.
            word_pair = llvm.inline_asm(i32, [widen(lo_reg), widen(hi_fa.registers[idx])],
                                        "prmt.b32 $0, $1, $2, 0x5140;", "=r,r,r")
            out[idx] = mgpu_utils.bitcast(word_pair, words_ty)
        return mgpu.FragmentedArray(_registers=out, _layout=lo_fa.layout, _is_signed=False)

    return interleave(lo, hi)
