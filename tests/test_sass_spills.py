"""tools/sass_spills.py on a small hand-written SASS listing: loops, spills, wgmmas."""

import pytest

from script_loader import load_script

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDL R5, [R1+0xb4] ;
        /*0020*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0030*/                   STL [R1+0x100], R2 ;
        /*0040*/               @P0 LDS.U16 R7, [R3+0x10] ;
        /*0050*/                   STSM.16.MT88.4 [R9], R12 ;
        /*0060*/                   STS [R4], R8 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING R0, 0x80 ;
.L_x_2:
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R6], R7 ;
        /*0090*/              @!P1 BRA `(.L_x_2) ;
        /*00a0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*00b0*/               @P2 BRA `(.L_x_1) ;
        /*00c0*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*00d0*/                   EXIT ;
"""


def test_counts_spills_and_wgmmas_per_loop_with_a_wgmma():
    script = load_script("sass_spills", "tools")
    instructions, labels = script.parse(SASS)
    assert len(instructions) == 14 and labels == {"L_x_1": 0x10, "L_x_2": 0x80, "L_x_3": 0xd0}
    # The barrier-wait retry loop (0x80-0x90) has no wgmma, the forward branch is no loop.
    (loop,) = script.loops(SASS)
    assert (loop["start"], loop["end"], loop["instructions"]) == (0x10, 0xb0, 11)
    assert {k: loop[k] for k in script.COUNTED} == {"STL": 1, "LDL": 1, "GMMA": 2, "LDS": 1, "STS": 1,
                                                    "STSM": 1, "BAR": 1}


def test_a_ptx_needs_the_tools_directory(tmp_path):
    script = load_script("sass_spills", "tools")
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text("//")
    with pytest.raises(SystemExit):
        script.main([str(ptx)])
    listing = tmp_path / "kernel.sass"
    listing.write_text(SASS)
    assert script.main([str(listing)]) == 0
