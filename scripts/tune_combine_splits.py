"""The split merge of the Mosaic decode kernels (combine_splits_mgpu.py) beside the jnp merge XLA
would run, GPU time of each.

    python scripts/tune_combine_splits.py --out $OUT [--cases 1x66x128 64x8x128I ...]

A case is B x splits x rows, "I" at its end for a balanced plan's merge (``combine_items_mgpu``:
every row S items, loaded S rounded up to a power of two at a time, as the decode's chunk)
instead of ``combine_splits_mgpu``; ``--partial-dtype bfloat16`` for the bf16 partials of a bf16
output (``combine_splits.partial_dtype``). Times are the GPU time of the launches of one call
from the JAX profiler (``timing.kernel_times_us``: these are 1-30 us, below what a wall clock
resolves); for "I" only the merge's own launch (not the copies of the outputs that an
in-place update makes of arguments it does not own). Written to combine_compare.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import snapmla_jax.pallas_kernels.combine_splits as combine
import snapmla_jax.pallas_kernels.combine_splits_mgpu as combine_mgpu
from snapmla_jax.bench import timing

# The merges the decode calls of the benchmark pages run (uniform plans of 16-, 32- and 64-row
# blocks, and balanced plans' items).
DEFAULT_CASES = ("1x8x16", "1x66x16", "8x16x32", "1x8x128", "1x66x128", "4x33x128", "32x2x128", "16x4x128",
                 "1x8x128I", "1x66x128I", "8x8x128I", "64x8x128I", "72x8x128I")
CALLS = 50
MERGE_KERNEL = "combine"  # in the names of the merge's launches (snapmla_combine_splits_mgpu, _items_mgpu)


def parse_case(text: str) -> tuple[int, int, int, bool]:
    """"BxSxROWS[I]" -> (batch, splits, rows, items)."""
    parts = text.removesuffix("I").split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a case like 1x66x128 or 64x8x128I (B x splits x rows), "
                                         f"got {text!r}")
    return (*map(int, parts), text.endswith("I"))


def merge_calls(batch: int, splits: int, rows: int, items: bool, partial) -> dict:
    """name -> (fn, args) of each merge of a case: "mosaic" and "jnp"."""
    output = jnp.bfloat16 if partial == "bfloat16" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 2)
    out = jax.random.normal(keys[0], (batch, splits, rows, 512), partial)
    lse = jax.random.normal(keys[1], (batch, splits, rows))
    if not items:
        return {"mosaic": (jax.jit(lambda o, l: combine_mgpu.combine_splits_mgpu(o, l, output)), (out, lse)),
                "jnp": (jax.jit(combine.combine_splits_reference), (out, lse))}
    chunk = pl.next_power_of_2(max(splits, 2))
    args = (out.reshape(batch * splits, rows, 512), lse.reshape(batch * splits, rows),
            jnp.arange(batch, dtype=jnp.int32) * splits, jnp.full((batch,), splits, jnp.int32),
            jnp.zeros((batch, rows, 512), output), jnp.zeros((batch, rows), jnp.float32))
    return {"mosaic": (jax.jit(lambda *a: combine_mgpu.combine_items_mgpu(*a, chunk=chunk)), args),
            "jnp": (jax.jit(combine.combine_items_reference), args)}


def compare(cases, partial: str) -> dict:
    """{case: {merge: us}} of ``merge_calls``, printed as they come."""
    results = {}
    for batch, splits, rows, items in cases:
        line = {}
        for name, (fn, args) in merge_calls(batch, splits, rows, items, partial).items():
            times = timing.kernel_times_us(fn, args, calls=CALLS)
            # A merge into given outputs copies them first (they are arguments, not intermediates):
            # count the merge's own launch; the jnp merge is all of its launches.
            line[name] = sum(us for kernel, us in times.items() if name == "jnp" or MERGE_KERNEL in kernel)
        key = f"{batch}x{splits}x{rows}{'I' if items else ''}"
        results[key] = line
        print(key, "  ".join(f"{name}: {us:.2f}" for name, us in line.items()),
              f"  jnp/mosaic {line['jnp'] / line['mosaic']:.2f}x", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for combine_compare.json")
    parser.add_argument("--cases", nargs="*", help="B x splits x rows, I for a balanced plan's merge "
                                                   "(default: DEFAULT_CASES)")
    parser.add_argument("--partial-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the partials' dtype (combine_splits.partial_dtype: bfloat16 for a bf16 output)")
    args = parser.parse_args(argv)
    try:
        cases = [parse_case(c) for c in args.cases or DEFAULT_CASES]
    except argparse.ArgumentTypeError as err:
        parser.error(f"--cases: {err}")
    if timing.missing_gpu("merge timing"):
        return 2
    results = {"environment": timing.environment(), "partial_dtype": args.partial_dtype,
               "us": compare(cases, args.partial_dtype)}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "combine_compare.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
