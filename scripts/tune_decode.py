"""Time candidate DecodeConfigs of the decode kernel side by side on a CUDA GPU.

    python scripts/tune_decode.py --out /tmp/tune [--shapes 64x16384x128x1 ...]

For each shape B x ctx x H x s_q (page_size 64, every row at the full context),
every candidate runs on the same random cache (fp8 candidates on the fp8 cache,
bf16 candidates on the bf16 one) and is timed with warm-up and a median
(snapmla_jax/bench/timing.py). Each fp8 candidate's output is also compared with
the first fp8 candidate's (relative L2 difference), so a faster variant that
computes something else shows up. Writes tune_decode.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

from snapmla_jax.pallas_kernels.mla_decode import DecodeConfig
from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import make_caches, make_queries
from snapmla_jax.decode import mla_decode

CANDIDATES = {
    "fp8 64/8w fp8-pv": ("fp8", DecodeConfig(64, 64, 8, 2, pv_mma="fp8")),
    "fp8 64/8w bf16-pv": ("fp8", DecodeConfig(64, 64, 8, 2, pv_mma="bf16")),
    "fp8 32/4w bf16-pv": ("fp8", DecodeConfig(32, 64, 4, 2, pv_mma="bf16")),
    "fp8 64/8w bf16-pv 3st": ("fp8", DecodeConfig(64, 64, 8, 3, pv_mma="bf16")),
    "fp8 32/4w fp8-pv": ("fp8", DecodeConfig(32, 64, 4, 2, pv_mma="fp8")),
    "fp8 32/4w fp8-pv 3st": ("fp8", DecodeConfig(32, 64, 4, 3, pv_mma="fp8")),
    "bf16 32/4w": ("bf16", DecodeConfig(32, 64, 4, 2)),
    "bf16 64/8w": ("bf16", DecodeConfig(64, 64, 8, 2)),
}
SHAPES = ("64x16384x128x1", "8x65536x128x1", "32x4096x128x2", "64x16384x16x1")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/tune_decode")
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--candidates", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if timing.missing_gpu("tune_decode"):
        return 2
    results = {"env": timing.environment(), "rows": []}
    for shape in args.shapes:
        batch, context, heads, s_q = map(int, shape.split("x"))
        fp8, bf16, block_table = make_caches(batch, context)
        q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
        row = {"shape": shape}
        first_out = None
        for name in args.candidates:
            dtype, config = CANDIDATES[name]
            cache = fp8 if dtype == "fp8" else bf16
            # The cache is an argument, not a closed-over constant of the jitted function.
            fn = jax.jit(lambda q, qr, cache, bt, n, config=config: mla_decode(
                q, qr, cache, bt, n, softmax_scale=scale, backend="pallas", config=config))
            call_args = (q, q_rope, cache, block_table, seq_lens)
            try:
                start = time.perf_counter()
                out = np.asarray(fn(*call_args), np.float64)
                compile_s = time.perf_counter() - start
                ms = timing.time_ms(fn, [call_args], warmup=2, iters=args.iters)
            except Exception as err:  # a candidate that does not compile is a result
                row[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                print(shape, name, row[name], flush=True)
                continue
            entry = {"ms": ms, "first_call_s": compile_s}
            if dtype == "fp8":
                if first_out is None:
                    first_out = out
                entry["rel_diff_vs_first_fp8"] = float(np.linalg.norm(out - first_out) / np.linalg.norm(first_out))
            row[name] = entry
            print(shape, name, json.dumps(entry), flush=True)
        results["rows"].append(row)
        del fp8, bf16
        out_dir = pathlib.Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tune_decode.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
