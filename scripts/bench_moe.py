"""Time one DeepSeek MoE layer with its routed experts ragged vs dense vs gathered vs sorted
(models/moe.py) at decode-sized token counts, against the weight-read floor: the measurement that
sets ``models.moe.DENSE_TOKEN_RANGE``, ``GATHER_MAX_TOKENS`` and ``SORTED_MIN_TOKENS`` (the
defaults of ``MoE.dense_token_range``, ``MoE.gather_max_tokens`` and ``MoE.sorted_min_tokens``).
The gathered dispatch runs twice, up to ``GATHER_BENCH_MAX`` tokens: "gathered" in jnp (backend "xla": XLA's gather copies the chosen experts) and "grouped"
as the grouped experts' Mosaic GPU launches (backend "pallas", the model's decode path on a
Hopper GPU: pallas_kernels/grouped_experts.py; interpreted on a CPU, for the tests). "sorted" runs
the assignments sorted by expert into chunks on the same grouped GEMM, at every T.

    python scripts/bench_moe.py --out /tmp/bench_moe [--shapes v2_lite v3] [--tokens 1 8 64 ...]

One layer (router, routed experts, shared experts) with random bf16 weights and random
tokens, each dispatch compiled ahead of time and timed with warm-up and a median
(snapmla_jax/bench/timing.py), side by side in one run. The floor is the bytes of the
weights the dispatch must read (ragged, gathered and sorted: the experts the router chose for
these tokens; dense: every expert; all: router and shared experts) over the copy bandwidth measured in
the run. A random router spreads tokens evenly over the experts, as a trained,
load-balanced one does. Writes bench_moe.json and bench_moe.md under --out.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import snapmla_jax.models.moe

from snapmla_jax import models
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.moe import MoE
from snapmla_jax.models.sharding import EXPERT_WEIGHTS
from snapmla_jax.bench import timing


@dataclasses.dataclass(frozen=True)
class MoEShape:
    hidden: int
    inner: int  # moe_intermediate_size
    experts: int
    top_k: int
    shared: int  # shared experts


# One MoE layer of each family (the models' config.json values).
SHAPES = {
    "v2": MoEShape(hidden=5120, inner=1536, experts=160, top_k=6, shared=2),
    "v2_lite": MoEShape(hidden=2048, inner=1408, experts=64, top_k=6, shared=2),
    "v3": MoEShape(hidden=7168, inner=2048, experts=256, top_k=8, shared=1),
}
# What a run without --shapes measures: the shapes the published pages' plain commands ran (V2's
# layer, 7.5 GB of bf16 experts, is asked for by name).
DEFAULT_SHAPES = ("v2_lite", "v3")
TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512)
# (MoE.dense_token_range, MoE.gather_max_tokens, MoE.sorted_min_tokens, backend of MoE.__call__) of
# each dispatch; "kernel": "pallas" on a GPU, "interpret" on a CPU.
DISPATCHES = {"ragged": (None, 0, None, "xla"), "dense": ((1, 1 << 30), 0, None, "xla"),
              "gathered": (None, 1 << 30, None, "xla"), "grouped": (None, 1 << 30, None, "kernel"),
              "sorted": ((1, 1 << 30), 0, 1, "kernel")}
# The gathered dispatches run one vector-matrix product an assignment (and in jnp copy T*k
# expert matrices a call): timed only for the few tokens they are meant for.
GATHER_BENCH_MAX = 16
GATHERED = ("gathered", "grouped")
# The dense dispatch multiplies every token by every expert: its temporaries, ~16 bytes an element of
# [tokens, experts, hidden], outgrow the GPU at prefill sizes (V3 at 2048 tokens asked for 56 GiB on an
# H200), and no model runs it there. Timed while that product has at most this many elements (V3 up
# to 585 tokens, V2-Lite up to 8192).
DENSE_BENCH_MAX_ELEMENTS = 1 << 30
# On a GPU, ragged_dot runs as a product over every group: its left operand expanded to
# [experts, tokens x k, hidden] bf16 (V3 at 2048 tokens: the 56 GiB an H200 refused, jax 0.11.2).
# Timed while that has at most this many elements (V3 up to 1170 tokens, V2-Lite up to 21845); past
# it a row has the other dispatches alone, their outputs compared with nothing.
RAGGED_BENCH_MAX_ELEMENTS = 1 << 34
WEIGHT_STD = 0.02


def moe_config(shape: MoEShape) -> MLAConfig:
    """An MLAConfig whose MoE layer has ``shape``: greedy top-k of sigmoid scores (the dispatch's cost
    does not depend on the routing rule); the attention fields are unused."""
    return MLAConfig(vocab_size=16, hidden_size=shape.hidden, intermediate_size=shape.inner, num_hidden_layers=1,
                     num_attention_heads=1, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=shape.experts, num_experts_per_tok=shape.top_k, n_shared_experts=shape.shared,
                     moe_intermediate_size=shape.inner, topk_method="greedy", scoring_func="sigmoid",
                     norm_topk_prob=True, routed_scaling_factor=2.5)


def random_layer(shape: MoEShape, dtype=jnp.bfloat16, seed: int = 0) -> MoE:
    """The layer with normal(0, WEIGHT_STD) weights drawn on the device in ``dtype`` (no float32
    copy of V3's 22 GB of experts)."""
    layer = nnx.eval_shape(lambda: MoE(moe_config(shape), dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(layer)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    filled = [jax.random.normal(key, leaf.shape, leaf.dtype) * jnp.asarray(WEIGHT_STD, leaf.dtype)
              for key, leaf in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, filled))


def floor_bytes(layer: MoE, x: jax.Array) -> dict[str, int]:
    """Weight bytes each dispatch must read for tokens x [T, hidden]: the router and shared
    experts, plus the chosen experts (ragged) or all of them (dense)."""
    _, ids = layer.gate(x)
    chosen = len(np.unique(np.asarray(ids)))
    per_expert = sum(getattr(layer, w)[...].nbytes for w in EXPERT_WEIGHTS) // layer.cfg.n_routed_experts
    shared = jax.tree.leaves(nnx.state(layer.shared_experts)) if layer.shared_experts is not None else []
    always = layer.gate.kernel[...].nbytes + sum(leaf.nbytes for leaf in shared)
    return {"ragged": always + chosen * per_expert, "dense": always + layer.cfg.n_routed_experts * per_expert,
            "chosen_experts": chosen}


def compiled_dispatches(layer: MoE, x: jax.Array) -> dict:
    """Per ``DISPATCHES`` entry (gathered only up to ``GATHER_BENCH_MAX`` tokens, dense and ragged
    up to ``DENSE_BENCH_MAX_ELEMENTS`` and ``RAGGED_BENCH_MAX_ELEMENTS``, sorted where its GEMMs
    take the stacks), the layer's call on x compiled ahead of time with that
    ``dense_token_range``, ``gather_max_tokens`` and ``sorted_min_tokens`` (the layer's own are
    restored after): ``(compiled, args)``.

    The dispatch is part of the graphdef, a static argument here, so each entry compiles its
    own program. (A closure over one graphdef, with the range a global read while tracing,
    once compiled the ragged program twice: jit's trace cache keys on the function.)"""
    call = jax.jit(lambda state, x, graphdef, backend: nnx.merge(graphdef, state)(x, backend=backend),
                   static_argnames=("graphdef", "backend"))
    kernel = "pallas" if jax.default_backend() == "gpu" else "interpret"
    saved = layer.dense_token_range, layer.gather_max_tokens, layer.sorted_min_tokens
    programs = {}
    try:
        for name, (token_range, gather_max, sorted_min, backend) in DISPATCHES.items():
            if name in GATHERED and x.shape[0] > GATHER_BENCH_MAX:
                continue
            if name == "dense" and x.shape[0] * layer.cfg.n_routed_experts * x.shape[1] > DENSE_BENCH_MAX_ELEMENTS:
                continue
            if (name == "ragged" and x.shape[0] * layer.cfg.num_experts_per_tok * layer.cfg.n_routed_experts
                    * x.shape[1] > RAGGED_BENCH_MAX_ELEMENTS):
                continue
            models.moe.set_dense_token_range(layer, token_range)
            models.moe.set_gather_max_tokens(layer, gather_max)
            layer.sorted_min_tokens = sorted_min
            backend = kernel if backend == "kernel" else backend
            runs = layer.dispatch(x.shape[0], backend)
            if name == "sorted" and runs != name:
                continue  # its GEMMs do not take these stacks (not bf16, or not whole tiles)
            if runs != name.replace("grouped", "gathered"):
                raise ValueError(f"{name}: the layer runs {runs!r} instead")
            graphdef, state = nnx.split(layer)
            programs[name] = (call.lower(state, x, graphdef=graphdef, backend=backend).compile(), (state, x))
    finally:
        models.moe.set_dense_token_range(layer, saved[0])
        models.moe.set_gather_max_tokens(layer, saved[1])
        layer.sorted_min_tokens = saved[2]
    return programs


def measure(shape_name: str, tokens: int, layer: MoE, copy_gbps: float, iters: int) -> dict:
    x = jax.random.normal(jax.random.key(tokens), (tokens, layer.cfg.hidden_size), jnp.bfloat16)
    floors = floor_bytes(layer, x)
    floors["gathered"] = floors["grouped"] = floors["sorted"] = floors["ragged"]  # the chosen experts
    programs = compiled_dispatches(layer, x)
    outs = {name: np.asarray(fn(*args), np.float64) for name, (fn, args) in programs.items()}
    row = {"shape": shape_name, "tokens": tokens, "chosen_experts": floors["chosen_experts"]}
    for name in programs:
        if name != "ragged" and "ragged" in outs:
            row[f"{name}_vs_ragged_rel_l2"] = float(np.linalg.norm(outs[name] - outs["ragged"])
                                                    / np.linalg.norm(outs["ragged"]))
    for name, (fn, args) in programs.items():
        ms = timing.time_ms(fn, [args], warmup=3, iters=iters)
        row[f"{name}_ms"] = ms
        row[f"{name}_floor_ms"] = floors[name] / (copy_gbps * 1e9) * 1e3
        row[f"{name}_of_floor"] = row[f"{name}_floor_ms"] / ms
        if name != "ragged" and "ragged_ms" in row:
            row[f"{name}_speedup"] = row["ragged_ms"] / ms
    return row


def max_rel_l2(row: dict) -> str:
    """The row's largest relative L2 distance of a dispatch's output to ragged's ("-": ragged alone,
    or not run)."""
    distances = [v for k, v in row.items() if k.endswith("_vs_ragged_rel_l2")]
    return f"{max(distances):.1e}" if distances else "-"


def table(env: dict, rows: list[dict]) -> str:
    header = (f"# MoE layer: ragged vs dense vs gathered vs sorted routed experts\n\nDevice: {env['device']}, jax "
              f"{env['jax']}, date {env['date']}; copy {env['copy_gbps']:.0f} GB/s. One layer (router, routed and "
              "shared experts), bf16, times are medians; floor = weight bytes the dispatch must read / copy "
              "bandwidth (ragged, gathered, sorted: the chosen experts; dense: all); speed-ups are over ragged; "
              "gathered = the gathered dispatch in jnp (XLA copies the chosen experts), grouped = the same "
              f"dispatch as the grouped-experts kernel; both are run up to T = {GATHER_BENCH_MAX}, dense while "
              f"tokens x experts x hidden <= {DENSE_BENCH_MAX_ELEMENTS:.3g}, ragged while tokens x k x experts x "
              f"hidden <= {RAGGED_BENCH_MAX_ELEMENTS:.3g} (on a GPU it multiplies by every expert); sorted = "
              "the assignments sorted by expert into chunks on the grouped GEMM. "
              "`scripts/bench_moe.py`.\n\n")
    columns = ["shape", "T", "experts chosen", "ragged ms", "dense ms", "gathered ms", "grouped ms", "sorted ms",
               "dense speed-up", "gathered speed-up", "grouped speed-up", "sorted speed-up", "ragged % floor",
               "dense % floor", "gathered % floor", "grouped % floor", "sorted % floor", "max rel. L2 to ragged"]
    opt = lambda r, key, spec: "-" if key not in r else spec.format(r[key])
    body = [[r["shape"], r["tokens"], r["chosen_experts"],
             *(opt(r, f"{name}_ms", "{:.3g}") for name in ("ragged", "dense", *GATHERED, "sorted")),
             *(opt(r, f"{name}_speedup", "{:.2f}x") for name in ("dense", *GATHERED, "sorted")),
             *(opt(r, f"{name}_of_floor", "{:.0%}") for name in ("ragged", "dense", *GATHERED, "sorted")),
             max_rel_l2(r)] for r in rows]
    return header + timing.markdown_table(columns, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for bench_moe.json / .md")
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if timing.missing_gpu("MoE benchmark"):
        return 2
    env = dict(timing.environment(), copy_gbps=timing.measure_copy_gbps())
    rows = []
    for shape_name in args.shapes:
        layer = random_layer(SHAPES[shape_name])
        for tokens in args.tokens:
            rows.append(measure(shape_name, tokens, layer, env["copy_gbps"], args.iters))
            r = rows[-1]
            times = ", ".join(f"{name} {r[name + '_ms']:.3f} ms" + (f" ({r[name + '_speedup']:.2f}x)"
                                                                     if name + "_speedup" in r else "")
                              for name in DISPATCHES if name + "_ms" in r)
            print(f"{shape_name} T={tokens}: {times}, {r['chosen_experts']} experts chosen", flush=True)
            timing.write_results(args.out, "bench_moe", env, rows, table(env, rows))
        del layer
    print(table(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
