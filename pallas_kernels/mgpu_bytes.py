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
from jaxlib.mlir.dialects import arith, llvm, nvvm, vector

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


def _check_half_tile_store(name: str, values, dst_ref, lane) -> None:
    """ValueError naming ``name``'s argument unless values is e4m3 [64, 64], dst_ref an e4m3 [64, 128]
    tile and lane 0, 1 or None."""
    if values.dtype != jnp.float8_e4m3fn or tuple(values.shape) != (64, SWIZZLE // 2):
        raise ValueError(f"{name}: values: expected e4m3 [64, {SWIZZLE // 2}], got {values.shape} {values.dtype}")
    if tuple(dst_ref.shape) != (64, SWIZZLE) or dst_ref.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{name}: dst_ref: expected e4m3 [64, {SWIZZLE}], got {dst_ref.shape} {dst_ref.dtype}")
    if lane not in (0, 1, None):
        raise ValueError(f"{name}: lane: expected 0, 1 or None, got {lane!r}")


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
    _check_half_tile_store("store_byte_lane", values, dst_ref, lane)

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
                offset = _swizzled_offset(row, byte_col)
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


# --- V^T as the register A operand of O^T = V^T.P'^T (``mla_decode_mgpu.PV_TRANSPOSED``) ---------
#
# Hopper's 8-bit wgmma wants both SMEM operands K-major (tokens contiguous for P'.V), while the cache
# holds V token-major. Its A operand may come from registers instead, in the 8-bit WGMMA layout: a
# thread of warp w, lane 4g + q, holds rows 16w + 8h + g (h < 2) and the four columns 16J + 4q .. + 3.
# ``ldmatrix.trans`` on 16-bit elements hands lane 4g + q the byte pair (features 2g, 2g + 1) of two
# consecutive matrix rows (tokens), and one ``prmt`` a register pair regroups two such pairs into
# one feature's four tokens. So V^T reaches the tensor cores without a transposed copy in SMEM; the
# price is two relabellings that no value pays for by moving between threads:
# * rows: A row 16w + 8h + g holds feature 16w + 2g + h of the 64 (``vt_feature``);
# * columns (K): column 16J + 4q + e holds step row 16J + 8(e // 2) + 2q + e % 2 (``vt_step_row``),
#   which is where the fp32 WGMMA layout keeps score column 16J + 8a + 2q + e' (a = e // 2, e' = e % 2)
#   in register j' = 2J + a: P' reaches this order by concatenating register pairs (``store_quads``).

# prmt selectors: from two ldmatrix.trans registers (tokens r, r + 1 of matrices X, Y; bytes
# [X_r f0, X_r f1, X_r+1 f0, X_r+1 f1]) the four tokens of feature f0, and of f1.
_FEATURE_0, _FEATURE_1 = 0x6420, 0x7531


def vt_feature(row: int) -> int:
    """The feature (of 64) that row ``row`` of ``load_vt_quads``' operand, and of the product it
    makes, holds: within each 16, row 8h + g holds feature 2g + h."""
    group, rest = divmod(row, 16)
    return 16 * group + 2 * (rest % 8) + rest // 8


def vt_step_row(column: int) -> int:
    """The step row (of 128) that K column ``column`` of ``load_vt_quads``' operand holds, and so
    the P' column that ``store_quads`` puts there: within each 16, column 4q + e holds row
    8 (e // 2) + 2q + e % 2."""
    group, rest = divmod(column, 16)
    q, e = divmod(rest, 4)
    return 16 * group + 8 * (e // 2) + 2 * q + e % 2


def _swizzled_offset(row, byte_col, *, tiles_per_row: int = 1):
    """Byte offset of (row, byte_col) in a tile tiled (8, 128 bytes) with the 128-byte swizzle:
    tiles of 8 rows x 128 bytes, ``tiles_per_row`` of them side by side, each row's 16-byte chunks
    XOR-swizzled by its index in the tile (i32 values or python ints in, i32 value out)."""
    i32 = ir.IntegerType.get_signless(32)
    c32 = lambda v: v if isinstance(v, ir.Value) else mgpu_utils.c(v, i32)
    row, byte_col = c32(row), c32(byte_col)
    tile = arith.addi(arith.muli(arith.shrui(row, c32(3)), c32(tiles_per_row)),
                      arith.shrui(byte_col, c32(7)))
    in_row = arith.andi(byte_col, c32(SWIZZLE - 1))
    row_in_tile = arith.andi(row, c32(7))
    chunk = arith.xori(arith.shrui(in_row, c32(4)), row_in_tile)
    return arith.addi(arith.addi(arith.muli(tile, c32(8 * SWIZZLE)), arith.muli(row_in_tile, c32(SWIZZLE))),
                      arith.addi(arith.shli(chunk, c32(4)), arith.andi(in_row, c32(15))))


def load_vt_quads(chunk_ref, tile: int, visible=None) -> jax.Array:
    """V^T of 64 features of a step's V chunk, as the 8-bit register A operand of an FP8 wgmma:
    e4m3 [64, 128] in the 8-bit WGMMA layout, row r holding feature 64 tile + ``vt_feature(r)``
    and column k step row ``vt_step_row(k)`` of ``chunk_ref`` (e4m3 [128 step rows, 128 features]
    in the FP8 wgmma's tiled, swizzled SMEM layout).

    ``visible``: None, or int32 [64] (the ``ROW`` layout of the 64-row kernel, one value
    throughout) the number of the step's tokens below seq_len, the step's first token t0 being
    step row 0, token t0 + 2c + 1 row 64 + c: the bytes of tokens past it are zeroed (cache slots
    past seq_len may hold NaN, and 0 * NaN would poison the product).

    One ``ldmatrix.x4.trans`` (32 step rows x 16 features a warp) and four ``prmt`` make a K block
    of 32 columns; GPU only (inline PTX).
    """
    if tuple(chunk_ref.shape) != (128, SWIZZLE) or chunk_ref.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"load_vt_quads: chunk_ref: expected e4m3 [128, {SWIZZLE}], got {chunk_ref.shape} "
                         f"{chunk_ref.dtype}")
    if tile not in (0, 1):
        raise ValueError(f"load_vt_quads: tile: expected 0 or 1, got {tile!r}")
    arg_types = (plgpu.RefType(BYTE_TILE_TRANSFORMS),) + ((plgpu.Layout.WGMMA.reduce(1),) if visible is not None
                                                          else ())
    result = plgpu.ShapeDtypeStruct((64, 128), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=result)
    def load(ctx, src, *visible_fa):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i32 = ir.IntegerType.get_signless(32)
        c32 = lambda v: mgpu_utils.c(v, i32)
        layout = mgpu.WGMMA_LAYOUT_8BIT
        reg_ty = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        regs_shape = layout.registers_shape((64, 128))
        if regs_shape != (1, 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"load_vt_quads: unexpected 8-bit WGMMA registers {regs_shape}")
        base = mgpu_utils.memref_ptr(src)
        tid = mgpu_utils.thread_idx()
        lane = arith.andi(tid, c32(31))
        warp = arith.andi(arith.shrui(tid, c32(5)), c32(3))
        q = arith.andi(lane, c32(3))
        # This lane's row address for matrix lane // 8: step row 32 b + lane, 16-byte segment
        # 4 tile + warp (the warp's 16 features).
        segment_bytes = arith.shli(arith.addi(warp, c32(4 * tile)), c32(4))
        limit = None
        if visible_fa:
            limit = visible_fa[0].registers.flat[0]
            if isinstance(limit.type, ir.VectorType):
                limit = vector.extract(limit, dynamic_position=[], static_position=[0])
        shape_attr = ir.Attribute.parse("#nvvm.ld_st_matrix_shape<m=8, n=8>")
        out = np.empty(regs_shape, dtype=object)
        for block in range(4):  # K blocks of 32 step rows
            row = arith.addi(lane, c32(32 * block))
            offset = _swizzled_offset(row, segment_bytes)
            ptr = mgpu_utils.getelementptr(base, [offset], i8)
            loaded = nvvm.ldmatrix(ptr, layout=nvvm.MMALayout.col, num=4, shape=shape_attr,
                                   elt_type=nvvm.LdStMatrixEltType.B16)
            parts = [llvm.extractvalue(i32, loaded, [k]) for k in range(4)]
            for j in range(2):
                x, y = parts[2 * j], parts[2 * j + 1]
                mask = None
                if limit is not None:
                    mask = c32(0)
                    for e in range(4):
                        # Step row 32 block + 16 j + 8 (e // 2) + 2q + e % 2; its token's offset from
                        # t0 is twice its index in its half, plus 1 in the odd half (rows 64..127).
                        half_row = 32 * (block % 2) + 16 * j + 8 * (e // 2) + e % 2
                        token = arith.addi(arith.shli(q, c32(2)), c32(2 * half_row + block // 2))
                        seen = arith.cmpi(arith.CmpIPredicate.slt, token, limit)
                        mask = arith.ori(mask, arith.select(seen, c32(0xFF << (8 * e)), c32(0)))
                for h, selector in enumerate((_FEATURE_0, _FEATURE_1)):
                    word = llvm.inline_asm(i32, [x, y], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r")
                    if mask is not None:
                        word = arith.andi(word, mask)
                    out[0, 2 * block + j, 0, 0, h, 0, 0, 0, 0] = mgpu_utils.bitcast(word, reg_ty)
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return load(chunk_ref, *(() if visible is None else (visible,)))


def store_quads(values: jax.Array, dst_ref, lane: int | None) -> None:
    """Store e4m3 [64, 64] (WGMMA layout, score columns in step-row order) into columns
    [64 lane, 64 lane + 64) of an e4m3 [64, 128] SMEM tile in ``vt_step_row`` order: column 64 lane
    + k of the tile takes column ``vt_step_row(k)`` of ``values`` (lane 0 or 1; None: the calling
    warpgroup's index mod 2).

    No value moves between threads: a thread's registers j' = 2J, 2J + 1 hold exactly the four
    columns that land at 16J + 4q .. + 3, stored as one 32-bit word (``st.shared.b32``).
    ``dst_ref`` as ``store_byte_lane``'s; make the stores visible to wgmma with
    ``plgpu.commit_smem`` and a barrier.
    """
    _check_half_tile_store("store_quads", values, dst_ref, lane)
    rows, cols = values.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(BYTE_TILE_TRANSFORMS)))
    def store(ctx, values_fa, dst):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i32 = ir.IntegerType.get_signless(32)
        c32 = lambda v: mgpu_utils.c(v, i32)
        base = mgpu_utils.memref_ptr(dst)
        lane_value = (arith.andi(mgpu_utils.warpgroup_idx(), c32(1)) if lane is None else c32(lane))
        regs = values_fa.registers
        if regs.shape != (1, 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"store_quads: unexpected WGMMA registers {regs.shape}")
        idxs = list(values_fa.layout.thread_idxs((rows, cols)))
        for flat, idx in enumerate(np.ndindex(regs.shape)):
            if idx[1] % 2:
                continue  # stored with its even partner
            row, col = (arith.index_cast(i32, v) for v in idxs[flat])
            pair = [regs[idx], regs[(idx[0], idx[1] + 1, *idx[2:])]]
            word = mgpu_utils.bitcast(mgpu_utils.vector_concat(pair), i32)
            # col = 16J + 2q holds (with its partner) columns 16J + 4q .. + 3 of the tile's half.
            quad_col = arith.addi(col, arith.andi(col, c32(15)))
            byte_col = arith.addi(arith.shli(lane_value, c32(6)), quad_col)
            llvm.store(word, mgpu_utils.getelementptr(base, [_swizzled_offset(row, byte_col)], i8))

    store(values, dst_ref)


def output_transforms(dtype) -> tuple:
    """The SMEM transforms of ``store_feature_pairs``' staging tile: (8 rows, 128 bytes) tiles with
    the 128-byte swizzle (what the TMA reads it through)."""
    return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE))


def store_feature_pairs(values: jax.Array, dst_ref) -> None:
    """Store O^T f32 [64 features, 64 rows] (WGMMA layout, rows in ``vt_feature`` order: a product
    with ``load_vt_quads``' operand) as [64 rows, 64 features] into ``dst_ref`` (bf16 or f32
    [64, 64], ``output_transforms``), each feature in its place.

    A thread holds rows 8h + g (h < 2) of its warp's 16, features 2g and 2g + 1: both values of a
    query row go out as one 4-byte (bf16) or 8-byte (f32) store, no value moving between threads.
    """
    if values.dtype != jnp.float32 or values.shape != (64, 64):
        raise ValueError(f"store_feature_pairs: values: expected f32 [64, 64], got {values.shape} {values.dtype}")
    if tuple(dst_ref.shape) != (64, 64) or dst_ref.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"store_feature_pairs: dst_ref: expected bf16 or f32 [64, 64], got {dst_ref.shape} "
                         f"{dst_ref.dtype}")
    out_dtype = jnp.dtype(dst_ref.dtype)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(output_transforms(out_dtype))))
    def store(ctx, values_fa, dst):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i32 = ir.IntegerType.get_signless(32)
        c32 = lambda v: mgpu_utils.c(v, i32)
        f32 = ir.F32Type.get()
        bf16 = ir.BF16Type.get()
        base = mgpu_utils.memref_ptr(dst)
        regs = values_fa.registers
        if regs.shape != (1, 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"store_feature_pairs: unexpected WGMMA registers {regs.shape}")
        itemsize = out_dtype.itemsize
        idxs = list(values_fa.layout.thread_idxs((64, 64)))
        for flat, idx in enumerate(np.ndindex(regs.shape)):
            if idx[4]:
                continue  # h = 1: stored with its h = 0 partner
            row, col = (arith.index_cast(i32, v) for v in idxs[flat])
            # row = 16w + g (h = 0): features 16w + 2g and + 1; col = 8j' + 2q and + 1: query rows.
            feature = arith.addi(arith.andi(row, c32(~15)), arith.shli(arith.andi(row, c32(7)), c32(1)))
            lo, hi = regs[idx], regs[(*idx[:4], 1, *idx[5:])]
            for e in range(2):
                pick = lambda reg: vector.extract(reg, dynamic_position=[], static_position=[e])
                pair = [pick(lo), pick(hi)]
                if itemsize == 2:
                    pair = [arith.truncf(bf16, v) for v in pair]
                    word = mgpu_utils.bitcast(vector.from_elements(ir.VectorType.get((2,), bf16), pair), i32)
                else:
                    word = vector.from_elements(ir.VectorType.get((2,), f32), pair)
                offset = _swizzled_offset(arith.addi(col, c32(e)), arith.muli(feature, c32(itemsize)),
                                          tiles_per_row=64 * itemsize // SWIZZLE)
                llvm.store(word, mgpu_utils.getelementptr(base, [offset], i8))

    store(values, dst_ref)
