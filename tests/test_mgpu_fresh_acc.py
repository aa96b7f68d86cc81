"""The wgmma wrapper behind ``mgpu_fresh_acc.product_overwriting`` (the compiled products are
compared bit for bit with zeroed accumulators in test_mla_decode_mgpu.py, ``pytest -m gpu``)."""

import jax
from jax._src.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from snapmla_jax.pallas_kernels import mgpu_fresh_acc


def test_the_wrapper_is_installed_on_the_pinned_jax():
    """jax 0.11 has the ``wgmma_m64`` the wrapper rewrites; the wrapper is installed once and idle."""
    assert jax.__version__.startswith("0.11"), jax.__version__
    assert mgpu_fresh_acc.SUPPORTED
    assert mgpu_fresh_acc._wgmma.wgmma_m64 is mgpu_fresh_acc._wgmma_m64
    assert mgpu_fresh_acc._wgmma.llvm is llvm and not mgpu_fresh_acc._pending


def test_only_the_first_instruction_overwrites():
    """The stand-in for the llvm dialect gives its first inline asm scale-d 0 (the first literal
    operand) and undefined accumulator inputs, and passes every later one through as it is."""
    with jax_mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            f32, i32, i64 = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
            const = lambda ty, attr: llvm.ConstantOp(ty, attr).result
            accs = [const(f32, ir.FloatAttr.get(f32, 1.5)) for _ in range(2)]
            a_reg, desc = const(i32, ir.IntegerAttr.get(i32, 7)), const(i64, ir.IntegerAttr.get(i64, 9))
            literals = [const(i32, ir.IntegerAttr.get(i32, 1)) for _ in range(3)]  # scale-d, scale-a, scale-b
            result = llvm.StructType.get_literal([f32, f32])
            # As wgmma_m64 builds it: accumulators out and tied in, an A register, the B descriptor, literals.
            constraints = "=f,=f,0,1,r,l,n,n,n"
            stand_in = mgpu_fresh_acc._FirstOverwrites()
            first = stand_in.inline_asm(result, [*accs, a_reg, desc, *literals], "wgmma", constraints,
                                        has_side_effects=True)
            second = stand_in.inline_asm(result, [*accs, a_reg, desc, *literals], "wgmma", constraints,
                                         has_side_effects=True)
    operands = list(first.owner.operands)
    assert [v.owner.name for v in operands[:2]] == ["llvm.mlir.undef"] * 2
    assert operands[2] == a_reg and operands[3] == desc
    assert operands[4].owner.name == "llvm.mlir.constant" and "0 : i32" in str(operands[4].owner)
    assert operands[5:] == literals[1:]
    assert list(second.owner.operands) == [*accs, a_reg, desc, *literals]
