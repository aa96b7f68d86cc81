"""Where the Mosaic GPU decode kernel spends its time: time it with parts of a step cheapened.

    PYTHONPATH=. python scripts/probe_mgpu_costs.py --out $OUT [--shape 64x16384x128x1]

Each variant replaces one or more of the step helpers of ``mla_decode_mgpu``
(``step_scores``, ``qk8_promoted``, ``softmax_half``, ``v_words``,
``v_operands_in_place``, ``pv_update``) by a cheaper stand-in or another
variant with the same shapes and layouts, recompiles, and times it next to the
unmodified kernel. The results of the stand-ins are wrong by design; only the
time counts: the difference to "baseline" bounds what that part costs. Writes
probe_costs.json.
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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels.mla_decode_mgpu as mgpu_kernel
from pallas_kernels.mla_decode_mgpu import BLOCK_M, CHUNK, CHUNKS_PER_WG, HALF, NUM_CHUNKS
from snapmla_jax.bench import timing
from snapmla_jax.bench.decode import make_caches, make_queries
from snapmla_jax.decode import _sm_count, choose_num_splits

ROOT = pathlib.Path(__file__).resolve().parent
ORIGINAL = {name: getattr(mgpu_kernel, name) for name in
            ("step_scores", "qk8_promoted", "softmax_half", "v_words", "v_operands_in_place", "pv_update")}


def scores_rope_first(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scale, first_row, *, interpret):
    """The RoPE wgmma issued first, into its own accumulator, and added in registers: it runs
    beside the FP8 chains instead of after them (one accumulator more is live)."""
    rows = pl.ds(first_row, HALF)

    def body(rope_ref):
        plgpu.wgmma(rope_ref, qr_s, rope_slot.at[rows].transpose((1, 0)))
        s8 = mgpu_kernel.qk8_promoted(q8_s, kv_slot, rows)
        return (s8 * lax.broadcast_in_dim(q_scale, (BLOCK_M, HALF), [0])
                * lax.broadcast_in_dim(k_scale, (BLOCK_M, HALF), [1]) + rope_ref[...])
    return pl.run_scoped(body, plgpu.ACC((BLOCK_M, HALF), jnp.float32))


def qk8_promotion_256(q8_s, kv_slot, rows):
    """fp32 promotion every 256 features instead of 128: two wgmma chains, not four."""
    def chain(acc_ref, first):
        for ch in (first, first + 1):
            plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch, rows].transpose((1, 0)))
        return acc_ref[...]
    return functools.reduce(jnp.add, [pl.run_scoped(functools.partial(chain, first=first),
                                                    plgpu.ACC((BLOCK_M, HALF), jnp.float32)) for first in (0, 2)])


def scores_fp8_only(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scale, first_row, *, interpret):
    """The FP8 product only, unscaled, one 512-feature chain: no RoPE wgmma, no promotion."""
    def qk8(acc_ref):
        for ch in range(NUM_CHUNKS):
            plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch, pl.ds(first_row, HALF)].transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(qk8, plgpu.ACC((BLOCK_M, HALF), jnp.float32))


def scores_constant(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scale, first_row, *, interpret):
    """No QK wgmmas at all: constant scores (the wait for the step's TMA remains)."""
    return plgpu.layout_cast(jnp.full((BLOCK_M, HALF), 1.0, jnp.float32), plgpu.Layout.WGMMA)


def softmax_none(scores, k_scale, m, l_part, row_max, log_pv_max, visible=None):
    """No softmax: P' is the scores (still rounded, exchanged and packed)."""
    one = l_part * 0.0 + 1.0
    return m, one, l_part, scores, one


def v_words_constant(chunk_ref, t0, seq_len, *, masked):
    """No V load or packing: a constant word tile (the transposed store remains)."""
    return plgpu.layout_cast(jnp.full((HALF, CHUNK), 0x3838, jnp.uint16), plgpu.Layout.WGMMA)


def v_operands_untransposed(kv8_s, kv16_s, slot, wg, t0, seq_len, *, masked, interpret):
    """No V^T: the slot's K bytes are read as V^T (no V loads, packing or transposed stores)."""
    return [kv8_s.at[slot, wg * CHUNKS_PER_WG + i].transpose((1, 0)) for i in range(CHUNKS_PER_WG)]


def pv_none(accs, p8_ref, v_operands, alpha, pv_max):
    """No P'.V wgmma: the accumulators are only rescaled."""
    alpha_b = lax.broadcast_in_dim(alpha, (BLOCK_M, CHUNK), [0])
    return [acc * alpha_b for acc in accs]


VARIANTS = {
    "baseline": {},
    "rope_first": {"step_scores": scores_rope_first},
    "promotion_256": {"qk8_promoted": qk8_promotion_256},
    "no_rope": {"step_scores": scores_fp8_only},
    "no_qk": {"step_scores": scores_constant},
    "no_softmax": {"softmax_half": softmax_none},
    "v_constant": {"v_words": v_words_constant},
    "no_v_transpose": {"v_operands_in_place": v_operands_untransposed},
    "no_pv": {"pv_update": pv_none},
    # The TMA ring, barriers, statistics and P' exchange, P' packing and output alone.
    "no_compute": {"step_scores": scores_constant, "softmax_half": softmax_none,
                   "v_operands_in_place": v_operands_untransposed, "pv_update": pv_none},
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
