"""Where the Mosaic GPU decode kernel spends its time: time it with parts of a step cheapened.

    PYTHONPATH=. python scripts/probe_mgpu_costs.py --out $OUT [--shape 64x16384x128x1]

Each variant replaces one of the step helpers of ``mla_decode_mgpu``
(``step_scores``, ``softmax_step``, ``v_words``) by a cheaper stand-in
with the same shapes and layouts, recompiles, and times it next to the
unmodified kernel. The results are wrong by design; only the time counts: the
difference to "baseline" bounds what that part costs. Writes probe_costs.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels.mla_decode_mgpu as mgpu_kernel
from pallas_kernels.mla_decode_mgpu import BLOCK_M, CHUNK, HALF, NUM_CHUNKS
from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import make_caches, make_queries
from snapmla_jax.decode import _sm_count, choose_num_splits

ROOT = pathlib.Path(__file__).resolve().parent
ORIGINAL = {name: getattr(mgpu_kernel, name) for name in ("step_scores", "softmax_step", "v_words")}


def scores_fp8_only(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scales, *, interpret):
    """The FP8 product only, unscaled, one chain per 64-token half: no RoPE wgmma, no promotion."""
    def qk8(acc_ref, rows):
        for ch in range(NUM_CHUNKS):
            plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch, rows].transpose((1, 0)))
        return acc_ref[...]
    return [pl.run_scoped(functools.partial(qk8, rows=pl.ds(half * HALF, HALF)),
                          plgpu.ACC((BLOCK_M, HALF), jnp.float32)) for half in range(2)]


def softmax_none(scores, k_scale, m, l, scale_log2, visible=None):
    """No softmax: P' is the scores (still rounded and packed)."""
    one = l * 0.0 + 1.0
    return m, one, l, scores, one


def v_words_constant(chunk_ref, t0, seq_len, *, masked):
    """No V load or packing: a constant word tile (the transposed store remains)."""
    return plgpu.layout_cast(jnp.full((HALF, CHUNK), 0x3838, jnp.uint16), plgpu.Layout.WGMMA)


VARIANTS = {
    "baseline": {},
    "no_rope": {"step_scores": scores_fp8_only},
    "no_softmax": {"softmax_step": softmax_none},
    "v_constant": {"v_words": v_words_constant},
    "all_cheap": {"step_scores": scores_fp8_only, "softmax_step": softmax_none, "v_words": v_words_constant},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/probe_mgpu_costs")
    parser.add_argument("--shape", default="64x16384x128x1")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("bench_mgpu", ROOT / "bench_mgpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    batch, context, heads, s_q = map(int, args.shape.split("x"))
    fp8, _, block_table = make_caches(batch, context)
    q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
    splits = choose_num_splits(batch, -(-s_q * heads // BLOCK_M), context, _sm_count())
    results = {"env": timing.environment(), "shape": args.shape, "num_splits": splits, "ms": {}}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        for helper, fn in ORIGINAL.items():
            setattr(mgpu_kernel, helper, VARIANTS[name].get(helper, fn))
        jax.clear_caches()  # the kernel's jit cache would hand back the previous variant
        fn = jax.jit(lambda q, qr, c, bt, n: bench.mgpu_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                               num_splits=splits))
        call_args = (q, q_rope, fp8, block_table, seq_lens)
        try:
            jax.block_until_ready(fn(*call_args))
            results["ms"][name] = timing.time_ms(fn, [call_args], warmup=2, iters=10)
        except Exception as err:  # a variant that does not compile is a result
            results["ms"][name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        print(name, results["ms"][name], flush=True)
        (out_dir / "probe_costs.json").write_text(json.dumps(results, indent=1))
    for helper, fn in ORIGINAL.items():
        setattr(mgpu_kernel, helper, fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
