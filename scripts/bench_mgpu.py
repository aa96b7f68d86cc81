"""Time the Mosaic GPU FP8 decode kernels' row blocks against each other and the BF16 twin.

    python scripts/bench_mgpu.py --out /tmp/bench_mgpu [--shapes 64x16384x128x1 ...]

Same caches and queries as ``python -m snapmla_jax.bench decode`` (page 64, every
row at the full context), each variant timed with warm-up and a median
(snapmla_jax/bench/timing.py), side by side in one run. Variants: the 64-row Mosaic
kernel ("mosaic", pallas_kernels/mla_decode_mgpu.py, the default above 32 rows), where
s_q x H <= 32 the 16-row kernel ("mosaic_small", mla_decode_mgpu_small.py, the
default up to 16 rows), where 16 < s_q x H <= 32 the same kernel in 32-row blocks
("mosaic_small32", the default there), all with KV splits from ``choose_num_splits``, and
the BF16 twin ``mla_decode`` runs on the bf16 cache ("mosaic_bf16"). Each FP8 output is
compared with the XLA path's on the same cache (relative L2 difference: the same roundings,
float32 sums and the GPU's ~14-bit FP8 accumulator apart). Writes bench_mgpu.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax.pallas_kernels.mla_decode_mgpu import BLOCK_M, mla_decode_mgpu
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import ROWS as SMALL_ROWS
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import mla_decode_mgpu_small
from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import make_caches, make_queries
from snapmla_jax.decode import _sm_count, choose_num_splits, min_tokens_per_split, mla_decode

SHAPES = ("64x16384x128x1", "32x16384x128x1", "128x4096x128x1", "8x65536x128x1", "128x16384x16x1",
          "32x4096x128x2")


def mgpu_decode(q, q_rope, cache, block_table, seq_lens, *, softmax_scale, small=False, small_rows=SMALL_ROWS,
                **kwargs):
    """A Mosaic kernel on the API's shapes (page 64, layer 0): ``mla_decode_mgpu``, or with
    ``small`` ``mla_decode_mgpu_small`` in blocks of ``small_rows`` (16 or 32); kwargs: num_splits."""
    if small:
        kernel, block_rows = functools.partial(mla_decode_mgpu_small, block_rows=small_rows), small_rows
    else:
        kernel, block_rows = mla_decode_mgpu, BLOCK_M
    batch, s_q, heads, rank = q.shape
    rows = s_q * heads
    padded = -(-rows // block_rows) * block_rows
    to_rows = lambda a: jnp.pad(a.reshape(batch, rows, a.shape[-1]), [(0, 0), (0, padded - rows), (0, 0)])
    flat = (cache.latent.reshape(-1, rank), cache.scale.reshape(-1), cache.rope.reshape(-1, cache.rope.shape[-1]))
    out, _ = kernel(to_rows(q), to_rows(q_rope), flat, block_table, seq_lens, jnp.zeros((1,), jnp.int32),
                    softmax_scale=softmax_scale, page_size=64, s_q=s_q, num_heads=heads, **kwargs)
    return out[:, :rows].reshape(q.shape)


def mosaic_splits(batch: int, rows: int, context: int, block_rows: int) -> int:
    """The KV split count ``mla_decode`` gives a Mosaic kernel of ``block_rows`` query rows a CTA,
    for ``rows`` (s_q x H) query rows a batch row at ``context`` tokens."""
    return choose_num_splits(batch, -(-rows // block_rows), context, _sm_count(),
                             min_tokens_per_split("fp8"))


def fp8_problem(shape: str, bf16: bool = False) -> tuple:
    """A shape "BxCONTEXTxHxS_Q" as the decode bench builds it, for the Mosaic probes: ((B, context,
    H, s_q), fp8 cache (with ``bf16`` the bf16 one), block_table, q, q_rope, seq_lens, softmax_scale)."""
    batch, context, heads, s_q = map(int, shape.split("x"))
    fp8, bf16_cache, block_table = make_caches(batch, context)
    return ((batch, context, heads, s_q), bf16_cache if bf16 else fp8, block_table,
            *make_queries(batch, context, heads, s_q))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/bench_mgpu")
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--variants", nargs="*", default=None, help="run only these variants (default: all)")
    args = parser.parse_args(argv)
    if timing.missing_gpu("bench_mgpu"):
        return 2
    results = {"env": timing.environment(), "rows": []}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        batch, context, heads, s_q = map(int, shape.split("x"))
        fp8, bf16, block_table = make_caches(batch, context)
        q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
        variants = {
            "mosaic": (fp8, jax.jit(lambda q, qr, c, bt, n: mgpu_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                        num_splits=splits))),
            # The BF16 twin mla_decode runs (mla_decode_mgpu_bf16*.py), with its split plan.
            "mosaic_bf16": (bf16, jax.jit(lambda q, qr, c, bt, n: mla_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                             backend="pallas"))),
        }
        # mla_decode's split rule for each kernel's row blocks.
        splits = mosaic_splits(batch, s_q * heads, context, BLOCK_M)
        small_splits = mosaic_splits(batch, s_q * heads, context, SMALL_ROWS)
        small32_splits = mosaic_splits(batch, s_q * heads, context, 32)
        if s_q * heads <= 2 * SMALL_ROWS:
            variants["mosaic_small"] = (fp8, jax.jit(lambda q, qr, c, bt, n: mgpu_decode(
                q, qr, c, bt, n, softmax_scale=scale, small=True, num_splits=small_splits)))
        if SMALL_ROWS < s_q * heads <= 32:
            variants["mosaic_small32"] = (fp8, jax.jit(lambda q, qr, c, bt, n: mgpu_decode(
                q, qr, c, bt, n, softmax_scale=scale, small=True, small_rows=32, num_splits=small32_splits)))
        row = {"shape": shape, "mosaic_num_splits": splits, "mosaic_small_num_splits": small_splits,
               "mosaic_small32_num_splits": small32_splits}
        outs = {}
        for name, (cache, fn) in variants.items():
            if args.variants is not None and name not in args.variants:
                continue
            call_args = (q, q_rope, cache, block_table, seq_lens)
            try:
                start = time.perf_counter()
                outs[name] = np.asarray(fn(*call_args), np.float64)
                compile_s = time.perf_counter() - start
                ms = timing.time_ms(fn, [call_args], warmup=2, iters=args.iters)
            except Exception as err:  # a variant that fails is a result
                row[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                print(shape, name, row[name], flush=True)
                continue
            row[name] = {"ms": ms, "first_call_s": compile_s}
            print(shape, name, json.dumps(row[name]), flush=True)
        xla = np.asarray(mla_decode(q, q_rope, fp8, block_table, seq_lens, softmax_scale=scale, backend="xla"),
                         np.float64)
        for mosaic in ("mosaic", "mosaic_small", "mosaic_small32"):
            if mosaic in outs:
                row[f"rel_l2_{mosaic}_vs_xla"] = float(np.linalg.norm(outs[mosaic] - xla) / np.linalg.norm(xla))
                row[f"{mosaic}_finite"] = bool(np.isfinite(outs[mosaic]).all())
                print(shape, mosaic, "rel_l2", row[f"rel_l2_{mosaic}_vs_xla"], flush=True)
            for name in ("mosaic", "mosaic_bf16"):
                if name != mosaic and isinstance(row.get(mosaic), dict) and isinstance(row.get(name), dict):
                    row[f"{mosaic}_speedup_vs_{name}"] = row[name]["ms"] / row[mosaic]["ms"]
        results["rows"].append(row)
        del fp8, bf16, outs
        (out_dir / "bench_mgpu.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
