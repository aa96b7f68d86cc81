"""Rows padded in the inputs launch (working tree) against the fused plan (.devrun/ab/fused,
commit ca75eab) and main (99943de, .devrun/ab/main): FP8 decode calls, wall-clock round robin
(chained layers as the bench) and per-call GPU launches from a trace.
PYTHONPATH=.:.devrun/ab/main:.devrun/ab/fused python .devrun/ab12.py --out $OUT"""
import argparse, json, pathlib, statistics
import numpy as np
import jax, jax.numpy as jnp
from snapmla_jax.bench import decode as nb
from snapmla_jax.bench import timing
import snapmla_jax_main, snapmla_jax_fused
from snapmla_jax_main.bench import decode as mb
from snapmla_jax_fused.bench import decode as fb


def conv(c, pkg):
    return pkg.LatentCache(latent=c.latent, scale=c.scale, rope=c.rope)


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", nargs="*", default=[
        "8x1024x16x2", "64x4096x16x2", "128x16384x16x2", "32x16384x32x1", "64x4096x24x2", "8x4096x8x1",
        "32x16384x128x1"])
    a = ap.parse_args(); out = pathlib.Path(a.out); out.mkdir(parents=True, exist_ok=True)
    res = {"env": timing.environment()}
    for case in a.cases:
        B, ctx, H, sq = map(int, case.split("x"))
        layers = nb.chain_layers(B, ctx)
        fp8, bf16, bt = nb.make_caches(B, ctx, layers=layers)
        q, q_rope, seq_lens, scale = nb.make_queries(B, ctx, H, sq)
        args = (q, q_rope, fp8, bt, seq_lens)
        margs = (q, q_rope, conv(fp8, snapmla_jax_main), bt, seq_lens)
        fargs = (q, q_rope, conv(fp8, snapmla_jax_fused), bt, seq_lens)
        runs = {"main": (mb.decode_chain(scale, layers, "pallas"), [margs]),
                "fused": (fb.decode_chain(scale, layers, "pallas"), [fargs]),
                "padded": (nb.decode_chain(scale, layers, "pallas"), [args]),
                "twin": (nb.decode_chain(scale, layers, "pallas"), [(q, q_rope, bf16, bt, seq_lens)])}
        outs = {k: np.asarray(jax.block_until_ready(f(*x[0])), np.float32) for k, (f, x) in runs.items() if k != "twin"}
        row = {"layers": layers, "same_bits_fused": bool(np.array_equal(outs["main"], outs["fused"])),
               "same_bits_padded": bool(np.array_equal(outs["main"], outs["padded"])),
               "finite": bool(np.isfinite(outs["padded"]).all())}
        one = lambda c: c.layer_arrays(0) if c.num_layers else c
        for name, f, x in (("main", mb.decode_chain(scale, 1, "pallas"), (q, q_rope, conv(one(fp8), snapmla_jax_main), bt, seq_lens)),
                           ("fused", fb.decode_chain(scale, 1, "pallas"), (q, q_rope, conv(one(fp8), snapmla_jax_fused), bt, seq_lens)),
                           ("padded", nb.decode_chain(scale, 1, "pallas"), (q, q_rope, one(fp8), bt, seq_lens)),
                           ("twin", nb.decode_chain(scale, 1, "pallas"), (q, q_rope, one(bf16), bt, seq_lens))):
            ev = timing.gpu_events(f, x, calls=5)
            row[f"{name}_kernels_us"] = {k: round(v, 2) for k, v in timing.kernel_totals_us(ev, 5).items()}
        reps = []
        for rep in range(a.reps):
            reps.append({k: v / layers for k, v in timing.time_round_robin(runs, iters=15, min_sample_ms=10).items()})
        row["ms"] = reps
        for n in ("fused", "padded", "twin"):
            row[f"{n}_over_main"] = [r[n] / r["main"] for r in reps]
        row["padded_over_fused"] = [r["padded"] / r["fused"] for r in reps]
        row["padded_over_twin"] = [r["padded"] / r["twin"] for r in reps]
        res[case] = row
        f3 = lambda xs: " ".join("%.3f" % x for x in xs)
        print(case, "L", layers, "bits", row["same_bits_fused"], row["same_bits_padded"],
              "| fused/main", f3(row["fused_over_main"]), "| padded/main", f3(row["padded_over_main"]),
              "| padded/fused", f3(row["padded_over_fused"]), "| padded/twin", f3(row["padded_over_twin"]),
              "| ms", {k: round(statistics.median(r[k] for r in reps), 4) for k in runs}, flush=True)
        for n in ("main", "fused", "padded", "twin"):
            print("    ", n, row[f"{n}_kernels_us"], flush=True)
        (out / "rows_padded.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
