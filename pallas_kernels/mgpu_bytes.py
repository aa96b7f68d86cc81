"""Byte packing for the Mosaic GPU decode kernel, one PTX instruction per 32-bit register.

The FP8 P'.V wgmma needs both operands with tokens contiguous, and Mosaic GPU
has no 8-bit transpose, so the kernel packs token pairs into 16-bit words
(``mla_decode_mgpu``'s docstring, "V transpose and P' packing"). Written with
jnp ops, that packing widens every byte to 16 bits, shifts and ORs: on an H100
it cost a third of the kernel's time (scripts/probe_mgpu_costs.py,
2026-11-23), because LLVM handles the 2 x 8-bit registers of the WGMMA layout
byte by byte. Here each 32-bit register is built by one instruction:
``interleave_bytes``, two 8-bit tiles -> uint16 words (``prmt.b32``), and
``interleave_quads``, the same from tiles loaded 4 bytes a thread, its columns
relabelled within groups of 16 (``quad_column``; ``quads_in_order`` puts a product's
columns back).

(f32 -> e4m3 needs no helper: Mosaic GPU's ``astype`` already converts two
values per ``cvt.rn.satfinite.e4m3x2.f32``. A helper that also paired two
tiles' roundings into words served the kernel while each warpgroup held a
whole P' tile; P' now crosses between the warpgroups through
``store_byte_lane``.)

It takes and returns arrays in the WGMMA layout (register i of every array
holds the same two elements), runs in a warpgroup context, and exists on the
GPU only: the interpreter has no inline PTX, so the kernel's interpreter path
keeps P' unpacked and V token-major instead. Reference semantics, for tests:
``word = lo | hi << 8`` on the bytes.

``store_byte_lane``: each warpgroup's P' bytes straight into their places in
the one P' tile both warpgroups multiply (every other byte of a row; the
kernel's "V transpose and P' packing"), one byte store a value at addresses
computed here with the tile's 128-byte swizzle, instead of a byte tile each, a
barrier, and both tiles loaded back and interleaved (``interleave_bytes``, as
V's words still are). Same output bit for bit; 0.582 vs 0.585 ms at B=64 x 16k
x 128 and 0.562 vs 0.573 at 32 x 16k x 128 x 2 on an H100 (docs/benchmarks/
mgpu.md, sixteenth session).
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

# The SMEM layout ``store_byte_lane`` writes: the one the FP8 wgmma reads an 8-bit
# operand tile in (rows of 128 bytes in 8-row groups, each row's 16-byte chunks
# XOR-swizzled by the row's index in its group).
SWIZZLE = 128
BYTE_TILE_TRANSFORMS = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))


# prmt selectors turning 4 bytes of low tokens L and 4 of high tokens H into two word pairs:
# (L0, H0, L1, H1) and (L2, H2, L3, H3).
_FIRST_WORDS, _SECOND_WORDS = 0x5140, 0x7362


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
                                        f"prmt.b32 $0, $1, $2, {_FIRST_WORDS:#x};", "=r,r,r")
            out[idx] = mgpu_utils.bitcast(word_pair, words_ty)
        return mgpu.FragmentedArray(_registers=out, _layout=lo_fa.layout, _is_signed=False)

    return interleave(lo, hi)


def store_byte_lane(values: jax.Array, dst_ref, lane: int | None) -> None:
    """Store e4m3 [64, N] (WGMMA layout) into every other byte of an e4m3 [64, 2N] SMEM tile:
    ``dst[r, 2c + lane] = values[r, c]`` (lane 0 or 1; None: the calling warpgroup's index
    mod 2, computed on the GPU: no branch on a warpgroup id around the call, which made
    ptxas spill three times the registers in the decode kernel); the other lane's bytes are
    untouched.

    ``dst_ref``: a [64, 128] tile in the FP8 wgmma's layout (``BYTE_TILE_TRANSFORMS``).
    One ``st.shared.u8`` a value: two warpgroups fill the two lanes of one tile with no
    exchange (they must not store the same lane concurrently; make the stores visible to
    wgmma with ``plgpu.commit_smem`` and a barrier, as for any SMEM store).
    """
    rows, cols = values.shape
    if values.dtype != jnp.float8_e4m3fn or rows != 64 or 2 * cols != SWIZZLE:
        raise ValueError(f"store_byte_lane: values: expected e4m3 [64, {SWIZZLE // 2}], got {values.shape} "
                         f"{values.dtype}")
    if tuple(dst_ref.shape) != (64, SWIZZLE) or dst_ref.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"store_byte_lane: dst_ref: expected e4m3 [64, {SWIZZLE}], got {dst_ref.shape} "
                         f"{dst_ref.dtype}")
    if lane not in (0, 1, None):
        raise ValueError(f"store_byte_lane: lane: expected 0, 1 or None, got {lane!r}")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(BYTE_TILE_TRANSFORMS)))
    def store(ctx, values_fa, dst):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i16 = ir.IntegerType.get_signless(16)
        i32 = ir.IntegerType.get_signless(32)
        c32 = lambda v: mgpu_utils.c(v, i32)
        base = mgpu_utils.memref_ptr(dst)
        lane_value = (arith.andi(mgpu_utils.warpgroup_idx(), c32(1)) if lane is None else c32(lane))
        shape = tuple(values_fa.shape)
        for (row, col), reg in zip(values_fa.layout.thread_idxs(shape), values_fa.registers.flat):
            row = arith.index_cast(i32, row)
            col = arith.index_cast(i32, col)
            pair = mgpu_utils.bitcast(reg, i16)  # columns col, col + 1: low byte, high byte
            for k in range(2):
                byte_col = arith.addi(arith.muli(arith.addi(col, c32(k)), c32(2)), lane_value)
                # Row r is 128 contiguous bytes (a [64, 128] tile's (8, 128) tiles follow one
                # another); its 16-byte chunk j sits at chunk j ^ (r % 8).
                chunk = arith.xori(arith.shrui(byte_col, c32(4)), arith.andi(row, c32(7)))
                offset = arith.addi(arith.addi(arith.muli(row, c32(SWIZZLE)), arith.shli(chunk, c32(4))),
                                    arith.andi(byte_col, c32(15)))
                byte = arith.trunci(i8, arith.shrui(pair, mgpu_utils.c(8 * k, i16)) if k else pair)
                llvm.store(byte, mgpu_utils.getelementptr(base, [offset], i8))

    store(values, dst_ref)


def quad_column(logical: int) -> int:
    """The column of an 8-bit tile whose words ``interleave_quads`` puts at column ``logical``:
    within each 16 columns, logical 2q + e holds column 4q + e and logical 8 + 2q + e holds
    column 4q + 2 + e (q < 4, e < 2)."""
    group, offset = divmod(logical, 16)
    half, rest = divmod(offset, 8)
    return 16 * group + 4 * (rest // 2) + 2 * half + rest % 2


def interleave_quads(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """8-bit [64, N] x 2 in the 8-bit WGMMA layout (4 bytes a register) -> uint16 [64, N] words
    ``lo | hi << 8`` in the WGMMA layout, columns relabelled: column l of the result holds the
    words of column ``quad_column(l)``.

    Loading 8-bit tiles in the 8-bit layout moves 4 bytes a thread, a whole 128-byte wavefront a
    warp instruction, where the WGMMA layout's 2 bytes fill half of one. In the 8-bit layout a
    thread holds columns 16j + 4q .. 16j + 4q + 3 of a row; in the WGMMA layout it holds 8j' +
    2q and 8j' + 2q + 1. Two ``prmt`` a register pair build the four words, and placing them at
    j' = 2j and 2j + 1 moves nothing between threads; the price is the relabelling, which a
    consumer of the words undoes (``quads_in_order``).
    """
    _check_pair(lo, hi, (jnp.float8_e4m3fn, jnp.uint8), "interleave_quads")
    rows, cols = lo.shape
    if rows != 64 or cols % 16:
        raise ValueError(f"interleave_quads: expected [64, N] tiles with N a multiple of 16, got {lo.shape}")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.Layout.WGMMA_8BIT),
                       return_type=_words_result(lo.shape))
    def interleave(ctx, lo_fa, hi_fa):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        words_ty = ir.VectorType.get((2,), ir.IntegerType.get_signless(16))
        out_layout = mgpu.WGMMA_LAYOUT
        out = np.empty(out_layout.registers_shape((rows, cols)), dtype=object)
        for idx, lo_reg in np.ndenumerate(lo_fa.registers):
            lo32 = mgpu_utils.bitcast(lo_reg, i32)
            hi32 = mgpu_utils.bitcast(hi_fa.registers[idx], i32)
            for half, selector in enumerate((_FIRST_WORDS, _SECOND_WORDS)):
                pair = llvm.inline_asm(i32, [lo32, hi32], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r")
                out[(idx[0], 2 * idx[1] + half, *idx[2:])] = mgpu_utils.bitcast(pair, words_ty)
        assert all(reg is not None for reg in out.flat)
        return mgpu.FragmentedArray(_registers=out, _layout=out_layout, _is_signed=False)

    return interleave(lo, hi)


def quads_in_order(values: jax.Array) -> jax.Array:
    """f32 [64, N] in the WGMMA layout whose column l holds column ``quad_column(l)`` of a
    result (a product with ``interleave_quads``' words as its rows) -> the same values with each
    column in its place, in the 8-bit WGMMA layout's assignment of columns to threads.

    No value moves: a thread's registers at j' = 2j and 2j + 1 hold columns 16j + 4q ..
    16j + 4q + 3, four consecutive ones, which is how the 8-bit layout (a layout of any element
    type) assigns columns. Mosaic stores such an array as any other.
    """
    rows, cols = values.shape
    if values.dtype != jnp.float32 or rows != 64 or cols % 16:
        raise ValueError(f"quads_in_order: values: expected f32 [64, N] with N a multiple of 16, got "
                         f"{values.shape} {values.dtype}")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((rows, cols), jnp.float32,
                                                          layout=plgpu.Layout.WGMMA_8BIT))
    def relabel(ctx, values_fa):
        del ctx
        out_layout = mgpu.WGMMA_LAYOUT_8BIT
        out = np.empty(out_layout.registers_shape((rows, cols)), dtype=object)
        regs = values_fa.registers
        for idx in np.ndindex(out.shape):
            pair = [regs[(idx[0], 2 * idx[1] + half, *idx[2:])] for half in range(2)]
            out[idx] = mgpu_utils.vector_concat(pair)
        return mgpu.FragmentedArray(_registers=out, _layout=out_layout, _is_signed=None)

    return relabel(values)
