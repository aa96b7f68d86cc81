"""The split merges side by side: the Triton merge's tile size and warps, or the Mosaic GPU merge
against the Triton one and the jnp merge XLA would run.

    python scripts/tune_combine_splits.py --out $OUT [--cases 1x66x128 1x8x16 ...]
    python scripts/tune_combine_splits.py --out $OUT --compare [--cases 1x66x128 64x8x128I ...]

A case is B x splits x rows, "I" at its end for a balanced plan's merge (``combine_items``:
every row S items, loaded S rounded up to a power of two at a time, as the decode's chunk)
instead of ``combine_splits``; ``--partial-dtype bfloat16`` for the bf16 partials of a bf16
output (``combine_splits.partial_dtype``). Times are the GPU time of the launches of one call
from the JAX profiler (``timing.kernel_times_us``: these are 1-30 us, below what a wall clock
resolves); for "I" only the merge's own launch (not the copies of the outputs that an
in-place update makes of arguments it does not own).

Default: the Triton merge (pallas_kernels/combine_splits.py) at each (``max_tile``, warps) of
``SETTINGS`` and the jnp merge, written to combine_tune.json. ``--compare``: the Mosaic GPU
merge (combine_splits_mgpu.py, the Mosaic decode kernels'), the Triton one and the jnp one,
written to combine_compare.json.
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

DEFAULT_CASES = ("1x8x16", "1x33x16", "1x128x16", "8x16x32", "64x2x32", "1x8x128", "1x17x128", "1x33x128",
                 "1x66x128", "4x33x128", "32x2x128", "16x4x128")
# --compare's default: the merges the decode calls of the benchmark pages run (uniform plans of
# 16-, 32- and 64-row blocks, and balanced plans' items).
COMPARE_CASES = ("1x8x16", "1x66x16", "8x16x32", "1x8x128", "1x66x128", "4x33x128", "32x2x128", "16x4x128",
                 "1x8x128I", "1x66x128I", "8x8x128I", "64x8x128I", "72x8x128I")
SETTINGS = ((4096, 4), (4096, 2), (8192, 2), (8192, 4), (2048, 4))
CALLS = 50
MERGE_KERNEL = "combine"  # in the names of every merge's launches (snapmla_combine_splits, _items, ..._mgpu)


def parse_case(text: str) -> tuple[int, int, int]:
    """"BxSxROWS" -> (batch, splits, rows)."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a case like 1x66x128 (B x splits x rows), got {text!r}")
    return tuple(map(int, parts))


def parse_compare_case(text: str) -> tuple[int, int, int, bool]:
    """"BxSxROWS[I]" -> (batch, splits, rows, items)."""
    return (*parse_case(text.removesuffix("I")), text.endswith("I"))


def merge_calls(batch: int, splits: int, rows: int, items: bool, partial) -> dict:
    """name -> (fn, args) of each merge of a case: "mosaic", "triton" and "jnp"."""
    output = jnp.bfloat16 if partial == "bfloat16" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 2)
    out = jax.random.normal(keys[0], (batch, splits, rows, 512), partial)
    lse = jax.random.normal(keys[1], (batch, splits, rows))
    if not items:
        return {"mosaic": (jax.jit(lambda o, l: combine_mgpu.combine_splits_mgpu(o, l, output)), (out, lse)),
                "triton": (jax.jit(lambda o, l: combine.combine_splits(o, l, output)), (out, lse)),
                "jnp": (jax.jit(combine.combine_splits_reference), (out, lse))}
    chunk = pl.next_power_of_2(max(splits, 2))
    args = (out.reshape(batch * splits, rows, 512), lse.reshape(batch * splits, rows),
            jnp.arange(batch, dtype=jnp.int32) * splits, jnp.full((batch,), splits, jnp.int32),
            jnp.zeros((batch, rows, 512), output), jnp.zeros((batch, rows), jnp.float32))
    return {"mosaic": (jax.jit(lambda *a: combine_mgpu.combine_items_mgpu(*a, chunk=chunk)), args),
            "triton": (jax.jit(lambda *a: combine.combine_items(*a, chunk=chunk)), args),
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
              f"  triton/mosaic {line['triton'] / line['mosaic']:.2f}x", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for combine_tune.json")
    parser.add_argument("--cases", nargs="*", help="B x splits x rows (default: DEFAULT_CASES, or COMPARE_CASES "
                                                   "with --compare, which also takes an I suffix)")
    parser.add_argument("--compare", action="store_true",
                        help="the Mosaic GPU merge beside the Triton one and the jnp one")
    parser.add_argument("--partial-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the partials' dtype (combine_splits.partial_dtype: bfloat16 for a bf16 output)")
    args = parser.parse_args(argv)
    parse = parse_compare_case if args.compare else parse_case
    try:
        cases = [parse(c) for c in args.cases or (COMPARE_CASES if args.compare else DEFAULT_CASES)]
    except argparse.ArgumentTypeError as err:
        parser.error(f"--cases: {err}")
    if timing.missing_gpu("merge tuning"):
        return 2
    results = {"environment": timing.environment(), "partial_dtype": args.partial_dtype}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.compare:
        results["us"] = compare(cases, args.partial_dtype)
        (out_dir / "combine_compare.json").write_text(json.dumps(results, indent=1))
        return 0
    for batch, splits, rows in cases:
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
    (out_dir / "combine_tune.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
