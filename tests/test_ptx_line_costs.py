"""tools/ptx_line_costs.py on a small hand-written PTX: blocks, source lines, opcodes."""

import pytest

from script_loader import load_script

PTX = """
\t.file\t1 "/src/kernel.py"
\t.file\t2 "/src/bytes.py"
.visible .entry k()
{
\t.reg .b32 \t%r<9>;
\t.loc\t1 10 3
\tmov.b32 \t%r1, 0;
$L__BB0_1:
\t.loc\t1 20 5
\tfma.rn.f32 \t%r2, %r1, 0f3DC6B27F, %r1;
\tfma.rn.f32 \t%r3, %r2, %r2, %r1;
\t@%p1 bra.uni \t$L__BB0_1;
\t.loc\t2 7 1
\tprmt.b32 \t%r4, %r3, %r2, 0x5140;
\t.loc\t1 20 5
\tmul.f32 \t%r5, %r4, %r4;
$L__BB0_2:
\t.loc\t1 30 1
\tret;
}
"""


def test_counts_the_largest_blocks_instructions_per_source_line_and_opcode():
    script = load_script("ptx_line_costs", "tools")
    blocks = script.basic_blocks(PTX)
    assert {name: len(body) for name, body in blocks.items()} == {"entry": 1, "$L__BB0_1": 5, "$L__BB0_2": 1}
    block, per_line, per_opcode = script.line_costs(PTX)
    assert block == "$L__BB0_1"
    # The predicated branch counts as a `bra` of the line before it; directives are not instructions.
    assert per_line == {("/src/kernel.py", 20): 4, ("/src/bytes.py", 7): 1}
    assert per_opcode == {"fma": 2, "bra": 1, "prmt": 1, "mul": 1}
    assert script.line_costs(PTX, "$L__BB0_2")[1] == {("/src/kernel.py", 30): 1}
    with pytest.raises(ValueError, match="block"):
        script.line_costs(PTX, "$L__BB9_9")
