"""fused-inputs-plan (working tree) against main (.devrun/ab/main): FP8 decode calls, wall-clock
round robin (chained layers, as the bench) and per-call GPU launches/spans from a trace.
PYTHONPATH=.:.devrun/ab/main python .devrun/ab11.py --out $OUT
(.devrun/ab/main: main at 99943de, packages renamed pallas_kernels_main / snapmla_jax_main)"""
import argparse, json, pathlib, statistics
import numpy as np
import jax, jax.numpy as jnp
from snapmla_jax.bench import decode as nb
from snapmla_jax.bench import timing
import snapmla_jax_main
from snapmla_jax_main.bench import decode as mb


def conv(c):
    return snapmla_jax_main.LatentCache(latent=c.latent, scale=c.scale, rope=c.rope)


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", nargs="*", default=[
        "1x1024x16x1", "8x1024x16x1", "8x1024x128x1", "8x4096x128x1", "32x1024x128x1", "32x4096x128x1",
        "8x16384x16x1", "32x16384x128x1", "32x16384x128x1r", "64x4096x16x2"])
    a = ap.parse_args(); out = pathlib.Path(a.out); out.mkdir(parents=True, exist_ok=True)
    res = {"env": timing.environment()}
    for case in a.cases:
        ragged = case.endswith("r")
        B, ctx, H, sq = map(int, case.rstrip("r").split("x"))
        layers = nb.chain_layers(B, ctx)
        fp8, bf16, bt = nb.make_caches(B, ctx, layers=layers)
        q, q_rope, seq_lens, scale = nb.make_queries(B, ctx, H, sq)
        if ragged:
            seq_lens = jax.random.randint(jax.random.key(3), (B,), 0, ctx + 1, jnp.int32)
        args = (q, q_rope, fp8, bt, seq_lens)
        margs = (q, q_rope, conv(fp8), bt, seq_lens)
        runs = {"main": (mb.decode_chain(scale, layers, "pallas"), [margs]),
                "fused": (nb.decode_chain(scale, layers, "pallas"), [args]),
                "twin": (nb.decode_chain(scale, layers, "pallas"), [(q, q_rope, bf16, bt, seq_lens)])}
        o_m = np.asarray(jax.block_until_ready(runs["main"][0](*margs)), np.float32)
        o_f = np.asarray(jax.block_until_ready(runs["fused"][0](*args)), np.float32)
        row = {"layers": layers, "same_bits": bool(np.array_equal(o_m, o_f)), "finite": bool(np.isfinite(o_f).all())}
        # launches and GPU span of one layer's call
        one_m, one_f = mb.decode_chain(scale, 1, "pallas"), nb.decode_chain(scale, 1, "pallas")
        one = lambda c: c.layer_arrays(0) if c.num_layers else c
        a1 = (q, q_rope, one(fp8), bt, seq_lens)
        am = (q, q_rope, conv(one(fp8)), bt, seq_lens)
        for name, f, x in (("main", one_m, am), ("fused", one_f, a1)):
            ev = timing.gpu_events(f, x, calls=5)
            row[f"{name}_kernels_us"] = {k: round(v, 2) for k, v in timing.kernel_totals_us(ev, 5).items()}
            row[f"{name}_timeline_us"] = {k: round(v, 2) for k, v in timing.timeline_us(ev, 5).items()}
        reps = []
        for rep in range(a.reps):
            t = {k: v / layers for k, v in timing.time_round_robin(runs, iters=15, min_sample_ms=10).items()}
            reps.append(t)
        row["ms"] = reps
        row["fused_over_main"] = [r["fused"] / r["main"] for r in reps]
        row["fused_over_twin"] = [r["fused"] / r["twin"] for r in reps]
        row["main_over_twin"] = [r["main"] / r["twin"] for r in reps]
        res[case] = row
        print(case, "L", layers, "same", row["same_bits"], "fused/main", ["%.3f" % x for x in row["fused_over_main"]],
              "main/twin", ["%.3f" % x for x in row["main_over_twin"]], "fused/twin", ["%.3f" % x for x in row["fused_over_twin"]],
              "ms main %.4f fused %.4f" % (statistics.median(r["main"] for r in reps), statistics.median(r["fused"] for r in reps)),
              "\n   main", row["main_kernels_us"], row["main_timeline_us"], "\n   fused", row["fused_kernels_us"], row["fused_timeline_us"], flush=True)
        (out / "fused_plan.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
