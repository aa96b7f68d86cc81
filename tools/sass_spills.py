"""Where ptxas spills in a Mosaic GPU kernel: its PTX dump compiled and disassembled here, per loop.

A GPU machine may lack ``nvdisasm``, but the package registry has the CUDA 13 tools as wheels,
and they run on a CPU machine. Take the device's ptxas version: register allocation, and so the
spills, differ between versions (one kernel spilled 556 bytes under 13.0.88, as on the device,
and 312 under 13.4):

    pip download --no-deps nvidia-cuda-nvcc==13.0.88 nvidia-cuda-nvdisasm -d /tmp/cuda_wheels
    unzip -j /tmp/cuda_wheels/nvidia_cuda_nvcc-*.whl 'nvidia/cu13/bin/ptxas' -d /tmp/cuda_bin
    unzip -j /tmp/cuda_wheels/nvidia_cuda_nvdisasm-*.whl 'nvidia/cu13/bin/nvdisasm' -d /tmp/cuda_bin
    chmod +x /tmp/cuda_bin/*

then, with a PTX dump from the GPU (``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=...``; see
tools/ptx_line_costs.py):

    python tools/sass_spills.py DUMP.ptx --bin /tmp/cuda_bin [--arch sm_90a]

or on a listing already made (``nvdisasm -c kernel.cubin > kernel.sass``):

    python tools/sass_spills.py kernel.sass

ptxas's own summary (its spill bytes matched the device's dump within 3%) is printed, then every
loop of the SASS (a backward branch and its target) holding a tensor-core instruction, smallest
first (retry loops of barrier waits make some ranges overlap); the 64-row kernel's unmasked step
loop is the smallest with 36 wgmmas. Per loop: instructions, spill stores (``STL``) and
loads (``LDL``), wgmmas (``HGMMA``/``QGMMA``), shared loads, stores and ``STSM``, barriers.
A spill inside the step loop is what the register budget costs (e.g. output accumulator
registers kept in local memory, loaded and stored around every P'.V fold), invisible in the PTX.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys
import tempfile

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\(\.(L_x_\d+)\)")
COUNTED = {"STL": "spill stores", "LDL": "spill loads", "GMMA": "wgmmas", "LDS": "shared loads",
           "STS": "shared stores", "STSM": "stmatrix", "BAR": "barriers"}


def opcode(text: str) -> str:
    """The opcode of a SASS instruction's text, its predicate (``@P0``) skipped."""
    words = text.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def kind(op: str) -> str | None:
    """The ``COUNTED`` class of an opcode (``STSM`` before ``STS``; ``HGMMA``/``QGMMA`` -> GMMA)."""
    base = op.split(".")[0]
    if base in ("HGMMA", "QGMMA"):
        return "GMMA"
    return base if base in COUNTED else None


def parse(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(instructions as (address, text), label -> address of the instruction after it)."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSTRUCTION.match(line):
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            instructions.append((address, m.group(2)))
    return instructions, labels


def loops(sass: str) -> list[dict]:
    """Each backward branch's range holding a wgmma, smallest first, with its ``COUNTED`` totals."""
    instructions, labels = parse(sass)
    ranges = set()
    for address, text in instructions:
        if (m := _BRANCH.search(text)) and labels.get(m.group(1), address + 1) <= address:
            ranges.add((labels[m.group(1)], address))
    found = []
    for start, end in ranges:
        counts = collections.Counter(kind(opcode(t)) for a, t in instructions if start <= a <= end)
        if counts["GMMA"]:
            found.append({"start": start, "end": end, "instructions": sum(counts.values()),
                          **{k: counts[k] for k in COUNTED}})
    return sorted(found, key=lambda r: (r["instructions"], r["start"]))


def compile_ptx(ptx: pathlib.Path, bin_dir: pathlib.Path, arch: str) -> str:
    """ptxas (its -v summary printed) then nvdisasm: the SASS listing of ``ptx``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "kernel.cubin"
        run = subprocess.run([str(bin_dir / "ptxas"), f"-arch={arch}", "-v", str(ptx), "-o", str(cubin)],
                             capture_output=True, text=True)
        print(run.stderr.strip() or run.stdout.strip())
        if run.returncode:
            raise SystemExit(f"ptxas failed on {ptx} (a PTX .version newer than this ptxas?)")
        return subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("listing", type=pathlib.Path, help="a PTX dump (.ptx) or a SASS listing")
    parser.add_argument("--bin", type=pathlib.Path, help="directory with ptxas and nvdisasm (for a .ptx)")
    parser.add_argument("--arch", default="sm_90a")
    args = parser.parse_args(argv)
    if args.listing.suffix == ".ptx":
        if args.bin is None:
            parser.error("--bin: a directory holding ptxas and nvdisasm is needed to compile a .ptx")
        sass = compile_ptx(args.listing, args.bin, args.arch)
    else:
        sass = args.listing.read_text()
    found = loops(sass)
    if not found:
        print("no loop with a wgmma in this listing")
        return 1
    print("| loop (addresses) | instructions | " + " | ".join(COUNTED.values()) + " |")
    print("|---" * (len(COUNTED) + 2) + "|")
    for r in found:
        print(f"| {r['start']:x}-{r['end']:x} | {r['instructions']} | " + " | ".join(str(r[k]) for k in COUNTED) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
