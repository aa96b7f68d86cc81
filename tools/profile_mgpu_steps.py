"""Where a step of the Mosaic GPU decode kernel spends its cycles, per warpgroup, from the on-device profiler.

    python tools/profile_mgpu_steps.py --out $OUT [--shape 64x2048x128x1] [--kernel bf16|small] [--set NAME=INT ...]

Runs ``mla_decode_mgpu`` once with Mosaic GPU's profiler on
(``plgpu.CompilerParams(profile_space=...)`` through the kernel module's
``COMPILER_PARAMS``): thread 0 of each warpgroup stores an SM clock stamp at the
start and end of every ``jax.named_scope`` of the step body (``wait_step``,
``qk``, ``stats``, ``wait_stats``, ``softmax``, ``p_store``, ``wait_p``, ``pv``; the
producer's ``produce_wait``, ``produce_issue``; where a consumer issues the ring, its
``issue_wait`` for the slot's consumption and its ``issue``, inside ``wait_step``). The
stamps live in SMEM next to the kernel's, which leaves room for ~56 ranges a warpgroup
(about 6 steps; the trace is truncated there; 80 do not fit an H100): hence short contexts
(2048 tokens = 16 steps a CTA). The per-step behaviour does not depend on the context; the
first two steps and the last one recorded are left out. ``--kernel bf16`` profiles the BF16 twin
(``mla_decode_mgpu_bf16``: phases ``wait_step``, ``qk``, ``softmax``, ``v_mask``, ``pv`` of a
64-token step) on the bf16 cache instead (docs/design_notes.md, section 13, has its numbers).
``--kernel small`` profiles the 16-row FP8 kernel (``mla_decode_mgpu_small``, the kernel
``mla_decode`` runs for up to 32 query rows, in 16-row blocks up to 16, e.g. --shape
64x2048x16x1, and in 32-row blocks for 17-32, e.g. 64x2048x16x2; the 64-row kernel's
phases, ``wait_step`` including warpgroup 1's TMA issue, ``qk`` the token scales and both
Q.K products, ``stats`` the row max across the warpgroup's warps) through ``mla_decode``.

Reports, per warpgroup, the median over CTAs of each phase's cycles per step,
their sum, and the step period (first to last ``wait_step`` start, over the
steps counted): a phase's share of the period is what removing it could save,
and the ``wait_*`` phases are where a warpgroup waits for the other one or for
the TMA. Writes profile_steps.json (and the raw Chrome trace, viewable in
Perfetto) under --out. Cycles are SM clocks (``%clock``), not nanoseconds.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import pathlib
import shutil
import statistics
import sys
import tempfile

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_kernel
from snapmla_jax.bench import timing
from snapmla_jax.decode import capacity_tokens, mla_decode, mosaic_kernel

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"
STEP_START = "wait_step"  # the first phase of a step


def ranges_per_trace(trace: dict) -> dict[int, list[tuple[str, float, float]]]:
    """Chrome trace events -> {trace id: [(name, begin, end), ...]} in order (one trace a warpgroup
    of a CTA; times in the dump's units, SM clocks / 1000)."""
    open_ranges: dict[int, list] = collections.defaultdict(list)
    ranges: dict[int, list] = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        tid = event["tid"]
        if event["ph"] == "B":
            open_ranges[tid].append((event["name"], event["ts"]))
        else:
            name, begin = open_ranges[tid].pop()
            ranges[tid].append((name, begin, event["ts"]))
    for tid in ranges:
        ranges[tid].sort(key=lambda r: (r[1], -r[2]))  # a range before those nested in it
    return ranges


def summarize(ranges: dict[int, list], traces_per_block: int, skip_steps: int = 2) -> dict:
    """Per warpgroup: median over CTAs of cycles per step of each phase (steps after the first
    ``skip_steps`` and before the last one), the sum of the outermost phases (a phase nested in
    another, such as ``issue`` in ``wait_step``, is reported but not summed again), and the step
    period."""
    per_wg: dict[int, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for tid, rs in ranges.items():
        wg = (tid - 1) % traces_per_block
        starts = [i for i, r in enumerate(rs) if r[0] == STEP_START]
        if len(starts) < skip_steps + 3:
            continue
        first, last = starts[skip_steps], starts[-1]  # the last step is partly the epilogue
        steps = len(starts) - 1 - skip_steps
        totals: dict[str, float] = collections.defaultdict(float)
        outermost, outer_end = 0.0, -math.inf
        for name, begin, end in rs[first:last]:
            totals[name] += (end - begin) * 1e3
            if begin >= outer_end:
                outermost, outer_end = outermost + (end - begin) * 1e3, end
        for name, total in totals.items():
            per_wg[wg][name].append(total / steps)
        per_wg[wg]["(sum of phases)"].append(outermost / steps)
        per_wg[wg]["(step period)"].append((rs[last][1] - rs[first][1]) * 1e3 / steps)
    return {f"wg{wg}": {name: round(statistics.median(values), 1) for name, values in phases.items()}
            for wg, phases in sorted(per_wg.items())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/profile_mgpu_steps")
    parser.add_argument("--shape", default="64x2048x128x1", help="BxCONTEXTxHxS_Q")
    parser.add_argument("--kernel", choices=("fp8", "bf16", "small"), default="fp8",
                        help="the FP8 64-row kernel, the BF16 twin (same grid, producer and helpers) or "
                             "the 16-row FP8 kernel (two warpgroups; a producer only in its PRODUCER_ROWS)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=INT",
                        help="kernel module constants to profile a variant with (e.g. ISSUE_BY_WARPS=0)")
    parser.add_argument("--space", type=int, default=56,
                        help="profiler ranges a warpgroup (16 B of SMEM each; a trace past it is truncated)")
    args = parser.parse_args(argv)
    if timing.missing_gpu("profile_mgpu_steps"):
        return 2
    spec = importlib.util.spec_from_file_location("bench_mgpu", SCRIPTS / "bench_mgpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    batch, context, heads, s_q = map(int, args.shape.split("x"))
    fp8, bf16, block_table = bench.make_caches(batch, context)
    q, q_rope, seq_lens, scale = bench.make_queries(batch, context, heads, s_q)
    # The 16-row kernel's row blocks as mla_decode picks them (17-32 rows: one 32-row block).
    block_rows = (mosaic_kernel(s_q * heads, fp8.dtype, q.dtype, capacity_tokens(block_table, fp8))[1]
                  if args.kernel == "small" else mgpu_kernel.BLOCK_M)
    splits = bench.mosaic_splits(batch, s_q * heads, context, block_rows)
    if args.kernel in ("bf16", "small"):  # the 16-row kernel as mla_decode serves it (its query in the kernel)
        cache = bf16 if args.kernel == "bf16" else fp8
        run = lambda: mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=scale, backend="pallas",
                                 num_splits=splits)
    else:
        run = lambda: bench.mgpu_decode(q, q_rope, fp8, block_table, seq_lens, softmax_scale=scale,
                                        num_splits=splits)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="mgpu_profile_"))
    # The kernels reduce along score rows within warps or through scratch of their own: no
    # cross-warp reduction scratch is needed, and its 2 KB go to the profiler (the other
    # kernels read COMPILER_PARAMS from this module, through ``grid_params``).
    settings = dict(item.split("=") for item in args.set)
    module = small_kernel if args.kernel == "small" else mgpu_kernel  # whose constants --set flips
    saved = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, type(saved[name])(int(value)))
    # One trace a warpgroup, the producer's included (the 16-row kernel has one in PRODUCER_ROWS only).
    producer = small_kernel.has_producer(block_rows) if args.kernel == "small" else mgpu_kernel.PRODUCER_WG
    warpgroups = mgpu_kernel.NUM_WGS + int(producer)
    mgpu_kernel.COMPILER_PARAMS = plgpu.CompilerParams(
        profile_space=args.space, profile_dir=str(trace_dir), profile_bounds_check=True, reduction_scratch_bytes=0)
    try:
        jax.clear_caches()
        jax.block_until_ready(run())
        jax.effects_barrier()  # the trace is written by a host callback
    finally:
        mgpu_kernel.COMPILER_PARAMS = None
        for name, value in saved.items():
            setattr(module, name, value)
    traces = sorted(trace_dir.glob("*-trace.json"))
    if not traces:
        print(f"profile_mgpu_steps: no trace written to {trace_dir}", file=sys.stderr)
        return 1
    shutil.copy(traces[-1], out_dir / "profile_trace.json")
    summary = summarize(ranges_per_trace(json.loads(traces[-1].read_text())), warpgroups)
    result = {"env": timing.environment(), "kernel": args.kernel, "shape": args.shape, "num_splits": splits,
              "set": settings,
              "units": "SM clock cycles per step, median over CTAs", "phases": summary}
    (out_dir / "profile_steps.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
