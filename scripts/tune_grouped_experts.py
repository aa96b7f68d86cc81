"""The grouped-experts kernel's block sizes, warps and pipeline depth (pallas_kernels/grouped_experts.py), side by side.

    python scripts/tune_grouped_experts.py --out $OUT [--cases v2_lite:1 v3:8 ...]
        [--settings 64/128/8/3 ...] [--split-programs 0 512 1024]

A case is an expert shape of scripts/bench_moe.py and a token count T. For each setting
(COLUMNS, RUN, NUM_WARPS, NUM_STAGES of the kernel module; the module's two first) and each
``--split-programs`` value (``SPLIT_PROGRAMS``: launch 1's contraction split) one call of
``grouped_experts`` on random bf16 experts and distinct random experts a token is timed
(``timing.time_ms`` median), with its fraction of the floor: the chosen experts' matrix bytes
over the copy bandwidth measured in the run. Every call takes the swept setting
(``FEW_ASSIGNMENTS`` is set to 0 meanwhile). Its sweeps set ``FEW_SETTING`` and
``SPLIT_PROGRAMS``: at T = 1 with V2-Lite shapes 6 assignments x 22 column blocks are 132
programs, each walking a 2048-long contraction, 31% of that floor unsplit, 57% split.
Writes grouped_experts_tune.json under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import snapmla_jax.pallas_kernels.grouped_experts as kernel
from snapmla_jax.bench import timing

ROOT = pathlib.Path(__file__).resolve().parent
DEFAULT_CASES = ("v2_lite:1", "v2_lite:2", "v2_lite:4", "v2_lite:8", "v3:1", "v3:4")
# (COLUMNS, RUN, NUM_WARPS, NUM_STAGES); the module's two own first (above and up to
# ``FEW_ASSIGNMENTS`` assignments), each case timed with every one.
SETTINGS = tuple(dict.fromkeys((
    (kernel.COLUMNS, kernel.RUN, kernel.NUM_WARPS, kernel.NUM_STAGES), kernel.FEW_SETTING,
    (32, 64, 4, 4), (16, 128, 4, 4), (32, 128, 4, 3), (64, 128, 8, 3), (32, 256, 8, 2), (64, 64, 4, 6),
    (128, 32, 4, 4))))


def parse_case(text: str, shapes: dict) -> tuple[str, int]:
    """"SHAPE:T" -> (shape name, tokens)."""
    name, _, tokens = text.partition(":")
    if name not in shapes or not tokens.isdigit() or int(tokens) < 1:
        raise argparse.ArgumentTypeError(f"expected SHAPE:T with SHAPE in {sorted(shapes)}, got {text!r}")
    return name, int(tokens)


def parse_setting(text: str) -> tuple[int, int, int, int]:
    """"COLUMNS/RUN/NUM_WARPS/NUM_STAGES" -> a setting tuple."""
    parts = text.split("/")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected COLUMNS/RUN/NUM_WARPS/NUM_STAGES, got {text!r}")
    return tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> int:
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "bench_moe.py")
    bench_moe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench_moe  # before running it: its dataclasses look their module up there
    spec.loader.exec_module(bench_moe)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for grouped_experts_tune.json")
    parser.add_argument("--cases", type=lambda t: parse_case(t, bench_moe.SHAPES), nargs="*",
                        default=[parse_case(c, bench_moe.SHAPES) for c in DEFAULT_CASES])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--settings", type=parse_setting, nargs="*", default=list(SETTINGS),
                        help="COLUMNS/RUN/NUM_WARPS/NUM_STAGES settings to sweep (default: SETTINGS)")
    parser.add_argument("--split-programs", type=int, nargs="*", default=[kernel.SPLIT_PROGRAMS],
                        help="values of SPLIT_PROGRAMS (launch 1's contraction split) to sweep with each setting")
    args = parser.parse_args(argv)
    if timing.missing_gpu("grouped-experts tuning"):
        return 2
    saved = (kernel.COLUMNS, kernel.RUN, kernel.NUM_WARPS, kernel.NUM_STAGES, kernel.FEW_ASSIGNMENTS,
             kernel.SPLIT_PROGRAMS)
    kernel.FEW_ASSIGNMENTS = 0  # every call takes the swept setting
    env = dict(timing.environment(), copy_gbps=timing.measure_copy_gbps())
    results = {"environment": env, "setting": "COLUMNS/RUN/NUM_WARPS/NUM_STAGES[ split SPLIT_PROGRAMS]",
               "cases": {}}
    rng = np.random.default_rng(0)
    try:
        for shape_name in dict.fromkeys(name for name, _ in args.cases):
            shape = bench_moe.SHAPES[shape_name]
            keys = jax.random.split(jax.random.key(0), 3)
            experts = [jax.random.normal(key, dims, jnp.bfloat16) * jnp.asarray(0.02, jnp.bfloat16)
                       for key, dims in zip(keys, [(shape.experts, shape.hidden, shape.inner)] * 2
                                            + [(shape.experts, shape.inner, shape.hidden)])]
            for name, tokens in args.cases:
                if name != shape_name:
                    continue
                x = jnp.asarray(rng.standard_normal((tokens, shape.hidden)), jnp.bfloat16)
                ids = jnp.asarray(np.stack([rng.choice(shape.experts, shape.top_k, replace=False)
                                            for _ in range(tokens)]), jnp.int32)
                weights = jnp.asarray(rng.random((tokens, shape.top_k)), jnp.float32)
                chosen = len(np.unique(np.asarray(ids)))
                floor_ms = chosen * 3 * shape.hidden * shape.inner * 2 / (env["copy_gbps"] * 1e9) * 1e3
                line = {}
                for setting in args.settings:
                    for split_programs in args.split_programs:
                        kernel.COLUMNS, kernel.RUN, kernel.NUM_WARPS, kernel.NUM_STAGES = setting
                        kernel.SPLIT_PROGRAMS = split_programs
                        jax.clear_caches()  # grouped_experts' jit cache would hand back the previous setting
                        call = jax.jit(lambda *a: kernel.grouped_experts(*a))
                        ms = timing.time_ms(call, [(x, weights, ids, *experts)], warmup=3, iters=args.iters)
                        label = "/".join(map(str, setting))
                        if len(args.split_programs) > 1:
                            label += f" split {split_programs}"
                        line[label] = {"ms": ms, "of_floor": floor_ms / ms}
                key = f"{name}:{tokens}"
                results["cases"][key] = line
                print(key, "  ".join(f"{s}: {v['ms']:.3f} ms ({v['of_floor']:.0%})" for s, v in line.items()),
                      flush=True)
            del experts
    finally:
        (kernel.COLUMNS, kernel.RUN, kernel.NUM_WARPS, kernel.NUM_STAGES, kernel.FEW_ASSIGNMENTS,
         kernel.SPLIT_PROGRAMS) = saved
        jax.clear_caches()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "grouped_experts_tune.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
