"""``python -m snapmla_jax.bench ragged``: MLA decode over batches whose rows differ in length,
the split plan that follows each row's seq_len against one split count for all rows.

A serving batch is ragged: sequences of every length decode side by side, and some have
finished (seq_len 0). ``mla_decode`` gives the Mosaic kernels' CTAs to the rows in proportion
to their seq_lens (``pallas_kernels.split_plan.balanced_plan``, or past a wave of rows
``wave_plan``, which cuts the batch's steps into one segment an SM); passing ``num_splits`` cuts
every row into the same number of splits instead (``uniform_plan``), which is what the kernels
did before, and what leaves one long row among short ones to a few SMs.

Each scenario's rows share one random fp8 cache (and a bf16 copy), pages in order; the
methods are timed side by side, round-robin (``timing.time_round_robin``), as a chain of
``layers`` calls inside one jit (``decode.chain_layers`` on the batch's tokens), ms = the
chain / layers. Columns:

  tokens       sum of seq_lens (cached tokens the call reads)
  FP8 ms       default FP8 call (balanced or wave plan: ``decode.choose_plan``)
  FP8 uni ms   FP8 with ``num_splits`` = the count the default plan is sized for, every row cut
               into that many splits (the former behaviour)
  BF16 ms      default BF16 twin call (balanced or wave plan)
  bal/uni      FP8 uni ms / FP8 ms
  FP8/BF16     BF16 ms / FP8 ms
  % roof       roofline time of the tokens read (``decode.roofline_ms``, ceilings measured in
               the run) / FP8 ms

Writes ``ragged.json`` and ``ragged.md`` under ``--out`` (default: outside the source tree,
printed; ``--publish``: the repository's docs/benchmarks/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax import cli
from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import (MIN_SAMPLE_MS, PAGE, RANK, ROPE, chain_layers, decode_chain, method_work,
                                      random_caches, roofline_ms)
from snapmla_jax.cache import kernel_addressable
from snapmla_jax.decode import planned_num_splits


SCENARIOS = {
    "one_long": "B = 32: one row of 64k among 31 of 2k (a long document among chats)",
    "mixed": "B = 64: lengths log-uniform in [512, 32k]",
    "finished": "B = 32: half the rows at 16k, half finished (seq_len 0)",
    "uniform": "B = 32: every row at 16k (a control: both plans give each row the same splits)",
    "uniform128": ("B = 128: every row at 16k (a control: one split a row, so the balanced plan's "
                   "unused items and its merge launch are all it changes)"),
}


def scenario_lens(name: str, seed: int = 0) -> np.ndarray:
    """seq_lens [B] int32 of a scenario of ``SCENARIOS``."""
    rng = np.random.default_rng(seed)
    if name == "one_long":
        lens = np.full(32, 2048)
        lens[5] = 65536
    elif name == "mixed":
        lens = np.exp(rng.uniform(np.log(512), np.log(32768), 64)).astype(np.int64)
    elif name == "finished":
        lens = np.where(np.arange(32) % 2 == 0, 16384, 0)
    elif name == "uniform":
        lens = np.full(32, 16384)
    elif name == "uniform128":
        lens = np.full(128, 16384)
    else:
        raise ValueError(f"scenario: expected one of {list(SCENARIOS)}, got {name!r}")
    return lens.astype(np.int32)


def make_ragged_caches(lens: np.ndarray, layers: int = 1, seed: int = 0):
    """fp8 and bf16 caches holding each row's pages (in order, nothing for seq_len 0) with
    random contents (per-token magnitudes e^N(0,1)), and the block table [B, max pages] (past a
    row's pages, page 0: never read)."""
    pages_per_row = -(-lens // PAGE)
    fp8, bf16 = random_caches(max(int(pages_per_row.sum()), 1), layers, seed)
    table = np.zeros((len(lens), max(int(pages_per_row.max()), 1)), np.int32)
    first = np.concatenate([[0], np.cumsum(pages_per_row)[:-1]])
    for b, (start, n) in enumerate(zip(first, pages_per_row)):
        table[b, :n] = np.arange(start, start + n)
    return fp8, bf16, jnp.asarray(table)


def ragged_work(method: str, lens: np.ndarray, heads: int, s_q: int) -> tuple[int, int, int]:
    """(bytes, FP8 FLOPs, BF16 FLOPs) of one call over rows of ``lens`` (``decode.method_work``
    summed over the rows)."""
    parts = [method_work(method, 1, int(n), heads, s_q) for n in lens]
    return tuple(sum(p[i] for p in parts) for i in range(3))


def measure_scenario(name: str, heads: int, s_q: int, ceilings, *, iters: int, rounds: int | None) -> dict:
    lens = scenario_lens(name)
    batch, tokens = len(lens), int(lens.sum())
    layers = chain_layers(1, tokens)
    fp8, bf16, table = make_ragged_caches(lens, layers)
    k = jax.random.split(jax.random.key(heads + s_q), 2)
    q = jax.random.normal(k[0], (batch, s_q, heads, RANK), jnp.bfloat16)
    q_rope = jax.random.normal(k[1], (batch, s_q, heads, ROPE), jnp.bfloat16)
    seq_lens = jnp.asarray(lens)
    scale = 1.0 / math.sqrt(RANK + ROPE)
    splits = planned_num_splits(q, fp8, table)
    args = lambda cache: [(q, q_rope, cache, table, seq_lens)]
    runs = {"fp8": (decode_chain(scale, layers), args(fp8)),
            "fp8_uniform": (decode_chain(scale, layers, num_splits=splits), args(fp8)),
            "bf16": (decode_chain(scale, layers), args(bf16))}
    row = dict(scenario=name, batch=batch, tokens=tokens, max_len=int(lens.max()), heads=heads, s_q=s_q,
               layers=layers, num_splits=splits, measured_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    for method, result in timing.time_round_robin(runs, rounds=rounds, iters=iters,
                                                  min_sample_ms=MIN_SAMPLE_MS).items():
        if isinstance(result, Exception):
            row[f"{method}_ms"] = None
            row[f"{method}_note"] = f"{type(result).__name__}: {str(result).splitlines()[0][:160]}"
            continue
        row[f"{method}_ms"] = result / layers
    if row.get("fp8_ms"):
        if row.get("fp8_uniform_ms"):
            row["balanced_over_uniform"] = row["fp8_uniform_ms"] / row["fp8_ms"]
        if row.get("bf16_ms"):
            row["fp8_over_bf16"] = row["bf16_ms"] / row["fp8_ms"]
        row["fp8_roofline"] = roofline_ms(*ragged_work("fp8", lens, heads, s_q), ceilings) / row["fp8_ms"]
    return row


def to_markdown(env: dict, ceilings: dict, rows: list[dict]) -> str:
    fmt = lambda v, spec="{:.3g}": "-" if v is None else spec.format(v)
    table = timing.markdown_table(
        ["scenario", "B", "tokens", "longest", "H", "s_q", "layers", "splits", "FP8 ms", "FP8 uni ms", "BF16 ms",
         "bal/uni", "FP8/BF16", "FP8 % roof", "measured (UTC)"],
        [[r["scenario"], r["batch"], r["tokens"], r["max_len"], r["heads"], r["s_q"], r["layers"], r["num_splits"],
          fmt(r.get("fp8_ms")), fmt(r.get("fp8_uniform_ms")), fmt(r.get("bf16_ms")),
          fmt(r.get("balanced_over_uniform"), "{:.2f}x"), fmt(r.get("fp8_over_bf16"), "{:.2f}x"),
          fmt(r.get("fp8_roofline") and 100 * r["fp8_roofline"], "{:.0f}%"), r["measured_utc"]] for r in rows])
    measured = {r["scenario"] for r in rows}
    scenarios = "\n".join(f"- {name}: {text}" for name, text in SCENARIOS.items() if name in measured)
    return "\n".join([
        "# MLA decode over ragged batches",
        "",
        f"Device: {env['device']}, jax {env['jax']}, Python {env['python']}, date {env['date']}. Produced by "
        "`python -m snapmla_jax.bench ragged` (the published table with `--publish`).",
        f"Ceilings measured in this run: copy {ceilings['copy_gbps']:.0f} GB/s, BF16 GEMM "
        f"{ceilings['bf16_tflops']:.0f} TFLOP/s, FP8 GEMM {ceilings['fp8_tflops']:.0f} TFLOP/s.",
        "",
        f"Samples: {env.get('samples', 'see the command line')}.",
        "",
        "Scenarios (page_size 64; rows' pages in order):",
        scenarios,
        "",
        "FP8 = `mla_decode` defaults on the fp8 cache: its split plan gives each row CTAs in proportion to",
        "its seq_len (`pallas_kernels/split_plan.py`). FP8 uni = the same kernel with `num_splits` = \"splits\"",
        "(the count the default plan is sized for), every row cut into that many splits, as every call",
        "was before the balanced plan. BF16 = the BF16 twin's defaults: the Mosaic twins (16-row blocks up",
        "to 16 query rows, else 64-row), with the same plan. Times are medians of samples taken round-robin (one",
        "sample of each method a round, shuffled order: `timing.time_round_robin`); ms = one call (a",
        "chain of `layers` calls in one jit / layers). % roof: the",
        "roofline time of the tokens read (cache bytes / copy bandwidth, or FLOPs / GEMM rates) / FP8 ms.",
        "",
        table,
    ])


def main(argv: list[str] | None = None) -> int:
    """The benchmark; raises cli.UsageError for bad flags (``python -m snapmla_jax.bench ragged``
    prints it on one line, exit code 2); exit code 2 without a CUDA GPU."""
    parser = cli.Parser(prog="python -m snapmla_jax.bench ragged", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_bench_output_flags(parser, "ragged.json / ragged.md")
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS,
                        help="scenarios to measure (default: all, listed above)")
    parser.add_argument("--heads", type=int, nargs="*", default=[128, 16], help="head counts (default 128 16)")
    parser.add_argument("--s-q", type=int, nargs="*", dest="s_qs", default=[1],
                        help="query tokens per row (default 1)")
    parser.add_argument("--iters", type=int, default=10, help="timed samples per method (default 10)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="round-robin rounds (timing.time_round_robin; default: --iters, one sample a round)")
    args = parser.parse_args(argv)
    for flag, values in (("--heads", args.heads), ("--s-q", args.s_qs), ("--iters", [args.iters]),
                         ("--rounds", [] if args.rounds is None else [args.rounds])):
        if any(v < 1 for v in values):
            raise cli.UsageError(f"{flag}: expected ints >= 1, got {' '.join(map(str, values))}")
    out = cli.bench_output_dir(args)
    if timing.missing_gpu("ragged decode benchmark"):
        return 2
    env = dict(timing.environment(), samples=f"--iters {args.iters} --rounds {args.rounds or args.iters}")
    ceilings = timing.measure_ceilings()
    print(f"{env}\n{ceilings}", flush=True)
    ceil = dataclasses.asdict(ceilings)
    rows = []
    for name in args.scenarios:
        if not kernel_addressable(int(scenario_lens(name).sum())):
            continue
        for heads in args.heads:
            for s_q in args.s_qs:
                try:
                    row = measure_scenario(name, heads, s_q, ceilings, iters=args.iters, rounds=args.rounds)
                except Exception:
                    traceback.print_exc()
                    continue
                rows.append(row)
                print(json.dumps(row), flush=True)
                timing.write_results(out, "ragged", {**env, "ceilings": ceil}, rows,
                                     to_markdown(env, ceil, rows))
    print(to_markdown(env, ceil, rows))
    print(f"wrote {out / 'ragged.json'} and {out / 'ragged.md'}")
    return 0
