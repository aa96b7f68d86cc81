"""Split-KV counts for ``mla_decode``'s kernels at small batch: time each count given, side by side.

    python scripts/sweep_splits.py --out $OUT [--cases 1x4096x128x1:4,8,16,32 ...]
        [--caches fp8 bf16] [--rounds 5]

Same caches and queries as ``python -m snapmla_jax.bench decode`` (page 64, every
row at the full context). Each case runs ``mla_decode`` with the kernel the
library picks for that cache (fp8: the Mosaic GPU kernels on Hopper; bf16: the
BF16 twin) and an explicit ``num_splits``; the count ``choose_num_splits``
picks is marked "(chosen)".

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
import pathlib
import sys

from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import chain_calls, chain_layers, decode_chain, make_caches, make_queries
from snapmla_jax.decode import planned_num_splits

CASES = ("1x1024x128x1:1,2,4,8", "1x4096x128x1:4,8,16,32", "8x4096x128x1:4,8,16", "32x4096x128x1:1,2,4",
         "1x16384x128x1:16,32,64", "8x16384x128x1:4,8,16", "1x4096x16x1:8,16,32,64", "8x4096x16x1:4,8,16,32",
         "1x65536x16x1:32,64,128")
MIN_SAMPLE_MS = 5.0


def parse_case(text: str) -> tuple[tuple[int, int, int, int], list[int]]:
    """"BxCONTEXTxHxS_Q:SPLITS,SPLITS,..." -> ((B, context, H, s_q), [splits, ...]), all positive;
    argparse.ArgumentTypeError naming the form otherwise."""
    try:
        shape, counts = text.split(":")
        dims = tuple(int(v) for v in shape.split("x"))
        splits = [int(v) for v in counts.split(",")]
        if len(dims) == 4 and min(*dims, *splits) > 0:
            return dims, splits
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected BxCONTEXTxHxS_Q:SPLITS,SPLITS,... of positive ints "
                                     f"(e.g. 1x4096x16x1:8,16), got {text!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/sweep_splits")
    parser.add_argument("--cases", nargs="*", type=parse_case, default=[parse_case(case) for case in CASES],
                        help="BxCONTEXTxHxS_Q:SPLITS,SPLITS,...")
    parser.add_argument("--caches", nargs="*", default=("fp8", "bf16"), choices=("fp8", "bf16"))
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (one sample of each count a round)")
    args = parser.parse_args(argv)
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
            results["chosen"][f"{shape} {cache_name}"] = chosen
            for splits in sorted({*counts, chosen}):
                key = f"{shape} {cache_name} splits={splits}" + (" (chosen)" if splits == chosen else "")
                runs[key] = (decode_chain(scale, layers, "pallas", num_splits=splits),
                             [(q, q_rope, cache, block_table, seq_lens)])
        times = timing.time_round_robin(runs, iters=args.rounds, min_sample_ms=MIN_SAMPLE_MS)
        for key, ms in times.items():
            results["ms"][key] = ms / chain_calls(layers) if isinstance(ms, float) else repr(ms)
            print(key, results["ms"][key], flush=True)
        (out_dir / "split_sweep.json").write_text(json.dumps(results, indent=1))
        del fp8, bf16
    return 0


if __name__ == "__main__":
    sys.exit(main())
