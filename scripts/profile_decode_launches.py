"""Where a decode call's time goes, launch by launch: GPU kernel durations from the JAX profiler.

    python scripts/profile_decode_launches.py --out $OUT [--cases 1x1024x16x1 1x16384x128x1 ...]

For each case (B x ctx x H x s_q) it builds the benchmark's chain of layers
(``python -m snapmla_jax.bench decode``: the same caches, queries and
``decode_chain``) for the fp8 cache (the default FP8 kernel) and the bf16 cache
(the BF16 twin), times it (``timing.time_ms``, per decode call), then traces three
chained calls under ``jax.profiler.trace`` and sums each GPU kernel's duration
per decode call: the decode kernel itself, and every launch around it (input
preparation, the split merge, the chain's layer arithmetic), and the traced
calls' span, busy and idle time (``timing.timeline_us``: the gaps between
launches). At small problems a call is a handful of ~1-3 us launches, and this
shows which ones. A timed median far above the traced span is the clock, not
the code: the traced calls follow a pause, the timed samples run under the
GPU's power cap.
Writes launches.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from snapmla_jax.bench import decode as bench
from snapmla_jax.bench import timing

DEFAULT_CASES = ("1x1024x16x1", "1x1024x128x1", "1x4096x16x2", "8x1024x16x1", "1x16384x128x1", "1x65536x16x1")
TRACED_CALLS = 3


def parse_case(text: str) -> tuple[int, int, int, int]:
    """"BxCTXxHxSQ" -> (batch, context, heads, s_q)."""
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a case like 1x1024x16x1 (B x ctx x H x s_q), got {text!r}")
    return tuple(int(p) for p in parts)


def profile_case(batch: int, context: int, heads: int, s_q: int) -> dict:
    layers = bench.chain_layers(batch, context)
    fp8, bf16, block_table = bench.make_caches(batch, context, layers=layers)
    q, q_rope, seq_lens, scale = bench.make_queries(batch, context, heads, s_q)
    result = {}
    for name, cache in (("fp8", fp8), ("bf16", bf16)):
        chain = bench.decode_chain(scale, layers, "pallas")
        calls = bench.chain_calls(layers)
        args = (q, q_rope, cache, block_table, seq_lens)
        us = timing.time_ms(chain, [args], warmup=2, iters=20) / calls * 1e3
        events = timing.gpu_events(chain, args, calls=TRACED_CALLS)
        per_call = {kernel: total / calls for kernel, total in timing.kernel_totals_us(events, TRACED_CALLS).items()}
        timeline = {part: value / calls for part, value in timing.timeline_us(events, TRACED_CALLS).items()}
        result[name] = {"us_per_call": us, "layers": layers, "calls": calls, "kernels_us_per_call": per_call,
                        "timeline_us_per_call": timeline}
        print(f"{batch}x{context}x{heads}x{s_q} {name}: {us:.1f} us a call; traced: span {timeline['span']:.1f}, "
              f"busy {timeline['busy']:.1f}, idle between launches {timeline['idle']:.1f}", flush=True)
        for kernel, kernel_us in per_call.items():
            if kernel_us >= 0.05:
                print(f"    {kernel_us:7.2f} us  {kernel[:90]}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for launches.json")
    parser.add_argument("--cases", type=parse_case, nargs="*", default=[parse_case(c) for c in DEFAULT_CASES])
    args = parser.parse_args(argv)
    if timing.missing_gpu("launch profile"):
        return 2
    results = {"environment": timing.environment()}
    for case in args.cases:
        results["x".join(map(str, case))] = profile_case(*case)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
