"""The split merge's tile size and warps (pallas_kernels/combine_splits.py), side by side.

    python scripts/tune_combine_splits.py --out $OUT [--cases 1x66x128 1x8x16 ...]

A case is B x splits x rows; ``--partial-dtype bfloat16`` for the bf16
partials of a bf16 output (``combine_splits.partial_dtype``). For each (``max_tile``, warps) setting and for the jnp
merge XLA would run instead (``combine_splits_reference``), the GPU time of the launches of one call, from the JAX profiler
(``timing.kernel_times_us``: these are 2-15 us, below what a wall clock resolves).
Writes combine_tune.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

import snapmla_jax.pallas_kernels.combine_splits as combine
from snapmla_jax.bench import timing

DEFAULT_CASES = ("1x8x16", "1x33x16", "1x128x16", "8x16x32", "64x2x32", "1x8x128", "1x17x128", "1x33x128",
                 "1x66x128", "4x33x128", "32x2x128", "16x4x128")
SETTINGS = ((4096, 4), (4096, 2), (8192, 2), (8192, 4), (2048, 4))
CALLS = 50


def parse_case(text: str) -> tuple[int, int, int]:
    """"BxSxROWS" -> (batch, splits, rows)."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a case like 1x66x128 (B x splits x rows), got {text!r}")
    return tuple(map(int, parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for combine_tune.json")
    parser.add_argument("--cases", type=parse_case, nargs="*", default=[parse_case(c) for c in DEFAULT_CASES])
    parser.add_argument("--partial-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the partials' dtype (combine_splits.partial_dtype: bfloat16 for a bf16 output)")
    args = parser.parse_args(argv)
    if timing.missing_gpu("merge tuning"):
        return 2
    results = {"environment": timing.environment(), "partial_dtype": args.partial_dtype}
    for batch, splits, rows in args.cases:
        keys = jax.random.split(jax.random.key(0), 2)
        out = jax.random.normal(keys[0], (batch, splits, rows, 512), args.partial_dtype)
        lse = jax.random.normal(keys[1], (batch, splits, rows))
        reference = jax.jit(combine.combine_splits_reference)
        line = {"jnp": sum(timing.kernel_times_us(reference, (out, lse), calls=CALLS).values())}
        for tile, warps in SETTINGS:
            combine.max_tile = lambda num_splits, tile=tile: tile
            combine.num_warps = lambda num_splits, warps=warps: warps
            jax.clear_caches()  # combine_splits' jit cache would hand back the previous setting
            merge = jax.jit(lambda o, l: combine.combine_splits(o, l, jnp.bfloat16))
            line[f"{tile}/{warps}"] = sum(timing.kernel_times_us(merge, (out, lse), calls=CALLS).values())
        key = f"{batch}x{splits}x{rows}"
        results[key] = line
        print(key, "  ".join(f"{name}: {us:.2f}" for name, us in line.items()), flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "combine_tune.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
