"""Inline-PTX helpers for two CTAs of a Mosaic GPU cluster that exchange data every step through
distributed shared memory (DSMEM): the paired FP8 decode kernel (mla_decode_mgpu_pair.py).

Each CTA writes into its peer's SMEM with ``st.shared::cluster`` (the peer's address of a local
buffer is ``mapa`` of its own: both CTAs run the same program, so their buffers sit at the same
offsets) and then arrives on an mbarrier in the peer's SMEM with ``release`` at cluster scope; the
peer waits on its own copy with ``acquire`` at cluster scope, after which the bytes are visible to
its loads (and, behind a proxy fence, to its wgmmas).

The exchange mbarriers are plain int64 SMEM words this module initialises (``init_barriers``),
not Pallas barriers: Pallas's barrier wait acquires at CTA scope, which does not order another
CTA's stores, and a Pallas barrier cannot be handed to inline Mosaic GPU code. Every thread of
the sending warpgroup arrives (128 arrivals a phase): each thread's ``release`` orders its own
stores, so no barrier of the sender's warpgroup is needed before the arrivals.

The waits take the phase's parity explicitly (a barrier completes one phase a step, so the
parity is the step's index mod 2).

GPU only: the interpreter has no clusters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, nvvm, scf, vector

from pallas_kernels.mgpu_bytes import BYTE_TILE_TRANSFORMS, SWIZZLE, _swizzled_offset

ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector with one value per score row (the 64-row kernel's)
THREADS = 128  # a warpgroup: the arrivals an exchange barrier counts a phase


def _i32():
    return ir.IntegerType.get_signless(32)


def _c32(value):
    return value if isinstance(value, ir.Value) else mgpu_utils.c(value, _i32())


def peer_rank():
    """i32: the other CTA's rank in a cluster of two (``%cluster_ctarank`` xor 1)."""
    rank = llvm.inline_asm(_i32(), [], "mov.u32 $0, %cluster_ctarank;", "=r")
    return arith.xori(rank, _c32(1))


def _local_address(ref) -> ir.Value:
    """i32 shared-window address of an SMEM memref's first byte."""
    return llvm.ptrtoint(_i32(), mgpu_utils.memref_ptr(ref))


def _peer_address(local_address) -> ir.Value:
    """i32 ``shared::cluster`` address of the same byte in the peer CTA."""
    return llvm.inline_asm(_i32(), [local_address, peer_rank()], "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r")


def _scalar(array_fa) -> ir.Value:
    """The first register's first element of a FragmentedArray that holds one value throughout."""
    value = array_fa.registers.flat[0]
    return _vector_first(value) if isinstance(value.type, ir.VectorType) else value


def _vector_first(value):
    return vector.extract(value, dynamic_position=[], static_position=[0])


def init_barriers(bar_ref, count: int = THREADS) -> None:
    """Initialise every int64 word of ``bar_ref`` (SMEM int64, contiguous) as an mbarrier of ``count``
    arrivals (one thread), then a cluster barrier of every thread of both CTAs, so that no peer
    arrives before the words are barriers. Call once, from every warpgroup, before any exchange."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, bars):
        del ctx
        first = arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), _c32(0))
        base = _local_address(bars)
        with mgpu_utils.when(first):
            for i in range(int(np.prod(ir.MemRefType(bars.type).shape))):
                llvm.inline_asm(ir.Type.parse("!llvm.void"), [arith.addi(base, _c32(8 * i))],
                                f"mbarrier.init.shared::cta.b64 [$0], {count};", "r", has_side_effects=True)
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.mbarrier_init.release.cluster;", "",
                            has_side_effects=True)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;", "",
                        has_side_effects=True)
    init(bar_ref)


def arrive_peer(bar_ref, index: int) -> None:
    """Every thread of the calling warpgroup arrives on word ``index`` of the peer's ``bar_ref``
    (release at cluster scope: the thread's earlier stores to the peer, and a proxy fence for its
    wgmmas, come before it)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def arrive(ctx, bars):
        del ctx
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cluster)
        address = _peer_address(arith.addi(_local_address(bars), _c32(8 * index)))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [address],
                        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];", "r", has_side_effects=True)
    arrive(bar_ref)


def wait_local(bar_ref, index: int, parity: jax.Array) -> None:
    """Wait (acquire at cluster scope) until word ``index`` of this CTA's ``bar_ref`` has completed
    the phase of ``parity`` (int32 [64] in ``ROW``, one value throughout: 0 or 1), then a proxy
    fence, so that the peer's stores are visible to this thread's loads and wgmmas."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), ROW))
    def wait(ctx, bars, parity_fa):
        del ctx
        i32 = _i32()
        address = arith.addi(_local_address(bars), _c32(8 * index))
        phase = _scalar(parity_fa)
        loop = scf.WhileOp([], [])
        before = loop.before.blocks.append()
        with ir.InsertionPoint(before):
            done = llvm.inline_asm(
                i32, [address, phase],
                "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], $2;\n\t"
                "selp.u32 $0, 1, 0, p;\n\t}", "=r,r,r", has_side_effects=True)
            scf.condition(arith.cmpi(arith.CmpIPredicate.eq, done, _c32(0)), [])
        after = loop.after.blocks.append()
        with ir.InsertionPoint(after):
            scf.yield_([])
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
    wait(bar_ref, parity)


def _row_words() -> int:
    """32-bit registers a thread holds of an f32 [64] vector in ``ROW``."""
    return int(np.prod(ROW.to_mgpu().registers_shape((64,))))


def row_bytes(count: int) -> int:
    """Bytes ``send_rows_async`` of ``count`` [64] vectors delivers (every thread stores its
    registers, the rows' copies included): what the receiver expects a phase."""
    return count * _row_words() * 4 * THREADS


P_BYTES = 4 * 8 * THREADS  # ``store_quads_pair(..., bar_ref=...)``: eight 4-byte words a thread


def expect_bytes(bar_ref, index: int, num_bytes: int) -> None:
    """One thread of the calling warpgroup arrives on word ``index`` of this CTA's ``bar_ref``
    expecting ``num_bytes`` from the peer's ``st.async`` (barriers of 1 arrival: ``init_barriers(...,
    count=1)``). Call once a phase, before or after the bytes land (the transaction count may go
    below zero meanwhile; the phase completes at one arrival and zero bytes outstanding)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def expect(ctx, bars):
        del ctx
        first = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(mgpu_utils.thread_idx(), _c32(THREADS)), _c32(0))
        address = arith.addi(_local_address(bars), _c32(8 * index))
        with mgpu_utils.when(first):
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [address],
                            f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {num_bytes};", "r",
                            has_side_effects=True)
    expect(bar_ref)


def _st_async(address, word, barrier_address, ptx_type: str = "b32", constraint: str = "r") -> None:
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [address, word, barrier_address],
                    f"st.async.shared::cluster.mbarrier::complete_tx::bytes.{ptx_type} [$0], $1, [$2];",
                    f"r,{constraint},r", has_side_effects=True)


def send_rows_async(values, dst_ref, bar_ref, index: int) -> None:
    """``send_rows`` with ``st.async``: each 4-byte store completes its bytes on word ``index`` of
    the peer's ``bar_ref`` (the peer expects ``row_bytes(len(values))``: ``expect_bytes``); no fence
    or arrival by the sender."""
    @plgpu.inline_mgpu(arg_types=(tuple(ROW for _ in values), plgpu.RefType(), plgpu.RefType()))
    def send(ctx, values_fa, dst, bars):
        del ctx
        peer = _peer_address(_local_address(dst))
        peer_bar = _peer_address(arith.addi(_local_address(bars), _c32(8 * index)))
        for i, value in enumerate(values_fa):
            idxs = list(value.layout.thread_idxs(value.shape))
            for flat, idx in enumerate(np.ndindex(value.registers.shape)):
                reg = value.registers[idx]
                (row,) = idxs[flat]
                if isinstance(reg.type, ir.VectorType) and ir.VectorType(reg.type).shape[0] != 1:
                    raise NotImplementedError("send_rows_async: one value a register expected")
                word = _vector_first(reg) if isinstance(reg.type, ir.VectorType) else reg
                offset = arith.muli(arith.addi(_c32(64 * i), arith.index_cast(_i32(), row)), _c32(4))
                _st_async(arith.addi(peer, offset), word, peer_bar, "f32", "f")
    send(tuple(values), dst_ref, bar_ref)


def wait_parity(bar_ref, index: int, parity: jax.Array) -> None:
    """Wait (acquire, CTA scope: what ``st.async``'s transaction completion needs) until word
    ``index`` of this CTA's ``bar_ref`` has completed the phase of ``parity`` (int32 [64] in
    ``ROW``, one value throughout), then a proxy fence for this thread's wgmmas."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), ROW))
    def wait(ctx, bars, parity_fa):
        del ctx
        i32 = _i32()
        address = arith.addi(_local_address(bars), _c32(8 * index))
        phase = _scalar(parity_fa)
        loop = scf.WhileOp([], [])
        before = loop.before.blocks.append()
        with ir.InsertionPoint(before):
            done = llvm.inline_asm(
                i32, [address, phase],
                "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\n\t"
                "selp.u32 $0, 1, 0, p;\n\t}", "=r,r,r", has_side_effects=True)
            scf.condition(arith.cmpi(arith.CmpIPredicate.eq, done, _c32(0)), [])
        after = loop.after.blocks.append()
        with ir.InsertionPoint(after):
            scf.yield_([])
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
    wait(bar_ref, parity)


def send_rows(values, dst_ref) -> None:
    """values[i] (f32 [64] in ``ROW``) into row i of the peer's ``dst_ref`` (SMEM f32 [len(values),
    64], untiled), with ``st.shared::cluster``; follow with ``arrive_peer``."""
    @plgpu.inline_mgpu(arg_types=(tuple(ROW for _ in values), plgpu.RefType()))
    def send(ctx, values_fa, dst):
        del ctx
        peer = _peer_address(_local_address(dst))
        for i, value in enumerate(values_fa):
            idxs = list(value.layout.thread_idxs(value.shape))
            for flat, idx in enumerate(np.ndindex(value.registers.shape)):
                reg = value.registers[idx]
                (row,) = idxs[flat]
                offset = arith.muli(arith.addi(_c32(64 * i), arith.index_cast(_i32(), row)), _c32(4))
                elems = ir.VectorType(reg.type).shape[0] if isinstance(reg.type, ir.VectorType) else 1
                if elems != 1:
                    raise NotImplementedError(f"send_rows: {elems} values a register")
                word = _vector_first(reg) if isinstance(reg.type, ir.VectorType) else reg
                llvm.inline_asm(ir.Type.parse("!llvm.void"), [arith.addi(peer, offset), word],
                                "st.shared::cluster.f32 [$0], $1;", "r,f", has_side_effects=True)
    send(tuple(values), dst_ref)


def store_quads_pair(values: jax.Array, dst_ref, bar_ref=None, index: int = 0) -> None:
    """``mgpu_bytes.store_quads`` into columns [0, 64) of this CTA's ``dst_ref`` and columns
    [64, 128) of the peer's (the same 4-byte words at both): e4m3 [64, 64] (WGMMA layout, score
    columns in step-row order) into an e4m3 [64, 128] tile in the FP8 wgmma's layout
    (``BYTE_TILE_TRANSFORMS``). Make them visible with ``plgpu.commit_smem`` (this CTA) and
    ``arrive_peer`` (the peer); or with ``bar_ref``, the peer's words go by ``st.async``, completing
    their bytes (``P_BYTES`` a warpgroup) on word ``index`` of the peer's ``bar_ref``."""
    if values.dtype != jnp.float8_e4m3fn or tuple(values.shape) != (64, SWIZZLE // 2):
        raise ValueError(f"store_quads_pair: values: expected e4m3 [64, {SWIZZLE // 2}], got {values.shape} "
                         f"{values.dtype}")
    if tuple(dst_ref.shape) != (64, SWIZZLE) or dst_ref.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"store_quads_pair: dst_ref: expected e4m3 [64, {SWIZZLE}], got {dst_ref.shape} "
                         f"{dst_ref.dtype}")
    rows, cols = values.shape

    extra_types = () if bar_ref is None else (plgpu.RefType(),)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(BYTE_TILE_TRANSFORMS), *extra_types))
    def store(ctx, values_fa, dst, *bars):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i32 = _i32()
        base = mgpu_utils.memref_ptr(dst)
        peer = _peer_address(_local_address(dst))
        peer_bar = _peer_address(arith.addi(_local_address(bars[0]), _c32(8 * index))) if bars else None
        regs = values_fa.registers
        if regs.shape != (1, 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"store_quads_pair: unexpected WGMMA registers {regs.shape}")
        idxs = list(values_fa.layout.thread_idxs((rows, cols)))
        for flat, idx in enumerate(np.ndindex(regs.shape)):
            if idx[1] % 2:
                continue  # stored with its even partner
            row, col = (arith.index_cast(i32, v) for v in idxs[flat])
            pair = [regs[idx], regs[(idx[0], idx[1] + 1, *idx[2:])]]
            word = mgpu_utils.bitcast(mgpu_utils.vector_concat(pair), i32)
            quad_col = arith.addi(col, arith.andi(col, _c32(15)))
            llvm.store(word, mgpu_utils.getelementptr(base, [_swizzled_offset(row, quad_col)], i8))
            remote = arith.addi(peer, _swizzled_offset(row, arith.addi(quad_col, _c32(SWIZZLE // 2))))
            if peer_bar is not None:
                _st_async(remote, word, peer_bar)
            else:
                llvm.inline_asm(ir.Type.parse("!llvm.void"), [remote, word], "st.shared::cluster.b32 [$0], $1;",
                                "r,r", has_side_effects=True)

    store(values, dst_ref, *(() if bar_ref is None else (bar_ref,)))
