"""Split-KV counts and plans for ``mla_decode``'s kernels: time each one given, side by side.

    python scripts/sweep_splits.py --out $OUT [--cases 1x4096x128x1:4,8,16,32 67x16384x128x1:split,wave ...]
        [--caches fp8 bf16] [--rounds 5]

Same caches and queries as ``python -m snapmla_jax.bench decode`` (page 64, every
row at the full context). Each case runs ``mla_decode`` with the kernel the
library picks for that cache (fp8: the Mosaic GPU kernels on Hopper; bf16: the
BF16 twin) and, for a number, that explicit ``num_splits`` (every row cut alike); the count
``choose_num_splits`` picks is marked "(chosen)". Past ``decode.UNIFORM_PLAN_MAX_TOKENS`` of
block-table capacity a case may also name the plans ``mla_decode`` chooses between
(``decode.choose_plan``): "split" (the balanced split plan of the chosen count) and "wave" (the
wave plan), each forced while the call compiles; the one ``mla_decode`` picks is marked
"(chosen)".

Timing: at these sizes one call is 10-150 us, so each sample is the decode benchmark's chain
(``bench.decode.decode_chain``): ``chain_calls`` calls inside one jit, call i over layer i mod
``chain_layers`` of a layered cache (so every call reads its cache from HBM, not from L2 as calls
over one cache would), each call's output the next call's query, divided by the chain's length.
All counts of a case are compiled first, then timed side by side (``timing.time_round_robin``, ``--rounds``
rounds in a shuffled order, samples of at least 5 ms), so that a drift of the GPU's clocks falls
on all of them alike. Writes split_sweep.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from unittest import mock

import jax

from snapmla_jax import decode
from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import chain_calls, chain_layers, decode_chain, make_caches, make_queries
from snapmla_jax.decode import planned_num_splits

# The plans a case may name, and the ``decode.WAVE_PLAN_STEPS`` that forces each while a call compiles.
PLANS = {"split": math.inf, "wave": -math.inf}

CASES = ("1x1024x128x1:1,2,4,8", "1x4096x128x1:4,8,16,32", "8x4096x128x1:4,8,16", "32x4096x128x1:1,2,4",
         "1x16384x128x1:16,32,64", "8x16384x128x1:4,8,16", "1x4096x16x1:8,16,32,64", "8x4096x16x1:4,8,16,32",
         "1x65536x16x1:32,64,128")
MIN_SAMPLE_MS = 5.0


def parse_case(text: str) -> tuple[tuple[int, int, int, int], list[int | str]]:
    """"BxCONTEXTxHxS_Q:SPLITS,SPLITS,..." -> ((B, context, H, s_q), [splits, ...]), dimensions and
    counts positive ints, or a count one of ``PLANS``; argparse.ArgumentTypeError naming the form
    otherwise."""
    try:
        shape, counts = text.split(":")
        dims = tuple(int(v) for v in shape.split("x"))
        splits = [v if v in PLANS else int(v) for v in counts.split(",")]
        if len(dims) == 4 and min(*dims, *(v for v in splits if isinstance(v, int)), 1) > 0:
            return dims, splits
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected BxCONTEXTxHxS_Q:SPLITS,SPLITS,... of positive ints or "
                                     f"{' / '.join(PLANS)} (e.g. 1x4096x16x1:8,16), got {text!r}")


def plan_run(scale: float, layers: int, plan: int | str, args: tuple):
    """The decode chain of ``plan``: an explicit split count, or a plan of ``PLANS``, forced through
    ``decode.WAVE_PLAN_STEPS`` while the chain is traced and compiled by a first call on ``args``
    (later calls on arguments of the same shapes reuse that executable)."""
    if isinstance(plan, int):
        return decode_chain(scale, layers, "pallas", num_splits=plan)
    chain = decode_chain(scale, layers, "pallas")
    with mock.patch.object(decode, "WAVE_PLAN_STEPS", PLANS[plan]):
        jax.block_until_ready(chain(*args))
    return chain


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/sweep_splits")
    parser.add_argument("--cases", nargs="*", type=parse_case, default=[parse_case(case) for case in CASES],
                        help="BxCONTEXTxHxS_Q:SPLITS,SPLITS,...")
    parser.add_argument("--caches", nargs="*", default=("fp8", "bf16"), choices=("fp8", "bf16"))
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (one sample of each count a round)")
    args = parser.parse_args(argv)
    for (batch, context, heads, s_q), counts in args.cases:
        if any(isinstance(v, str) for v in counts) and decode.uniform_plan_only(batch * context):
            print(f"--cases: {batch}x{context}x{heads}x{s_q} takes a uniform plan (at most "
                  f"{decode.UNIFORM_PLAN_MAX_TOKENS} tokens of capacity), so it cannot name {' / '.join(PLANS)}",
                  file=sys.stderr)
            return 2
    if timing.missing_gpu("sweep_splits"):
        return 2
    results = {"env": timing.environment(), "rounds": args.rounds, "layers": {}, "ms": {}, "chosen": {}}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for (batch, context, heads, s_q), counts in args.cases:
        shape = f"{batch}x{context}x{heads}x{s_q}"
        layers = chain_layers(batch, context)
        results["layers"][shape] = layers
        fp8, bf16, block_table = make_caches(batch, context, layers=layers)
        q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
        runs = {}
        for cache_name in args.caches:
            cache = fp8 if cache_name == "fp8" else bf16
            chosen = planned_num_splits(q, cache, block_table)
            wave = not decode.uniform_plan_only(batch * context) and decode.planned_split(q, cache, block_table)[1]
            picked = "wave" if wave else chosen  # what mla_decode runs
            results["chosen"][f"{shape} {cache_name}"] = picked
            call_args = (q, q_rope, cache, block_table, seq_lens)
            for splits in [*sorted({*(v for v in counts if isinstance(v, int)), chosen}),
                           *(v for v in PLANS if v in counts)]:
                key = f"{shape} {cache_name} splits={splits}" + (" (chosen)" if splits == picked else "")
                runs[key] = (plan_run(scale, layers, splits, call_args), [call_args])
        times = timing.time_round_robin(runs, iters=args.rounds, min_sample_ms=MIN_SAMPLE_MS)
        for key, ms in times.items():
            results["ms"][key] = ms / chain_calls(layers) if isinstance(ms, float) else repr(ms)
            print(key, results["ms"][key], flush=True)
        (out_dir / "split_sweep.json").write_text(json.dumps(results, indent=1))
        del fp8, bf16
    return 0


if __name__ == "__main__":
    sys.exit(main())
