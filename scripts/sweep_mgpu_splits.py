"""Split-KV counts for the Mosaic GPU decode kernels at small batch: time each count given.

    PYTHONPATH=. python scripts/sweep_mgpu_splits.py --out $OUT [--cases 8x4096x16x1:1,2,4,8 ...]

Same caches and queries as ``python -m snapmla_jax.bench decode`` (page 64, every
row at the full context); the kernel is the one ``snapmla_jax.decode`` routes to
(the 16-row kernel up to 16 query rows a batch row, else the 64-row one), called
as scripts/bench_mgpu.py calls it; medians of 10 calls after warm-up. Marks the
count ``choose_num_splits`` picks. Writes split_sweep.json under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import jax

from snapmla_jax.bench import timing

ROOT = pathlib.Path(__file__).resolve().parent
CASES = ("8x16384x16x1:4,8,16", "8x4096x16x1:1,2,4,8", "1x16384x16x1:4,8,16,32", "8x65536x16x1:8,16,32",
         "8x16384x128x1:2,4,8", "1x65536x128x1:16,32,64")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/sweep_mgpu_splits")
    parser.add_argument("--cases", nargs="*", default=CASES, help="BxCONTEXTxHxS_Q:SPLITS,SPLITS,...")
    args = parser.parse_args(argv)
    if timing.missing_gpu("sweep_mgpu_splits"):
        return 2
    spec = importlib.util.spec_from_file_location("bench_mgpu", ROOT / "bench_mgpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = {"env": timing.environment(), "ms": {}}
    for case in args.cases:
        shape, counts = case.split(":")
        (batch, context, heads, s_q), fp8, block_table, q, q_rope, seq_lens, scale = bench.fp8_problem(shape)
        small = s_q * heads <= bench.SMALL_ROWS
        chosen = bench.mosaic_splits(batch, s_q * heads, context, bench.SMALL_ROWS if small else bench.BLOCK_M)
        for splits in map(int, counts.split(",")):
            fn = jax.jit(lambda q, qr, c, bt, n, splits=splits: bench.mgpu_decode(
                q, qr, c, bt, n, softmax_scale=scale, small=small, num_splits=splits))
            key = f"{shape} splits={splits}" + (" (chosen)" if splits == chosen else "")
            results["ms"][key] = timing.time_ms(fn, [(q, q_rope, fp8, block_table, seq_lens)], warmup=2, iters=10)
            print(key, results["ms"][key], flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "split_sweep.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
