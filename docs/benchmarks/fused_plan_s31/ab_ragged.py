"""ragged.md's 'finished' x H=16 moved 0.0935 -> 0.113 ms: current vs main (99943de) side by side,
ragged scenarios, round robin + per-call launches.
PYTHONPATH=.:.devrun/ab/main python .devrun/ab13.py --out $OUT"""
import argparse, json, math, pathlib, statistics
import numpy as np
import jax, jax.numpy as jnp
from snapmla_jax.bench import timing, ragged
from snapmla_jax.bench.decode import decode_chain, chain_layers, RANK, ROPE
import snapmla_jax_main
from snapmla_jax_main.bench.decode import decode_chain as main_chain


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", default=["finished:16", "finished:128", "uniform:16", "one_long:16"])
    a = ap.parse_args(); out = pathlib.Path(a.out); out.mkdir(parents=True, exist_ok=True)
    res = {"env": timing.environment()}
    for case in a.cases:
        name, heads = case.split(":"); heads = int(heads)
        lens = ragged.scenario_lens(name)
        layers = chain_layers(1, int(lens.sum()))
        fp8, bf16, table = ragged.make_ragged_caches(lens, layers)
        k = jax.random.split(jax.random.key(heads + 1), 2)
        q = jax.random.normal(k[0], (len(lens), 1, heads, RANK), jnp.bfloat16)
        q_rope = jax.random.normal(k[1], (len(lens), 1, heads, ROPE), jnp.bfloat16)
        sl = jnp.asarray(lens); scale = 1.0 / math.sqrt(RANK + ROPE)
        mc = snapmla_jax_main.LatentCache(latent=fp8.latent, scale=fp8.scale, rope=fp8.rope)
        runs = {"main": (main_chain(scale, layers), [(q, q_rope, mc, table, sl)]),
                "cur": (decode_chain(scale, layers), [(q, q_rope, fp8, table, sl)])}
        o = {n: np.asarray(jax.block_until_ready(f(*x[0])), np.float32) for n, (f, x) in runs.items()}
        row = {"layers": layers, "same_bits": bool(np.array_equal(o["main"], o["cur"]))}
        one = lambda c: c.layer_arrays(0) if c.num_layers else c
        m1 = snapmla_jax_main.LatentCache(latent=one(fp8).latent, scale=one(fp8).scale, rope=one(fp8).rope)
        for n, f, x in (("main", main_chain(scale, 1), (q, q_rope, m1, table, sl)),
                        ("cur", decode_chain(scale, 1), (q, q_rope, one(fp8), table, sl))):
            ev = timing.gpu_events(f, x, calls=5)
            row[f"{n}_kernels_us"] = {kk: round(v, 2) for kk, v in timing.kernel_totals_us(ev, 5).items()}
            row[f"{n}_timeline_us"] = {kk: round(v, 2) for kk, v in timing.timeline_us(ev, 5).items()}
        reps = [{kk: v / layers for kk, v in timing.time_round_robin(runs, iters=10, min_sample_ms=10).items()}
                for _ in range(3)]
        row["ms"] = reps
        row["cur_over_main"] = [r["cur"] / r["main"] for r in reps]
        res[case] = row
        print(case, "L", layers, "bits", row["same_bits"], "cur/main", ["%.3f" % x for x in row["cur_over_main"]],
              "ms", [("%.4f %.4f" % (r["main"], r["cur"])) for r in reps], flush=True)
        for n in ("main", "cur"):
            print("   ", n, row[f"{n}_kernels_us"], row[f"{n}_timeline_us"], flush=True)
        (out / "ab13.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
