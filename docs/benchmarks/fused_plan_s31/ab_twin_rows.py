"""The BF16 twin's rows padded (and its plan computed) in one launch, against the twin before
(.devrun/ab/fused = ca75eab, which pads with XLA): round robin + per-call launches.
PYTHONPATH=.:.devrun/ab/fused python .devrun/ab14.py --out $OUT"""
import argparse, json, pathlib
import numpy as np
import jax
from snapmla_jax.bench import decode as nb
from snapmla_jax.bench import timing
import snapmla_jax_fused
from snapmla_jax_fused.bench import decode as fb


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cases", nargs="*", default=["64x4096x16x2", "128x16384x16x2", "32x16384x32x1"])
    a = ap.parse_args(); out = pathlib.Path(a.out); out.mkdir(parents=True, exist_ok=True)
    res = {"env": timing.environment()}
    for case in a.cases:
        B, ctx, H, sq = map(int, case.split("x"))
        layers = nb.chain_layers(B, ctx)
        fp8, bf16, bt = nb.make_caches(B, ctx, layers=layers)
        q, q_rope, seq_lens, scale = nb.make_queries(B, ctx, H, sq)
        old = snapmla_jax_fused.LatentCache(latent=bf16.latent, scale=None, rope=bf16.rope)
        runs = {"twin_before": (fb.decode_chain(scale, layers, "pallas"), [(q, q_rope, old, bt, seq_lens)]),
                "twin": (nb.decode_chain(scale, layers, "pallas"), [(q, q_rope, bf16, bt, seq_lens)]),
                "fp8": (nb.decode_chain(scale, layers, "pallas"), [(q, q_rope, fp8, bt, seq_lens)])}
        o = {n: np.asarray(jax.block_until_ready(f(*x[0])), np.float32) for n, (f, x) in runs.items() if n != "fp8"}
        row = {"layers": layers, "same_bits": bool(np.array_equal(o["twin"], o["twin_before"]))}
        one = lambda c: c.layer_arrays(0) if c.num_layers else c
        ob = snapmla_jax_fused.LatentCache(latent=one(bf16).latent, scale=None, rope=one(bf16).rope)
        for n, f, x in (("twin_before", fb.decode_chain(scale, 1, "pallas"), (q, q_rope, ob, bt, seq_lens)),
                        ("twin", nb.decode_chain(scale, 1, "pallas"), (q, q_rope, one(bf16), bt, seq_lens))):
            ev = timing.gpu_events(f, x, calls=5)
            row[f"{n}_kernels_us"] = {k: round(v, 2) for k, v in timing.kernel_totals_us(ev, 5).items()}
        reps = [{k: v / layers for k, v in timing.time_round_robin(runs, iters=12, min_sample_ms=10).items()}
                for _ in range(a.reps)]
        row["ms"] = reps
        row["twin_over_before"] = [r["twin"] / r["twin_before"] for r in reps]
        row["fp8_over_twin"] = [r["twin"] / r["fp8"] for r in reps]
        res[case] = row
        print(case, "L", layers, "bits", row["same_bits"], "twin/before", ["%.3f" % x for x in row["twin_over_before"]],
              "twin/fp8 time", ["%.3f" % x for x in row["fp8_over_twin"]], "ms", reps, flush=True)
        for n in ("twin_before", "twin"):
            print("   ", n, row[f"{n}_kernels_us"], flush=True)
        (out / "ab14.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
