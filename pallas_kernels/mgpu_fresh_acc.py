"""A wgmma product into a fresh accumulator that is not zeroed first: its first instruction overwrites it.

Mosaic GPU (jax 0.11) starts a fresh accumulator (``plgpu.ACC`` in ``pl.run_scoped``) from a
splat of zeros, and issues every wgmma with scale-d = 1 (D = A.B + D). A 64 x 64 f32 tile is
32 registers a thread, so each fresh product costs 32 register moves before its wgmma can be
issued: the 64-row FP8 decode kernel starts five a step (its Q.K chain, its four P'.V tiles),
160 of the unmasked step's 875 PTX instructions a thread (``scripts/ptx_line_costs.py``; 707
without them). PTX's wgmma takes scale-d as an operand: with scale-d = 0 an instruction computes
D = A.B and never reads D, so the registers need no value at all.

``product_overwriting`` (A in registers, B in SMEM) and ``chain_overwriting`` (a chain of wgmmas
with both operands in SMEM) are such products: one inline Mosaic GPU op each, which calls
``mosaic.gpu.wgmma`` on an accumulator of undefined registers while the first instruction it
emits is given scale-d 0, then commits and waits. Same bits as the Pallas products from a zeroed
accumulator (0 + x is x, up to the sign of an exact zero; a GPU test compares the two). Measured
on an H100: -1% to +4% of the decode kernel's time (docs/benchmarks/mgpu.md, twenty-seventh
session). ptxas adds a wgmma fence before the first SMEM-operand wgmma of ``chain_overwriting``
(info C7519: it emits none of its own).

How. ``mosaic.gpu.wgmma.wgmma_m64`` builds each instruction's inline asm with scale-d a literal
1. This module wraps it (``_wgmma_m64``, installed once, at import): while a product of this
module is being emitted (``_pending``), the wrapped call's first inline asm gets scale-d 0 and
undefined accumulator inputs (``_FirstOverwrites``); every other wgmma, of this library or any
other, passes through untouched. ``SUPPORTED`` is False, and the caller keeps the zeroed
accumulator, if the installed jax lacks the structure the wrapper relies on (checked at import).
(A mark op placed before a ``plgpu.wgmma`` instead does not work: Pallas does not lower the two
in program order, and on an H100 the mark reached one wgmma in ten, the wrong one.)

GPU only (inline Mosaic GPU); the interpreter takes Pallas's zeroed accumulator.
"""

from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, nvvm

_wgmma = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")


def _structure_supported() -> bool:
    """Whether ``wgmma_m64`` is the function this wrapper was written against (jax 0.11): it
    emits each instruction with ``llvm.inline_asm`` and scale-d as the first literal operand."""
    try:
        source = inspect.getsource(_wgmma.wgmma_m64)
    except (OSError, TypeError, AttributeError):
        return False
    return ("setp.ne.b32 p, {use_out_reg}, 0" in source and "llvm.inline_asm(" in source
            and getattr(_wgmma, "llvm", None) is llvm)


SUPPORTED = _structure_supported()
_pending = False  # set by ``_overwriting_wgmmas`` around its first ``mgpu.wgmma``, consumed by ``_wgmma_m64``


class _FirstOverwrites:
    """Stands in for the ``llvm`` dialect module inside one ``wgmma_m64`` call: its first
    ``inline_asm`` (the first wgmma instruction) gets scale-d 0 and undefined accumulator inputs;
    everything else is the real module's."""

    def __init__(self):
        self.done = False

    def __getattr__(self, name):
        return getattr(llvm, name)

    def inline_asm(self, res, operands, asm_string, constraints, *args, **kwargs):
        if self.done:
            return llvm.inline_asm(res, operands, asm_string, constraints, *args, **kwargs)
        self.done = True
        inputs = [c for c in constraints.split(",") if not c.startswith("=")]
        if len(inputs) != len(operands) or "n" not in inputs:
            raise NotImplementedError(f"mgpu_fresh_acc: unexpected wgmma operands {constraints!r}")
        num_acc = sum(c.startswith("=") for c in constraints.split(","))
        scale_d = inputs.index("n")  # the first literal: scale-d (``setp.ne.b32 p, scale-d, 0``)
        i32 = ir.IntegerType.get_signless(32)
        operands = ([llvm.mlir_undef(v.type) for v in operands[:num_acc]] + list(operands[num_acc:scale_d])
                    + [llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result] + list(operands[scale_d + 1:]))
        return llvm.inline_asm(res, operands, asm_string, constraints, *args, **kwargs)


def _wgmma_m64(*args, **kwargs):
    global _pending
    if not _pending:
        return _original_m64(*args, **kwargs)
    _pending = False
    _wgmma.llvm = _FirstOverwrites()
    try:
        return _original_m64(*args, **kwargs)
    finally:
        _wgmma.llvm = llvm


if SUPPORTED and getattr(_wgmma.wgmma_m64, "__name__", "") != "_wgmma_m64":
    _original_m64 = _wgmma.wgmma_m64
    _wgmma.wgmma_m64 = _wgmma_m64


def _overwriting_wgmmas(n: int, operands) -> object:
    """Inside an inline Mosaic GPU op: the wgmmas (a, b) of ``operands`` (mosaic.gpu operands, b
    K-major as stored) into one fresh f32 [64, n] accumulator, the first instruction overwriting
    it; committed, waited for, and passed through a barrier after the wait (so that no use of the
    registers moves above it). Returns the FragmentedArray."""
    global _pending
    undefined = mgpu.FragmentedArray.splat(llvm.mlir_undef(ir.F32Type.get()), (64, n), mgpu.WGMMA_LAYOUT)
    acc = mgpu.WGMMAAccumulator.from_registers(undefined, sync=False)
    _pending = True
    try:
        for k, (a, b) in enumerate(operands):
            acc = mgpu.wgmma(acc, a, mgpu.memref_transpose(b, (1, 0, 3, 2)), swizzle=128)
            if k == 0 and _pending:
                raise NotImplementedError("mgpu_fresh_acc: the wgmma did not reach wgmma_m64")
    finally:
        _pending = False  # never left set for another kernel's wgmma
    nvvm.wgmma_commit_group_sync_aligned()
    nvvm.wgmma_wait_group_sync_aligned(0)
    return mgpu.optimization_barrier(acc.value)


def product_overwriting(a: jax.Array, b_ref, b_transforms: tuple) -> jax.Array:
    """A @ B^T into a fresh f32 [64, N] accumulator whose first wgmma instruction overwrites it
    (nothing zeroes it), committed and waited for: a [64, K] 8-bit in registers
    (``plgpu.Layout.WGMMA_8BIT``, e.g. ``mgpu_bytes.load_vt_quads``), b_ref [N, K] in SMEM with
    ``b_transforms`` (tiling (8, 128) and a 128-byte swizzle), the K-major B operand as
    ``plgpu.wgmma(acc, a, b_ref.transpose((1, 0)))`` takes it. GPU only (inline Mosaic GPU);
    requires ``SUPPORTED``.

    The whole product is one inline op, so that the wrapper's scale-d 0 lands on its own first
    instruction: Pallas does not lower marks and wgmmas in program order (an ``inline_mgpu`` mark
    before a ``plgpu.wgmma`` reached the next ``wgmma_m64`` once in ten on an H100).
    """
    n = b_ref.shape[0]
    result = plgpu.ShapeDtypeStruct((64, n), jnp.float32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.RefType(b_transforms)), return_type=result)
    def product(ctx, a_fa, b):
        del ctx
        return _overwriting_wgmmas(n, [(a_fa, b)])

    return product(a, b_ref)


def chain_overwriting(a_ref, b_ref, transforms: tuple) -> jax.Array:
    """sum_c A[c] @ B[c]^T into a fresh f32 [64, N] accumulator whose first wgmma instruction
    overwrites it, committed and waited for: a_ref [C, 64, K] and b_ref [C, N, K] in SMEM with
    ``transforms`` (tiling (8, 128) and a 128-byte swizzle), as C calls
    ``plgpu.wgmma(acc, a_ref.at[c], b_ref.at[c].transpose((1, 0)))`` take them. GPU only;
    requires ``SUPPORTED``."""
    chunks, n = b_ref.shape[0], b_ref.shape[1]
    if a_ref.shape[0] != chunks or a_ref.shape[1] != 64:
        raise ValueError(f"chain_overwriting: a_ref: expected [{chunks}, 64, K], got {a_ref.shape}")
    result = plgpu.ShapeDtypeStruct((64, n), jnp.float32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms), plgpu.RefType(transforms)), return_type=result)
    def chain(ctx, a, b):
        del ctx
        return _overwriting_wgmmas(n, [(mgpu.memref_slice(a, c), mgpu.memref_slice(b, c)) for c in range(chunks)])

    return chain(a_ref, b_ref)
