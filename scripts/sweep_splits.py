"""Split-KV counts for ``mla_decode``'s kernels at small batch: time each count given, side by side.

    python scripts/sweep_splits.py --out $OUT [--cases 1x4096x128x1:4,8,16,32 ...]
        [--caches fp8 bf16] [--rounds 3]

Same caches and queries as ``python -m snapmla_jax.bench decode`` (page 64, every
row at the full context). Each case runs ``mla_decode`` with the kernel the
library picks for that cache (fp8: the Mosaic GPU kernels on Hopper; bf16: the
BF16 twin) and an explicit ``num_splits``; the count ``choose_num_splits``
picks is marked "(chosen)".

Timing: at these sizes one call is 30-150 us, so each sample is a chain of
``--chain`` calls inside one jit, each call's output the next call's query
(the device runs them back to back, as it runs a model's layers), divided by
the chain's length. All counts of a case are compiled first, then timed
round-robin (``--rounds`` rounds of ``timing.time_ms`` medians; the median over
rounds), so that a drift of the GPU's clocks falls on all of them alike.
Writes split_sweep.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import jax

from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import make_caches, make_queries
from snapmla_jax.decode import mla_decode, planned_num_splits

CASES = ("1x1024x128x1:1,2,4,8", "1x4096x128x1:4,8,16,32", "8x4096x128x1:4,8,16", "32x4096x128x1:1,2,4",
         "1x16384x128x1:16,32,64", "8x16384x128x1:4,8,16", "1x4096x16x1:8,16,32,64", "8x4096x16x1:4,8,16,32",
         "1x65536x16x1:32,64,128")


def chained(fn, length: int):
    """jit of ``length`` calls of fn(q, ...) -> out (q's shape), each output the next query."""
    def chain(q, *rest):
        for _ in range(length):
            q = fn(q, *rest)
        return q
    return jax.jit(chain)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/sweep_splits")
    parser.add_argument("--cases", nargs="*", default=CASES, help="BxCONTEXTxHxS_Q:SPLITS,SPLITS,...")
    parser.add_argument("--caches", nargs="*", default=("fp8", "bf16"), choices=("fp8", "bf16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chain", type=int, default=20, help="calls per timed sample")
    args = parser.parse_args(argv)
    if timing.missing_gpu("sweep_splits"):
        return 2
    results = {"env": timing.environment(), "chain": args.chain, "rounds": args.rounds, "ms": {}, "chosen": {}}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        shape, counts = case.split(":")
        batch, context, heads, s_q = map(int, shape.split("x"))
        fp8, bf16, block_table = make_caches(batch, context)
        q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
        compiled = {}
        for cache_name in args.caches:
            cache = fp8 if cache_name == "fp8" else bf16
            chosen = planned_num_splits(q, cache, block_table)
            results["chosen"][f"{shape} {cache_name}"] = chosen
            for splits in sorted({*map(int, counts.split(",")), chosen}):
                fn = chained(lambda q, qr, c, bt, n, splits=splits: mla_decode(
                    q, qr, c, bt, n, softmax_scale=scale, num_splits=splits), args.chain)
                key = f"{shape} {cache_name} splits={splits}" + (" (chosen)" if splits == chosen else "")
                compiled[key] = (fn, (q, q_rope, cache, block_table, seq_lens))
        samples = {key: [] for key in compiled}
        for _ in range(args.rounds):
            for key, (fn, call_args) in compiled.items():
                samples[key].append(timing.time_ms(fn, [call_args], warmup=1, iters=5, inner=2) / args.chain)
        for key, times in samples.items():
            results["ms"][key] = statistics.median(times)
            print(key, round(results["ms"][key], 4), flush=True)
        (out_dir / "split_sweep.json").write_text(json.dumps(results, indent=1))
        del fp8, bf16
    return 0


if __name__ == "__main__":
    sys.exit(main())
