"""Time one DeepSeek MoE layer with block-FP8 weights against the same layer in bf16, side by side:
the measurement behind ``fp8_weights.fp8_grouped_matmul`` in models/moe.py.

    python scripts/bench_fp8_experts.py --out /tmp/bench_fp8_experts [--shapes v2_lite v3_ep8] [--tokens 1 8 64 ...]

The layer (router, routed and shared experts) has random bf16 weights (``bench_moe.random_layer``)
and its FP8 twin is those weights quantized in 128 x 128 blocks (``models.quantize_weights``).
Each runs the model's own dispatch for T tokens (gathered up to ``GATHER_MAX_TOKENS``, dense up to
512): in bf16 the grouped-experts kernel or XLA's batched products; in FP8 the FP8 GEMM launches
(pallas_kernels/fp8_gemm_mgpu.py), with the model's defaults: the kernel of few tokens quantizes the
tokens of products of up to ``fp8_weights.KERNEL_QUANTIZES_MAX_ROWS`` rows itself (the gathered
dispatch's down projections, one row an assignment), one Mosaic GPU launch the others
(``quantize_activations_mgpu``). "fp8_xq" is the same with XLA's launches quantizing every
product's tokens (``fp8_weights.kernel_quantization(0)``, ``mosaic_quantization(False)``),
"fp8_qk" with the kernel quantizing up to 64 tokens (``fp8_weights.kernel_quantization``).
"fp8_dense" is the FP8 layer always dense, "fp8_sorted" the FP8 layer with the sorted dispatch
wherever dense would run (``sorted_min_tokens`` 1). Round-robin medians
(``timing.time_round_robin``); floor = the weight bytes the dispatch must read (router, shared
experts, and the chosen experts (gathered, sorted; dense in FP8 reads gate and up of the chosen and
every down matrix) or all of them (dense in bf16)) over the copy bandwidth measured
in the run. v3_ep8: a DeepSeek-V3 layer's share of its experts on one of 8 GPUs (32 of 256), which
receives every device's tokens. Writes bench_fp8_experts.json and .md under --out.

``--profile`` adds, for every program, where its GPU time goes (JAX profiler, PROFILE_CALLS warm
calls back to back): busy time a call, the idle gaps between its launches, and the
PROFILE_TOP longest launches' durations, to the JSON (``<program>_profile``). A layer past ~64
tokens is a few GEMM launches among ~20-30 short XLA ones (the routing, the sorted dispatch's
gathers and transposes, the quantizations); busy time, not the wall clock of one call, is what
a decode step's CUDA graph pays for them. With ``--profile`` each program's optimized HLO is also
written (``write_hlo``, DIR/hlo/<shape>_T<tokens>_<program>.txt): the profile names XLA's launches
by fusion ("loop_select_fusion_1"), and the HLO says which operations each one runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import SHAPES as MOE_SHAPES, random_layer  # noqa: E402

from snapmla_jax.bench import timing  # noqa: E402
from snapmla_jax import fp8_weights  # noqa: E402
from snapmla_jax.fp8_weights import BlockFP8Weight, kernel_quantization, mosaic_quantization  # noqa: E402
from snapmla_jax.models import quantize_weights  # noqa: E402
from snapmla_jax.models.moe import set_dense_token_range, set_gather_max_tokens, set_sorted_min_tokens  # noqa: E402
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import MAX_TOKENS  # noqa: E402

SHAPES = {"v2_lite": MOE_SHAPES["v2_lite"], "v3_ep8": dataclasses.replace(MOE_SHAPES["v3"], experts=32)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PROGRAMS = ("bf16", "fp8", "fp8_xq", "fp8_qk", "fp8_dense", "fp8_sorted")
# Rows up to which the kernel quantizes its tokens, by program (the others: the module default).
KERNEL_QUANTIZATION = {"fp8_xq": 0, "fp8_qk": MAX_TOKENS}
# The layer attributes a program may change (``MoE.dispatch`` reads them), restored after it:
# ``set_sorted_min_tokens`` sets both sorted thresholds, so the layer's own are saved, not re-derived.
DISPATCH_SETTINGS = ("dense_token_range", "gather_max_tokens", "sorted_min_tokens", "fp8_sorted_min_tokens")
PROFILE_CALLS = 3  # traced calls a program with --profile
PROFILE_TOP = 12  # launches kept a program with --profile


def layer_bytes(layer, ids: jax.Array, dispatch: str) -> int:
    """Weight bytes the dispatch must read: router, shared experts, and the routed experts chosen
    (gathered, sorted; dense on block-FP8 stacks: gate and up of the chosen, every down matrix) or all
    (dense in bf16), in the layer's storage (bf16, or FP8 values and scales)."""
    leaves = lambda module: sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(module)))
    stack = {name: sum(leaf.nbytes for leaf in jax.tree.leaves(getattr(layer, name).get_value()))
             for name in ("w_gate", "w_up", "w_down")}
    experts = sum(stack.values())
    chosen_share = len(np.unique(np.asarray(ids))) / layer.num_local_experts()
    if dispatch in ("gathered", "sorted"):
        routed = int(chosen_share * experts)
    elif dispatch == "dense" and isinstance(layer.w_gate.get_value(), BlockFP8Weight):
        routed = int(chosen_share * (stack["w_gate"] + stack["w_up"])) + stack["w_down"]
    else:
        routed = experts
    shared = leaves(layer.shared_experts) if layer.shared_experts is not None else 0
    return leaves(layer.gate) + shared + routed


def programs(tokens: int, layers: dict) -> tuple[dict, dict]:
    """For T = ``tokens`` random tokens: ({program: (compiled layer call, [args])}, {program:
    (dispatch, weight bytes it reads)}). The kernels run compiled on a GPU, interpreted on a CPU."""
    x = jax.random.normal(jax.random.key(tokens), (tokens, layers["bf16"].cfg.hidden_size), jnp.bfloat16)
    backend = "pallas" if jax.default_backend() == "gpu" else "interpret"
    runs, floors = {}, {}
    for program in PROGRAMS:
        # A jitted function of its own a program: JAX reuses a function's trace for the same
        # arguments, and "fp8_xq" / "fp8_qk" must be traced under their own kernel_quantization.
        call = jax.jit(lambda state, x, graphdef: nnx.merge(graphdef, state)(x, backend=backend),
                       static_argnames="graphdef")
        layer = layers["bf16" if program == "bf16" else "fp8"]
        saved = {name: getattr(layer, name) for name in DISPATCH_SETTINGS}
        if program == "fp8_dense":
            set_dense_token_range(layer, (1, 1 << 30))
            set_gather_max_tokens(layer, 0)
            set_sorted_min_tokens(layer, None)
        if program == "fp8_sorted":
            set_sorted_min_tokens(layer, 1)
        dispatch = layer.dispatch(tokens, backend)
        graphdef, state = nnx.split(layer)
        with (kernel_quantization(KERNEL_QUANTIZATION.get(program, fp8_weights.KERNEL_QUANTIZES_MAX_ROWS)),
              mosaic_quantization(program != "fp8_xq")):
            runs[program] = (call.lower(state, x, graphdef=graphdef).compile(), [(state, x)])
        floors[program] = (dispatch, layer_bytes(layer, layer.gate(x)[1], dispatch))
        for name, value in saved.items():
            setattr(layer, name, value)
    return runs, floors


def launch_profile(fn, args: tuple) -> dict:
    """Where a call of ``fn(*args)`` spends GPU time, us a call: {"timeline_us": span, busy and idle
    (``timing.timeline_us``), "launches_us": the PROFILE_TOP longest launches by name}; zeros and no
    launches on a machine without a GPU."""
    events = timing.gpu_events(fn, args, calls=PROFILE_CALLS)
    launches = timing.kernel_totals_us(events, PROFILE_CALLS)
    return {"timeline_us": timing.timeline_us(events, PROFILE_CALLS),
            "launches_us": dict(list(launches.items())[:PROFILE_TOP])}


def write_hlo(runs: dict, directory, stem: str) -> None:
    """Each compiled program of ``runs`` (name -> (compiled, arg sets)) as its optimized HLO text,
    ``directory``/``stem``_<program>.txt."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for program, (compiled, _) in runs.items():
        (directory / f"{stem}_{program}.txt").write_text(compiled.as_text())


def measure(name: str, tokens: int, layers: dict, copy_gbps: float, iters: int, profile: bool = False,
            hlo_dir=None) -> dict:
    """One row of the table for shape ``name`` at ``tokens`` tokens; with ``profile`` each program's
    launches (``launch_profile``); with ``hlo_dir`` its optimized HLO there (``write_hlo``)."""
    runs, floors = programs(tokens, layers)
    if hlo_dir is not None:
        write_hlo(runs, hlo_dir, f"{name}_T{tokens}")
    outs = {p: np.asarray(fn(*args[0]), np.float64) for p, (fn, args) in runs.items()}
    times = timing.time_round_robin(runs, iters=iters, min_sample_ms=10.0)
    row = {"shape": name, "tokens": tokens}
    if profile:
        row.update({f"{p}_profile": launch_profile(fn, args[0]) for p, (fn, args) in runs.items()})
    for program in PROGRAMS:
        dispatch, nbytes = floors[program]
        row[f"{program}_dispatch"] = dispatch
        row[f"{program}_ms"] = times[program]
        row[f"{program}_of_floor"] = nbytes / (copy_gbps * 1e9) * 1e3 / times[program]
        if program != "bf16":
            row[f"{program}_speedup"] = times["bf16"] / times[program]
            row[f"{program}_rel_l2"] = float(np.linalg.norm(outs[program] - outs["bf16"]) / np.linalg.norm(outs["bf16"]))
    return row


def table(env: dict, rows: list[dict]) -> str:
    header = (f"# MoE layer: block-FP8 weights vs bf16\n\n{env['device']}, jax {env['jax']}, {env['date']}; copy "
              f"{env['copy_gbps']:.0f} GB/s. Command: `{env['command']}`. One layer "
              "(router, routed and shared experts), each with the model's dispatch for T tokens; round-robin "
              "medians; % floor = the weight bytes the dispatch reads over the copy bandwidth. fp8: the model's "
              "defaults (one Mosaic GPU launch quantizes the tokens); fp8 xq: XLA's launches quantize every "
              "product's tokens; fp8 qk: the FP8 GEMM quantizes them up to 64 tokens; fp8 dense: always the "
              "dense dispatch; fp8 sorted: the sorted dispatch (its own "
              "dispatch column) wherever dense would run. rel. L2: FP8 output against bf16's.\n\n")
    columns = ["shape", "T", "dispatch", "bf16 ms", "fp8 ms", "fp8 xq ms", "fp8 qk ms", "fp8 dense ms",
               "fp8 sorted ms (dispatch)", "fp8 / bf16", "fp8 xq / bf16", "fp8 qk / bf16", "fp8 dense / bf16",
               "fp8 sorted / bf16", "bf16 % floor", "fp8 % floor", "fp8 dense % floor", "fp8 sorted % floor",
               "rel. L2"]
    body = [[r["shape"], r["tokens"], r["fp8_dispatch"], f"{r['bf16_ms']:.3f}", f"{r['fp8_ms']:.3f}",
             f"{r['fp8_xq_ms']:.3f}", f"{r['fp8_qk_ms']:.3f}", f"{r['fp8_dense_ms']:.3f}",
             f"{r['fp8_sorted_ms']:.3f} ({r['fp8_sorted_dispatch']})", f"{r['fp8_speedup']:.2f}x",
             f"{r['fp8_xq_speedup']:.2f}x", f"{r['fp8_qk_speedup']:.2f}x", f"{r['fp8_dense_speedup']:.2f}x",
             f"{r['fp8_sorted_speedup']:.2f}x", f"{r['bf16_of_floor']:.0%}", f"{r['fp8_of_floor']:.0%}",
             f"{r['fp8_dense_of_floor']:.0%}", f"{r['fp8_sorted_of_floor']:.0%}", f"{r['fp8_rel_l2']:.3f}"]
            for r in rows]
    return header + timing.markdown_table(columns, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for bench_fp8_experts.json / .md")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="also record each program's GPU busy and idle time and its longest launches (JAX "
                             "profiler) in the JSON, and write its optimized HLO under OUT/hlo")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens: expected positive token counts")
    if timing.missing_gpu("FP8 experts benchmark"):
        return 2
    command = " ".join(["python scripts/bench_fp8_experts.py --out DIR", "--shapes", *args.shapes, "--tokens",
                        *map(str, args.tokens), "--iters", str(args.iters), *(["--profile"] if args.profile else [])])
    env = dict(timing.environment(), copy_gbps=timing.measure_copy_gbps(), command=command)
    rows = []
    for name in args.shapes:
        layers = {"bf16": random_layer(SHAPES[name])}
        layers["fp8"] = quantize_weights(random_layer(SHAPES[name]))
        for tokens in args.tokens:
            rows.append(measure(name, tokens, layers, env["copy_gbps"], args.iters, args.profile,
                                Path(args.out) / "hlo" if args.profile else None))
            r = rows[-1]
            for program in PROGRAMS if args.profile else ():
                line = r[f"{program}_profile"]["timeline_us"]
                print(f"  {program}: busy {line['busy']:.1f} us, idle between launches {line['idle']:.1f} us",
                      flush=True)
            print(f"{name} T={tokens} ({r['fp8_dispatch']}): bf16 {r['bf16_ms']:.3f} ms, fp8 {r['fp8_ms']:.3f} ms "
                  f"({r['fp8_speedup']:.2f}x), fp8 xq {r['fp8_xq_ms']:.3f} ms, "
                  f"fp8 qk {r['fp8_qk_ms']:.3f} ms ({r['fp8_qk_speedup']:.2f}x), "
                  f"fp8 dense {r['fp8_dense_ms']:.3f} ms, fp8 sorted {r['fp8_sorted_ms']:.3f} ms "
                  f"({r['fp8_sorted_dispatch']}, {r['fp8_sorted_speedup']:.2f}x)", flush=True)
            timing.write_results(args.out, "bench_fp8_experts", env, rows, table(env, rows))
        del layers
    print(table(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
