"""The split merge (pallas_kernels/combine_splits.py): its tile budget, or side by side with the
Triton merge it replaces and the jnp merge XLA would run.

    python scripts/tune_combine_splits.py --out $OUT [--cases 1x66x128 1x8x16T 64x8x128I ...]
    python scripts/tune_combine_splits.py --out $OUT --compare [--cases ...] [--partial-dtype bfloat16]

A case is B x splits x rows: "T" for the 16-row Mosaic kernel's transposed partials ([B, S,
512, rows]), "I" for a balanced plan's merge (``combine_items``: every row S items, the
decode's chunk, S rounded up to a power of two) instead of ``combine_splits``. Each case runs
with each ``--partial-dtype`` (bfloat16: the partials of a bf16 output, merged into bf16;
float32: merged into float32, ``combine_splits.partial_dtype``).

Times are the GPU time of one call from the JAX profiler (``timing.kernel_times_us``: these
are 1-15 us, below what a wall clock resolves), two columns each: "kernel", the merge's own
launch (for jnp the whole call), and "call", every GPU activity of the call (with "I" the
copies of the merged outputs that the in-place update makes of arguments not donated).

Default: the Mosaic merge at each ``max_tile`` of ``TILES`` (partial values a CTA loads in one
step), written to combine_tune.json. ``--compare``: the Mosaic merge, the Triton one
(combine_splits_triton.py) and the jnp reference, written to combine_compare.json; both print
a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import snapmla_jax.pallas_kernels.combine_splits as combine
import snapmla_jax.pallas_kernels.combine_splits_triton as combine_triton
from snapmla_jax.bench import timing

DEFAULT_CASES = ("1x8x16T", "1x33x16T", "1x128x16T", "8x16x32T", "64x4x16T", "64x2x32T", "1x8x128", "1x17x128",
                 "1x33x128", "1x66x128", "4x33x128", "32x2x128", "16x4x128", "1x8x128I", "1x66x128I", "64x8x128I",
                 "1x8x16TI", "64x4x16TI")
TILES = (2048, 4096, 8192, 16384)
CALLS = 50
MERGE_KERNEL = "combine"  # in the names of both merges' launches (snapmla_combine_splits, snapmla_combine_items)


class Case(NamedTuple):
    batch: int
    splits: int
    rows: int
    transposed: bool
    items: bool

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.splits}x{self.rows}{'T' if self.transposed else ''}{'I' if self.items else ''}"


def parse_case(text: str) -> Case:
    """"BxSxROWS[T][I]" -> Case(batch, splits, rows, transposed, items)."""
    items = text.endswith("I")
    body = text.removesuffix("I")
    transposed = body.endswith("T")
    parts = body.removesuffix("T").split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a case like 1x66x128, 1x8x16T or 64x8x128I (B x splits x rows), "
                                         f"got {text!r}")
    return Case(*map(int, parts), transposed, items)


def case_calls(case: Case, partial) -> dict:
    """name -> (fn, args) of each merge of ``case`` with ``partial`` partials: "mosaic", "triton"
    and "jnp" (the reference, after a transposing copy for "T")."""
    batch, splits, rows, transposed, items = case
    out_dtype = jnp.bfloat16 if partial == jnp.bfloat16 else jnp.float32
    keys = jax.random.split(jax.random.key(0), 2)
    if not items:
        out = jax.random.normal(keys[0], (batch, splits, 512, rows) if transposed else (batch, splits, rows, 512),
                                partial)
        lse = jax.random.normal(keys[1], (batch, splits, rows))
        args = (out, lse)
        calls = {name: jax.jit(lambda o, l, module=module: module.combine_splits(o, l, out_dtype,
                                                                                  transposed=transposed))
                 for name, module in (("mosaic", combine), ("triton", combine_triton))}
        calls["jnp"] = jax.jit(lambda o, l: combine.combine_splits_reference(o.swapaxes(2, 3) if transposed else o, l))
        return {name: (fn, args) for name, fn in calls.items()}
    width = batch * splits
    out = jax.random.normal(keys[0], (width, 512, rows) if transposed else (width, rows, 512), partial)
    lse = jax.random.normal(keys[1], (width, rows))
    starts = jnp.arange(batch, dtype=jnp.int32) * splits
    counts = jnp.full((batch,), splits, jnp.int32)
    args = (out, lse, starts, counts, jnp.zeros((batch, rows, 512), out_dtype), jnp.zeros((batch, rows), jnp.float32))
    chunk = pl.next_power_of_2(max(splits, 2))  # as mla_decode_mgpu.merge_items
    calls = {name: jax.jit(lambda *a, module=module: module.combine_items(*a, chunk=chunk, transposed=transposed))
             for name, module in (("mosaic", combine), ("triton", combine_triton))}
    calls["jnp"] = jax.jit(lambda o, *a: combine.combine_items_reference(o.swapaxes(1, 2) if transposed else o, *a))
    return {name: (fn, args) for name, fn in calls.items()}


def times_us(fn, args) -> dict[str, float]:
    """{"kernel": the merge launch's us a call (every launch's if none is named for it), "call":
    all of the call's GPU time}."""
    kernels = timing.kernel_times_us(fn, args, calls=CALLS)
    merge = [us for name, us in kernels.items() if MERGE_KERNEL in name]
    return {"kernel": sum(merge) if merge else sum(kernels.values()), "call": sum(kernels.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for combine_tune.json or combine_compare.json")
    parser.add_argument("--cases", type=parse_case, nargs="*", default=[parse_case(c) for c in DEFAULT_CASES])
    parser.add_argument("--partial-dtype", choices=("float32", "bfloat16"), nargs="+",
                        default=["bfloat16", "float32"], help="the partials' dtypes (combine_splits.partial_dtype)")
    parser.add_argument("--compare", action="store_true",
                        help="the Mosaic merge against the Triton one and the jnp reference, at the default tile")
    args = parser.parse_args(argv)
    if timing.missing_gpu("merge tuning"):
        return 2
    results = {"environment": timing.environment(), "cases": {}}
    columns = (["mosaic", "triton", "jnp"] if args.compare else [f"tile {tile}" for tile in TILES])
    header = ["case", "partials"] + [f"{c} {part}" for c in columns for part in ("kernel", "call")]
    rows = []
    default_max_tile = combine.max_tile
    for case in args.cases:
        for partial_name in args.partial_dtype:
            partial = jnp.dtype(partial_name)
            line = {}
            if args.compare:
                for name, (fn, call_args) in case_calls(case, partial).items():
                    line[name] = times_us(fn, call_args)
            else:
                for tile in TILES:
                    combine.max_tile = lambda num_splits, tile=tile: tile
                    jax.clear_caches()  # the merges' jit caches would hand back the previous tile
                    fn, call_args = case_calls(case, partial)["mosaic"]
                    line[f"tile {tile}"] = times_us(fn, call_args)
                combine.max_tile = default_max_tile
            results["cases"][f"{case.name} {partial_name}"] = line
            rows.append([case.name, partial_name] + [f"{line[c][part]:.2f}" for c in columns
                                                      for part in ("kernel", "call")])
            print("  ".join(rows[-1]), flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "combine_compare" if args.compare else "combine_tune"
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1))
    table = timing.markdown_table(header, rows)
    (out_dir / f"{name}.md").write_text(f"{json.dumps(results['environment'])}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
