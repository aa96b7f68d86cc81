"""Time a Mosaic GPU decode kernel with its module constants changed, side by side (GPU).

    python tools/time_mgpu_variants.py --out $OUT [--shape 64x16384x128x1] [--variants baseline no_producer]
    python tools/time_mgpu_variants.py --kernel small --shape 128x16384x16x1 --out $OUT
    python tools/time_mgpu_variants.py --compare-file /tmp/old/mla_decode_mgpu.py --variants baseline --out $OUT
    python tools/time_mgpu_variants.py --kernel small --compare-file /tmp/old/mla_decode_mgpu_small.py --out $OUT

Each variant sets some of a kernel module's constants (``VARIANTS``: the 64-row FP8 kernel,
``mla_decode_mgpu``; ``SMALL_VARIANTS``: the 16-row one; ``BF16_VARIANTS``: the Mosaic BF16
twin, through ``mla_decode`` on the bf16 cache), each one flag of the module flipped or a
register split changed: the measurement behind that constant. ``--compare-file PATH`` also times
the kernel of another copy of its module (mla_decode_mgpu.py, or mla_decode_mgpu_small.py with
``--kernel small``; e.g. the last commit's) as variant "file:<stem>", for a change no constant
expresses.

Every variant is compiled first, then all are timed in turn, ``--rounds`` rounds round-robin in
samples of at least ``--min-sample-ms`` (``timing.time_round_robin``; the median is reported), so
that a drift of the GPU's clocks falls on all alike. The relative L2 difference of each variant's
output to the baseline's says whether it still computes the same. ``--kernel-trace-rounds N`` also
reports each variant's decode kernel alone: its median GPU duration over N rounds of interleaved
calls in one profiler trace (``timing.interleaved_kernel_us``), free of the launches around it.
The timed calls are ``Compiled`` executables, whose Python dispatch cost 60-130 us a call on an
H200's host: a wall clock under ~0.15 ms is mostly that dispatch, so compare such shapes by
``--kernel-trace-rounds`` (or chained calls in one jit, as the decode benchmark runs them).
Shapes: BxCONTEXTxHxS_Q, the caches and queries of scripts/bench_mgpu.py. Writes
time_mgpu_variants.json under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 as bf16_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_kernel
from snapmla_jax.bench import timing

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"
# The decode kernel of each --kernel in a profiler trace (a substring of its launch's name; the
# 16-row kernel's name extends the 64-row one's, hence "_mosaic").
KERNEL_NAMES = {"mgpu": "snapmla_decode_fp8_mgpu_mosaic", "small": "snapmla_decode_fp8_mgpu_small",
                "bf16": "snapmla_decode_bf16_mgpu"}
# The producer warpgroup flipped from what ships: it ships only where ptxas honours its register
# split (``mla_decode_mgpu.SETMAXNREG_HONOURED``), so under jax 0.12.0 the flip is "with_producer".
WITHOUT_PRODUCER = {"PRODUCER_WG": False} if mgpu_kernel.PRODUCER_WG else {}
PRODUCER_FLIP = {"no_producer": WITHOUT_PRODUCER} if mgpu_kernel.PRODUCER_WG else {"with_producer": {"PRODUCER_WG": True}}
VARIANTS = {
    "baseline": {},
    "promotion_256": {"QK_PROMOTION": 256},
    **PRODUCER_FLIP,
    "issue_by_one_thread": {"ISSUE_BY_WARPS": False, **WITHOUT_PRODUCER},
    "registers_40_232": {"PRODUCER_REGISTERS": 40, "CONSUMER_REGISTERS": 232},
    "producer_by_warps": {"PRODUCER_ISSUE_BY_WARPS": True},
    "precise_math": {"APPROX_MATH": False},
    "p_clamped": {"SATURATING_P_CAST": False},
    "mbarrier_sync": {"NAMED_SYNC": False},
    "synced_row_stores": {"UNSYNCED_ROW_STORES": False},
    "commit_with_barrier": {"FENCE_ONLY_COMMIT": False},
    "producer_pages_after_wait": {"PRODUCER_PREFETCH_PAGES": False},
}
SMALL_VARIANTS = {
    "baseline": {},
    "promotion_256": {"QK_PROMOTION": 256},
    "promotion_512": {"QK_PROMOTION": 512},
    "issuer_0": {"ISSUER": 0},
    "promotion_32_rows_512": {"QK_PROMOTION_32_ROWS": 512},  # with --block-rows 32
    "issue_after_wait": {"ISSUE_FIRST_ROWS": ()},
    "two_exchanges": {"ONE_EXCHANGE_ROWS": ()},
    "pages_at_issue": {"PREFETCH_PAGES": False},
    # A producer warpgroup (where ``mla_decode_mgpu.PRODUCER_WG``: jax < 0.12).
    "producer": {"PRODUCER_ROWS": (16, 32)},
    "producer_32_rows": {"PRODUCER_ROWS": (32,)},  # with --block-rows 32
    "synced_row_stores": {"UNSYNCED_ROW_STORES": False},
    "mbarrier_sync": {"NAMED_SYNC": False},
    # Constants of the 64-row kernel's module that the 16-row kernel reads (``step_issuer``,
    # ``grid_params``).
    "issue_by_one_thread": {"ISSUE_BY_WARPS": False},
    "precise_math": {"APPROX_MATH": False},
}
BF16_VARIANTS = {
    "baseline": {},
    "registers_40_232": {"PRODUCER_REGISTERS": 40, "CONSUMER_REGISTERS": 232},
}
# Constants of ``mla_decode_mgpu`` that every Mosaic decode kernel reads.
SHARED = ("ISSUE_BY_WARPS", "APPROX_MATH")


def variant_settings(module, variants: dict[str, dict]) -> dict[str, dict[tuple, object]]:
    """Per variant, {(module, constant): value} for every constant any variant sets (the others at
    the module's own value), so that applying one variant undoes the one before it. A constant in
    ``SHARED`` is set on ``mla_decode_mgpu``. AttributeError for a constant the module lacks."""
    names = sorted({name for settings in variants.values() for name in settings})
    owners = {name: mgpu_kernel if name in SHARED else module for name in names}
    shipped = {name: getattr(owners[name], name) for name in names}
    return {variant: {(owners[name], name): settings.get(name, shipped[name]) for name in names}
            for variant, settings in variants.items()}


def load_module(path: pathlib.Path, name: str):
    """The Python file at ``path`` as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/time_mgpu_variants")
    parser.add_argument("--shape", default="64x16384x128x1")
    parser.add_argument("--kernel", choices=("mgpu", "small", "bf16"), default="mgpu",
                        help="the 64-row kernel (mgpu), the 16-row one (small) or the Mosaic BF16 twin (bf16)")
    parser.add_argument("--block-rows", type=int, choices=(16, 32), default=16,
                        help="--kernel small: its row blocks (17-32 rows run 32-row blocks under "
                             "mla_decode; here, with 16, as two 16-row blocks)")
    parser.add_argument("--variants", nargs="*", help="default: all of the kernel's")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds over the variants")
    parser.add_argument("--min-sample-ms", type=float, default=10.0,
                        help="the shortest timed sample (of at least 10 calls), ms")
    parser.add_argument("--kernel-trace-rounds", type=int, default=0,
                        help="also the decode kernel's median GPU duration over this many rounds of "
                             "interleaved calls in one profiler trace (0: not measured)")
    parser.add_argument("--compare-file", action="append", default=[],
                        help="another copy of the kernel's module (mla_decode_mgpu.py, or mla_decode_mgpu_small.py "
                             "with --kernel small) whose kernel is timed as variant file:<stem>")
    args = parser.parse_args(argv)
    if args.compare_file and args.kernel == "bf16":
        parser.error("--compare-file: the FP8 kernels' modules only (--kernel mgpu or small)")
    if timing.missing_gpu("time_mgpu_variants"):
        return 2
    module, variants, block_rows = {"small": (small_kernel, SMALL_VARIANTS, args.block_rows),
                                    "bf16": (bf16_kernel, BF16_VARIANTS, mgpu_kernel.BLOCK_M)}.get(
        args.kernel, (mgpu_kernel, VARIANTS, mgpu_kernel.BLOCK_M))
    unknown = set(args.variants or ()) - set(variants)
    if unknown:
        parser.error(f"--variants: unknown for --kernel {args.kernel}: {sorted(unknown)}")
    settings = variant_settings(module, variants)
    bench = load_module(SCRIPTS / "bench_mgpu.py", "bench_mgpu")
    (batch, context, heads, s_q), fp8, block_table, q, q_rope, seq_lens, scale = bench.fp8_problem(
        args.shape, bf16=args.kernel == "bf16")
    splits = bench.mosaic_splits(batch, s_q * heads, context, block_rows)
    results = {"env": timing.environment(), "kernel": args.kernel, "shape": args.shape, "num_splits": splits,
               "block_rows": block_rows,
               "rounds": args.rounds, "min_sample_ms": args.min_sample_ms, "ms": {}, "rel_l2_to_baseline": {}}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    call_args = (q, q_rope, fp8, block_table, seq_lens)
    # The bench script's name for the kernel a --compare-file module replaces.
    kernel_attr = "mla_decode_mgpu_small" if args.kernel == "small" else "mla_decode_mgpu"
    shipped_kernel = getattr(bench, kernel_attr)
    other_kernels = {f"file:{pathlib.Path(path).stem}": getattr(load_module(pathlib.Path(path), f"compare_{i}"),
                                                                  kernel_attr)
                     for i, path in enumerate(args.compare_file)}
    reference, compiled = None, {}
    for name in (args.variants or list(variants)) + list(other_kernels):
        for (owner, constant), value in settings.get(name, settings["baseline"]).items():
            setattr(owner, constant, value)
        setattr(bench, kernel_attr, other_kernels.get(name, shipped_kernel))
        jax.clear_caches()  # the kernel's jit cache would hand back the previous variant
        if args.kernel == "bf16":  # the twin through the API, with its split plan
            fn = jax.jit(lambda q, qr, c, bt, n: bench.mla_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                  backend="pallas"))
        else:
            fn = jax.jit(lambda q, qr, c, bt, n: bench.mgpu_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                   small=args.kernel == "small",
                                                                   small_rows=args.block_rows, num_splits=splits))
        try:
            compiled[name] = fn.lower(*call_args).compile()
            out = jax.block_until_ready(compiled[name](*call_args)).astype(jnp.float32)
            if reference is None and name == "baseline":
                reference = out
            if reference is not None:
                results["rel_l2_to_baseline"][name] = float(jnp.linalg.norm(out - reference)
                                                            / jnp.linalg.norm(reference))
        except Exception as err:  # a variant that does not compile is a result
            results["ms"][name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(name, results["ms"][name], flush=True)
    for (owner, constant), value in settings["baseline"].items():
        setattr(owner, constant, value)
    setattr(bench, kernel_attr, shipped_kernel)
    times = timing.time_round_robin({name: (executable, [call_args]) for name, executable in compiled.items()},
                                    rounds=args.rounds, iters=2 * args.rounds, min_sample_ms=args.min_sample_ms)
    for name, ms in times.items():
        results["ms"][name] = ms if isinstance(ms, float) else f"{type(ms).__name__}: {ms}"
        print(name, results["ms"][name], results["rel_l2_to_baseline"].get(name), flush=True)
    if args.kernel_trace_rounds:
        kernel = KERNEL_NAMES[args.kernel]
        results["kernel_us"] = timing.interleaved_kernel_us(
            {name: (executable, call_args) for name, executable in compiled.items()}, kernel=kernel,
            rounds=args.kernel_trace_rounds)
        for name, us in results["kernel_us"].items():
            print(f"{name}: {kernel} {us:.1f} us (median of {args.kernel_trace_rounds}, interleaved)", flush=True)
    (out_dir / "time_mgpu_variants.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
