"""Time decoding over the same cache contents in pages of 64, 32 and 16 tokens, side by side (GPU).

    python tools/time_page_sizes.py --dtype fp8 --out $OUT 8x4096x16x1 32x16384x128x1
    python tools/time_page_sizes.py --dtype bf16 --out $OUT 1x4096x16x1 64x16384x16x1

For each shape BxCONTEXTxHxS_Q: the decode benchmark's random caches (``bench.decode.make_caches``,
64-token pages, ``chain_layers`` layers) and the same tokens as pages of 32 and 16
(``repaged``: page p of 64 tokens is pages k p .. k p + k - 1 of 64 / k), then ``mla_decode`` a
chain of layers (``bench.decode.decode_chain``) by the default kernel (on Hopper the Mosaic GPU
kernels) at each page size, timed round-robin (``timing.time_round_robin``), ms a call. ``same_bits`` says whether the
default kernel's output at 32 and 16 is the one at 64, bit for bit, as the Mosaic kernels'
step order makes it. Writes time_page_sizes_<dtype>.json under --out and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax.numpy as jnp
import numpy as np

from snapmla_jax.bench import decode as bench_decode
from snapmla_jax.bench import timing
from snapmla_jax.cache import LatentCache

PAGE_SIZES = (64, 32, 16)  # the default kernel's pages, the cache's own first


def repaged(cache: LatentCache, block_table, page_size: int) -> tuple[LatentCache, object]:
    """``cache`` of 64-token pages (with or without a layer axis) and its block table [B, P] as
    pages of ``page_size`` tokens: the same arrays reshaped, each table entry p the k = 64 /
    page_size entries k p .. k p + k - 1."""
    k = 64 // page_size
    tokens = lambda a: None if a is None else a.reshape(*a.shape[:cache.latent.ndim - 3], -1, page_size,
                                                      *a.shape[cache.latent.ndim - 1:])
    pages = LatentCache(latent=tokens(cache.latent), scale=tokens(cache.scale), rope=tokens(cache.rope))
    table = (block_table[:, :, None] * k + jnp.arange(k, dtype=block_table.dtype)).reshape(block_table.shape[0], -1)
    return pages, table


def measure(shape: tuple[int, int, int, int], dtype: str, iters: int) -> dict:
    """One shape's row: ms a call of each run, and whether the default kernel's bits hold."""
    batch, context, heads, s_q = shape
    layers = bench_decode.chain_layers(batch, context)
    fp8, bf16, table = bench_decode.make_caches(batch, context, layers=layers)
    cache = fp8 if dtype == "fp8" else bf16
    q, q_rope, seq_lens, scale = bench_decode.make_queries(batch, context, heads, s_q)
    runs, outputs = {}, {}
    for size in PAGE_SIZES:
        paged, paged_table = (cache, table) if size == 64 else repaged(cache, table, size)
        args = (q, q_rope, paged, paged_table, seq_lens)
        default = bench_decode.decode_chain(scale, layers, "pallas")
        runs[f"default_{size}"] = (default, [args])
        outputs[size] = np.asarray(default(*args).astype(jnp.float32))
    times = timing.time_round_robin(runs, iters=iters, min_sample_ms=10)
    row = {"shape": "x".join(map(str, shape)), "layers": layers,
           "same_bits": {size: bool(np.array_equal(outputs[64], outputs[size])) for size in PAGE_SIZES[1:]}}
    for name, result in times.items():
        row[f"{name}_ms"] = result / layers if isinstance(result, float) else None
        if not isinstance(result, float):
            row[f"{name}_note"] = f"{type(result).__name__}: {str(result).splitlines()[0][:160]}"
    return row


def to_markdown(rows: list[dict]) -> str:
    names = [f"default_{s}" for s in PAGE_SIZES]
    cell = lambda v: "-" if v is None else f"{v:.4f}" if v < 0.1 else f"{v:.3f}"
    lines = ["| B x ctx x H x s_q | " + " | ".join(n.replace("_", ", ") for n in names) + " | same bits |",
             "|---" * (len(names) + 2) + "|"]
    for row in rows:
        same = all(row["same_bits"].values())
        lines.append(f"| {row['shape'].replace('x', ' x ')} | "
                     + " | ".join(cell(row.get(f"{n}_ms")) for n in names) + f" | {'yes' if same else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", type=bench_decode.parse_shape, metavar="BxCTXxHxSQ")
    parser.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8", help="the cache's dtype")
    parser.add_argument("--iters", type=int, default=10, help="round-robin samples of each run")
    parser.add_argument("--out", default="/tmp/time_page_sizes", help="folder of the JSON results")
    args = parser.parse_args(argv)
    if timing.missing_gpu("time_page_sizes"):
        return 2
    rows = []
    for shape in args.shapes:
        rows.append(measure(shape, args.dtype, args.iters))
        print(json.dumps(rows[-1]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"env": timing.environment(), "dtype": args.dtype, "rows": rows}
    (out / f"time_page_sizes_{args.dtype}.json").write_text(json.dumps(results, indent=1))
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
