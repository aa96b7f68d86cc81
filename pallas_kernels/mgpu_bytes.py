"""Inline-PTX operand helpers of the Mosaic GPU FP8 decode kernel's transposed P'.V.

Hopper's 8-bit wgmma wants both SMEM operands K-major (tokens contiguous for
P'.V), the cache holds V token-major, and Mosaic GPU has no 8-bit transpose. So
``mla_decode_mgpu`` computes O^T = V^T.P'^T with V^T as the wgmma's register A
operand, and these helpers build and unbuild that layout without moving a value
between threads (the section comment below has the layouts):

- ``load_vt_quads``: V^T from the token-major ring slot, one ``ldmatrix.x4.trans``
  and four ``prmt`` a K block of 32 tokens, tokens past a count zeroed;
- ``store_quads``: a warpgroup's half of P' (fp32 WGMMA layout, cast to e4m3) into
  the shared B operand tile as 4-byte words, in V^T's token order;
- ``store_feature_pairs``: an O^T tile back into row-major order, its features in
  place, for the output's TMA;
- ``vt_feature`` / ``vt_step_row``: the relabellings, for tests and the interpreter.

They run in a warpgroup context and exist on the GPU only: the interpreter has
no inline PTX, so the kernel's interpreter path reads V transposed as an SMEM
operand and stores P' unpacked instead.
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

# The SMEM layout ``load_vt_quads`` reads and ``store_quads`` writes: the one the FP8 wgmma reads
# an 8-bit operand tile in (rows of 128 bytes in 8-row groups, each row's 16-byte chunks
# XOR-swizzled by the row's index in its group).
SWIZZLE = 128
BYTE_TILE_TRANSFORMS = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))


# --- V^T as the register A operand of O^T = V^T.P'^T (``mla_decode_mgpu.pv_update_t``) ---------
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


def _byte_addressing(ref) -> tuple:
    """(i8, i32, c32, base) for the inline byte loads and stores below: the two integer types, a
    maker of i32 constants and the pointer to ``ref``'s first byte."""
    i32 = ir.IntegerType.get_signless(32)
    return ir.IntegerType.get_signless(8), i32, (lambda v: mgpu_utils.c(v, i32)), mgpu_utils.memref_ptr(ref)


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
        layout = mgpu.WGMMA_LAYOUT_8BIT
        reg_ty = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        regs_shape = layout.registers_shape((64, 128))
        if regs_shape != (1, 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"load_vt_quads: unexpected 8-bit WGMMA registers {regs_shape}")
        i8, i32, c32, base = _byte_addressing(src)
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
    ``dst_ref``: a [64, 128] tile in the FP8 wgmma's layout (``BYTE_TILE_TRANSFORMS``); make the
    stores visible to wgmma with ``plgpu.commit_smem`` and a barrier.
    """
    if values.dtype != jnp.float8_e4m3fn or tuple(values.shape) != (64, SWIZZLE // 2):
        raise ValueError(f"store_quads: values: expected e4m3 [64, {SWIZZLE // 2}], got {values.shape} "
                         f"{values.dtype}")
    if tuple(dst_ref.shape) != (64, SWIZZLE) or dst_ref.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"store_quads: dst_ref: expected e4m3 [64, {SWIZZLE}], got {dst_ref.shape} {dst_ref.dtype}")
    if lane not in (0, 1, None):
        raise ValueError(f"store_quads: lane: expected 0, 1 or None, got {lane!r}")
    rows, cols = values.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(BYTE_TILE_TRANSFORMS)))
    def store(ctx, values_fa, dst):
        del ctx
        i8, i32, c32, base = _byte_addressing(dst)
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


def vt_column(step_row: int) -> int:
    """The K column of ``load_vt_quads``' operand that holds step row ``step_row``: the inverse of
    ``vt_step_row`` (within each 16, row 8a + 2q + e sits at column 4q + 2a + e)."""
    group, rest = divmod(step_row, 16)
    a, rest = divmod(rest, 8)
    q, e = divmod(rest, 2)
    return 16 * group + 4 * q + 2 * a + e


def store_token_bytes(values: jax.Array, dst_ref) -> None:
    """Store P'^T e4m3 [64 tokens, N query rows] (WGMMA layout: the calling warpgroup's half of a
    step, step rows 64 wg + m, wg its index mod 2) into ``dst_ref`` e4m3 [N, 128] as P', the
    K-major B operand of a product with ``load_vt_quads``' operand: step row r to column
    ``vt_column(r)`` of each query row.

    The tokens a thread holds are not neighbours in that order, so each value is one byte
    store (8 a thread at N = 16). ``dst_ref``: the FP8 wgmma's layout (``BYTE_TILE_TRANSFORMS``);
    make the stores visible to wgmma with a proxy fence and a barrier.
    """
    num_rows = values.shape[1] if values.ndim == 2 else None
    if values.dtype != jnp.float8_e4m3fn or values.shape[0] != 64 or num_rows not in (16, 32, 64):
        raise ValueError(f"store_token_bytes: values: expected e4m3 [64, 16 | 32 | 64], got {values.shape} "
                         f"{values.dtype}")
    if tuple(dst_ref.shape) != (num_rows, SWIZZLE) or dst_ref.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"store_token_bytes: dst_ref: expected e4m3 [{num_rows}, {SWIZZLE}], got "
                         f"{dst_ref.shape} {dst_ref.dtype}")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(BYTE_TILE_TRANSFORMS)))
    def store(ctx, values_fa, dst):
        del ctx
        i8, i32, c32, base = _byte_addressing(dst)
        first_row = arith.shli(arith.andi(mgpu_utils.warpgroup_idx(), c32(1)), c32(6))
        regs = values_fa.registers
        idxs = list(values_fa.layout.thread_idxs((64, num_rows)))
        for flat, idx in enumerate(np.ndindex(regs.shape)):
            token, query_row = (arith.index_cast(i32, v) for v in idxs[flat])
            step_row = arith.addi(first_row, token)
            # vt_column: 16 G + 4 q + 2 a + e for step row 16 G + 8 a + 2 q + e.
            rest = arith.andi(step_row, c32(15))
            column = arith.addi(
                arith.addi(arith.andi(step_row, c32(~15)), arith.shli(arith.andi(arith.shrui(rest, c32(1)), c32(3)),
                                                                       c32(2))),
                arith.addi(arith.shli(arith.shrui(rest, c32(3)), c32(1)), arith.andi(rest, c32(1))))
            [vec_len] = ir.VectorType(regs[idx].type).shape
            for e in range(vec_len):
                byte = vector.extract(regs[idx], dynamic_position=[], static_position=[e])
                offset = _swizzled_offset(arith.addi(query_row, c32(e)), column)
                llvm.store(arith.bitcast(i8, byte), mgpu_utils.getelementptr(base, [offset], i8))

    store(values, dst_ref)


def output_transforms(dtype) -> tuple:
    """The SMEM transforms of ``store_feature_pairs``' staging tile: (8 rows, 128 bytes) tiles with
    the 128-byte swizzle (what the TMA reads it through)."""
    return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE))


def store_feature_pairs(values: jax.Array, dst_ref) -> None:
    """Store O^T f32 [64 features, N rows] (WGMMA layout, features in ``vt_feature`` order: a product
    with ``load_vt_quads``' operand; N = 16, 32 or 64) as [N rows, 64 features] into ``dst_ref``
    (bf16 or f32 [N, 64], ``output_transforms``), each feature in its place.

    A thread holds rows 8h + g (h < 2) of its warp's 16, features 2g and 2g + 1: both values of a
    query row go out as one 4-byte (bf16) or 8-byte (f32) store, no value moving between threads.
    """
    num_rows = values.shape[1] if values.ndim == 2 else None
    if values.dtype != jnp.float32 or values.shape[0] != 64 or num_rows not in (16, 32, 64):
        raise ValueError(f"store_feature_pairs: values: expected f32 [64, 16 | 32 | 64], got {values.shape} "
                         f"{values.dtype}")
    if tuple(dst_ref.shape) != (num_rows, 64) or dst_ref.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"store_feature_pairs: dst_ref: expected bf16 or f32 [{num_rows}, 64], got "
                         f"{dst_ref.shape} {dst_ref.dtype}")
    out_dtype = jnp.dtype(dst_ref.dtype)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(output_transforms(out_dtype))))
    def store(ctx, values_fa, dst):
        del ctx
        f32 = ir.F32Type.get()
        bf16 = ir.BF16Type.get()
        i8, i32, c32, base = _byte_addressing(dst)
        regs = values_fa.registers
        if regs.shape != (1, num_rows // 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"store_feature_pairs: unexpected WGMMA registers {regs.shape}")
        itemsize = out_dtype.itemsize
        idxs = list(values_fa.layout.thread_idxs((64, num_rows)))
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
