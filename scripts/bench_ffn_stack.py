"""Time a decode step's whole feed-forward stack (DeepSeek-V2-Lite shapes) per MoE dispatch and token count.

    python scripts/bench_ffn_stack.py --out /tmp/bench_ffn_stack [--tokens 1 2 4 8]

One layer alone (scripts/bench_moe.py) does not predict the stack: inside the 27-layer program
XLA compiles the jnp gathered dispatch differently.
Here the stack itself (``snapmla_jax.bench.e2e.feed_forward_stack``: one dense MLP, 26 MoE
layers, random bf16 weights) runs on x [T, 1, 2048], one jit each, side by side:

  ragged/dense  ``gather_max_tokens`` 0: the library's dense range (4, 512), ragged below it
  gathered      ``gather_max_tokens`` T, backend "xla": jnp, XLA gathers the chosen experts
  grouped       ``gather_max_tokens`` T, backend "pallas": the grouped-experts kernel
                (pallas_kernels/grouped_experts.py), what a decode step on a GPU runs

Times are ``timing.time_ms`` medians; the floor is the weight bytes a dispatch must read (all
but the unchosen experts', or all for dense) over the copy bandwidth measured in the run.
``--profile`` adds the grouped variant's GPU time per launch (``timing.kernel_times_us``) to
the JSON. Writes bench_ffn_stack.json / .md under --out.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import snapmla_jax.models.moe

from snapmla_jax import models
from snapmla_jax.bench import timing
from snapmla_jax.bench.e2e import V2_LITE, feed_forward_stack, random_model, routed_dispatch, weight_bytes_touched

PROFILE_TOP = 15  # launches kept per row with --profile
# name -> (gather_max_tokens of T tokens, backend)
VARIANTS = {"ragged/dense": (lambda tokens: 0, "xla"), "gathered": (lambda tokens: tokens, "xla"),
            "grouped": (lambda tokens: tokens, "pallas")}


def feed_forward_bytes(model, tokens: int, backend: str) -> int:
    """Weight bytes a T-token step's feed-forward stack reads with ``backend`` and the model's
    dispatch settings: ``weight_bytes_touched`` over the layers' feed-forward weights alone (norms,
    dense MLP, router, shared and routed experts)."""
    feed_forward = nnx.state(model, lambda path, _: "mlp" in path or "post_attention_layernorm" in path)
    return weight_bytes_touched(model.cfg, feed_forward, tokens, routed_dispatch(model, tokens, backend))[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="also record the grouped variant's GPU time per launch (JAX profiler), largest first")
    args = parser.parse_args(argv)
    if timing.missing_gpu("feed-forward stack benchmark"):
        return 2
    env = dict(timing.environment(), copy_gbps=timing.measure_copy_gbps())
    model = random_model(V2_LITE, jnp.bfloat16)
    rows = []
    for tokens in args.tokens:
        x = jax.random.normal(jax.random.key(tokens), (tokens, 1, V2_LITE.hidden_size), jnp.bfloat16)
        row, outs = {"tokens": tokens}, {}
        for name, (gather_max, backend) in VARIANTS.items():
            models.moe.set_gather_max_tokens(model, gather_max(tokens))
            graphdef, params = nnx.split(model)
            compiled = feed_forward_stack.lower(params, x, graphdef=graphdef, backend=backend).compile()
            outs[name] = np.asarray(compiled(params, x), np.float64)
            row[f"{name}_ms"] = timing.time_ms(compiled, [(params, x)], warmup=3, iters=args.iters)
            floor_bytes = feed_forward_bytes(model, tokens, backend)
            row[f"{name}_of_floor"] = floor_bytes / (env["copy_gbps"] * 1e9) * 1e3 / row[f"{name}_ms"]
            if args.profile and name == "grouped":
                launches = timing.kernel_times_us(compiled, (params, x))
                row["grouped_launch_us"] = dict(list(launches.items())[:PROFILE_TOP])
                row["grouped_launch_us_total"] = sum(launches.values())
            if name != "ragged/dense":
                row[f"{name}_rel_l2"] = float(np.linalg.norm(outs[name] - outs["ragged/dense"])
                                              / np.linalg.norm(outs["ragged/dense"]))
        print(row, flush=True)
        rows.append(row)
        timing.write_results(args.out, "bench_ffn_stack", env, rows, table(env, rows))
    models.moe.set_gather_max_tokens(model, models.moe.GATHER_MAX_TOKENS)
    print(table(env, rows))
    return 0


def table(env: dict, rows: list[dict]) -> str:
    header = (f"# The feed-forward stack per MoE dispatch (V2-Lite shapes)\n\nDevice: {env['device']}, jax "
              f"{env['jax']}, date {env['date']}; copy {env['copy_gbps']:.0f} GB/s. 27 layers (one dense MLP, 26 "
              "MoE), random bf16 weights, x [T, 1, 2048]; medians; % floor = weight bytes read / copy bandwidth "
              "/ time; rel. L2 to ragged/dense. `scripts/bench_ffn_stack.py`.\n\n")
    columns = ["T", "ragged/dense ms", "gathered (jnp) ms", "grouped (kernel) ms", "grouped vs best other",
               "ragged/dense % floor", "gathered % floor", "grouped % floor", "grouped rel. L2"]
    body = [[r["tokens"], r["ragged/dense_ms"], r["gathered_ms"], r["grouped_ms"],
             f"{min(r['ragged/dense_ms'], r['gathered_ms']) / r['grouped_ms']:.2f}x",
             f"{r['ragged/dense_of_floor']:.0%}", f"{r['gathered_of_floor']:.0%}", f"{r['grouped_of_floor']:.0%}",
             f"{r['grouped_rel_l2']:.1e}"] for r in rows]
    return header + timing.markdown_table(columns, body)


if __name__ == "__main__":
    raise SystemExit(main())
