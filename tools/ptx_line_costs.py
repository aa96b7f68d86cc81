"""Which source lines a Mosaic GPU kernel's hot loop spends its instructions on, from its PTX.

The dump comes from the GPU (it needs the compiler; no timing needed). Its directory must exist:
Mosaic GPU does not create it, and otherwise prints the dumps to stdout:

    mkdir -p $OUT/dump
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/dump \\
        python tools/time_mgpu_variants.py --variants baseline --rounds 1 --out $OUT/time

then anywhere:

    python tools/ptx_line_costs.py $OUT/dump/snapmla_decode_fp8_mgpu_0.ptx [--top 25]

The PTX is split into basic blocks at its labels, and the largest ones are listed: a
kernel's step bodies (the 64-row kernel's masked step is the largest, with the masks'
selects; its unmasked step, which nearly every step runs, is the next). The largest block's
instructions, or ``--block LABEL``'s, are counted per ``.loc`` source line and per opcode;
the line's text is shown from the file as it is here, so run it on the source the PTX was
compiled from. A PTX instruction is not a
SASS one, but the counts find what to look at (e.g. a log2 compiled to a ~28-instruction
polynomial: ``mla_decode_mgpu.APPROX_MATH``).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

_LABEL = re.compile(r"^(\$L__BB\S+):")
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
_INSTRUCTION = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.]*)")


def basic_blocks(ptx: str) -> dict[str, list[tuple[tuple[str, int] | None, str]]]:
    """Label -> the block's instructions as (source (file id, line) or None, opcode); the code
    before the first label is block "entry"."""
    blocks: dict[str, list] = {"entry": []}
    current, loc = "entry", None
    for line in ptx.splitlines():
        if label := _LABEL.match(line):
            current = label.group(1)
            blocks[current] = []
        elif where := _LOC.match(line):
            loc = (where.group(1), int(where.group(2)))
        elif (instruction := _INSTRUCTION.match(line)) and not line.lstrip().startswith("."):
            blocks[current].append((loc, instruction.group(2)))
    return blocks


def source_files(ptx: str) -> dict[str, str]:
    """PTX file id -> path, from the ``.file`` directives."""
    return {m.group(1): m.group(2) for m in map(_FILE.match, ptx.splitlines()) if m}


def line_costs(ptx: str, block: str | None = None) -> tuple[str, collections.Counter, collections.Counter]:
    """(the block's label, instructions per (path, line), instructions per opcode's first part) of
    ``block`` or of the largest block."""
    blocks = basic_blocks(ptx)
    if block is None:
        block = max(blocks, key=lambda name: len(blocks[name]))
    elif block not in blocks:
        raise ValueError(f"block: expected one of the PTX's labels, got {block!r}")
    files = source_files(ptx)
    per_line = collections.Counter()
    per_opcode = collections.Counter()
    for loc, opcode in blocks[block]:
        per_line[(files.get(loc[0], loc[0]), loc[1]) if loc else ("?", 0)] += 1
        per_opcode[opcode.split(".")[0]] += 1
    return block, per_line, per_opcode


def _source_text(path: str, line: int) -> str:
    try:
        return pathlib.Path(path).read_text().splitlines()[line - 1].strip()
    except (OSError, IndexError):
        return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ptx", type=pathlib.Path)
    parser.add_argument("--block", help="a basic block's label (default: the largest)")
    parser.add_argument("--top", type=int, default=25, help="source lines to list")
    args = parser.parse_args(argv)
    ptx = args.ptx.read_text()
    sizes = sorted(((len(body), name) for name, body in basic_blocks(ptx).items()), reverse=True)
    print("largest blocks:", ", ".join(f"{name} {size}" for size, name in sizes[:5]))
    block, per_line, per_opcode = line_costs(ptx, args.block)
    total = sum(per_line.values())
    print(f"block {block}: {total} PTX instructions a thread")
    print("opcodes:", ", ".join(f"{op} {n}" for op, n in per_opcode.most_common(12)))
    for (path, line), count in per_line.most_common(args.top):
        print(f"{count:6d} {100 * count / total:5.1f}%  {pathlib.Path(path).name}:{line}  {_source_text(path, line)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
