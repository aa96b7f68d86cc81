"""Where the Mosaic GPU decode kernel spends its time: time it with parts of a step cheapened.

    PYTHONPATH=. python scripts/probe_mgpu_costs.py --out $OUT [--shape 64x16384x128x1]
    PYTHONPATH=. python scripts/probe_mgpu_costs.py --kernel small --shape 128x16384x16x1 --out $OUT

``--kernel bf16`` times the Mosaic BF16 twin's register splits (``BF16_VARIANTS``; the cache
is then the bf16 one). Each variant replaces one or more of the step helpers of ``mla_decode_mgpu``
(``step_scores``, ``qk8_promoted``, ``softmax_frame``, ``pv_update_t``,
``publish_stats``, ``gather_stats``), or with ``--kernel small`` of
``mla_decode_mgpu_small`` (``step_scores_t``, ``softmax_t``, ``v_half_f16``,
``pv_update_t``), or a module constant, by a cheaper stand-in or another
variant with the same shapes and layouts, and compiles it; then all compiled
variants are timed in turn, ``--rounds`` times round-robin in samples of at least
``--min-sample-ms`` (``timing.time_round_robin``; the median is reported), so that a
drift of the GPU's clocks falls on all alike.
The results of the stand-ins are wrong by design; only the time counts: the
difference to "baseline" bounds what that part costs. Other
variants are candidate changes; their relative L2 difference to the baseline's
output (when "baseline" runs first) says whether they still compute the same.
``--compare-file PATH`` also times the 64-row kernel of another copy of
mla_decode_mgpu.py (e.g. the last commit's, for a change no helper swap can
express) as variant "file:<stem>", compiled and timed with the rest.
``--kernel-trace-rounds N`` also reports each variant's kernel alone: the median GPU duration of
its decode kernel over N rounds of interleaved calls in one profiler trace
(``timing.interleaved_kernel_us``), which neither the launches around it nor the clock a
wall-clock sample inherits from the one before move (the thirtieth session's 4% was clear there
and not in the wall-clock ratios).
Writes probe_costs.json.
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

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 as bf16_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_kernel
from snapmla_jax.pallas_kernels.mgpu_bytes import load_vt_quads
from snapmla_jax.pallas_kernels.mla_decode_mgpu import BLOCK_M, CHUNK, HALF, NUM_CHUNKS
from snapmla_jax.bench import timing

ROOT = pathlib.Path(__file__).resolve().parent
# The decode kernel of each --kernel in a profiler trace (a substring of its launch's name; the
# 16-row kernel's name extends the 64-row one's, hence "_mosaic").
KERNEL_NAMES = {"mgpu": "snapmla_decode_fp8_mgpu_mosaic", "small": "snapmla_decode_fp8_mgpu_small",
                "bf16": "snapmla_decode_bf16_mgpu"}
ORIGINAL = {name: getattr(mgpu_kernel, name) for name in
            ("step_scores", "qk8_promoted", "ISSUE_BY_WARPS", "PRODUCER_WG", "PRODUCER_REGISTERS", "CONSUMER_REGISTERS",
             "PRODUCER_ISSUE_BY_WARPS", "page_boxes", "APPROX_MATH",
             "softmax_frame", "pv_update_t", "publish_stats", "gather_stats", "QK_PROMOTION", "NAMED_SYNC",
             "UNSYNCED_ROW_STORES", "FENCE_ONLY_COMMIT",
             "SATURATING_P_CAST", "FRESH_OVERWRITE")}


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


def qk8_pipelined(q8_s, kv_slot, rows, *, interpret=False):
    """fp32 promotion every 128 features, each chain issued before the previous one is waited
    for and summed (two chains in flight, as ``pv_update``'s pieces)."""
    firsts = list(range(NUM_CHUNKS))

    def run(k, previous_ref, total):
        def body(acc_ref):
            plgpu.wgmma(acc_ref, q8_s.at[firsts[k]], kv_slot.at[firsts[k], rows].transpose((1, 0)))
            if previous_ref is not None:
                part = plgpu.wgmma_accumulator_load(previous_ref, wait_n=1)
                total_k = part if total is None else total + part
            else:
                total_k = total
            if k + 1 < len(firsts):
                return run(k + 1, acc_ref, total_k)
            last = plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)
            return last if total_k is None else total_k + last
        return pl.run_scoped(body, plgpu.ACC((BLOCK_M, HALF), jnp.float32))
    return run(0, None, None)


def scores_rope_beside(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scale, first_row, *, interpret):
    """The RoPE wgmma and the first FP8 chain (``QK_PROMOTION`` features) issued together into two
    accumulators and waited for once; each later chain waited for and added, scaled, in registers:
    one wgmma round trip a step fewer than RoPE onto the scaled product afterwards, with the RoPE
    accumulator live across the first chain."""
    rows = pl.ds(first_row, HALF)
    per_chain = mgpu_kernel.QK_PROMOTION // CHUNK
    shape = (BLOCK_M, HALF)

    def scaled(s8):
        return (s8 * lax.broadcast_in_dim(q_scale, shape, [0])) * lax.broadcast_in_dim(k_scale, shape, [1])

    def chain(acc_ref, first):
        for ch in range(first, first + per_chain):
            plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch, rows].transpose((1, 0)))

    def first_chain_and_rope(rope_ref, acc_ref):
        plgpu.wgmma(rope_ref, qr_s, rope_slot.at[rows].transpose((1, 0)))
        chain(acc_ref, 0)
        return scaled(acc_ref[...]) + rope_ref[...]

    def later_chain(acc_ref, first):
        chain(acc_ref, first)
        return acc_ref[...]

    scores = pl.run_scoped(first_chain_and_rope, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
    for first in range(per_chain, NUM_CHUNKS, per_chain):
        scores = scores + scaled(pl.run_scoped(functools.partial(later_chain, first=first),
                                               plgpu.ACC(shape, jnp.float32)))
    return scores


def qk8_chains_in_flight(q8_s, kv_slot, rows, *, interpret=False):
    """Every ``QK_PROMOTION``-feature chain issued into its own accumulator before any is waited
    for (one round trip for the FP8 part; with two chains, the two live accumulators that
    waiting for the first while the second runs also holds)."""
    per_chain = mgpu_kernel.QK_PROMOTION // CHUNK
    firsts = range(0, NUM_CHUNKS, per_chain)

    def chains(*acc_refs):
        for first, acc_ref in zip(firsts, acc_refs):
            for ch in range(first, first + per_chain):
                plgpu.wgmma(acc_ref, q8_s.at[ch], kv_slot.at[ch, rows].transpose((1, 0)))
        return functools.reduce(jnp.add, [acc_ref[...] for acc_ref in acc_refs])
    return pl.run_scoped(chains, *[plgpu.ACC((BLOCK_M, HALF), jnp.float32) for _ in firsts])


def qk8_promotion_128(q8_s, kv_slot, rows, *, interpret=False):
    """fp32 promotion every 128 features (four wgmma chains, each waited for and summed), the
    kernel's choice before the tenth session's 256."""
    def chain(acc_ref, first):
        plgpu.wgmma(acc_ref, q8_s.at[first], kv_slot.at[first, rows].transpose((1, 0)))
        return acc_ref[...]
    return functools.reduce(jnp.add, [pl.run_scoped(functools.partial(chain, first=first),
                                                    plgpu.ACC((BLOCK_M, HALF), jnp.float32))
                                      for first in range(NUM_CHUNKS)])


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


def softmax_t_none(log_pv, inv_k_scale, m, l_part, frame, log_pv_max, visible=None):
    """No softmax (transposed P'.V): P' is the scores (still rounded, stored and multiplied), the
    fold's ratio 1."""
    one = l_part * 0.0 + 1.0
    return m, l_part, frame, log_pv, one


def pv_t_none(accs, p8_ref, kv_slot, wg, fac_ref, visible, *, interpret):
    """No V^T loads and no V^T.P'^T wgmma (transposed P'.V): the O^T tiles are only rescaled by
    their factor (read in the column layout, as ``pv_update_t`` does)."""
    factor = lax.broadcast_in_dim(plgpu.load(fac_ref.at[0], layout=mgpu_kernel.COL), (BLOCK_M, HALF), [1])
    return [acc * factor for acc in accs]


def pv_t_prefetch(accs, p8_ref, kv_slot, wg, fac_ref, visible, *, interpret):
    """``pv_update_t`` with the next tile's V^T loaded (``load_vt_quads``) while the current
    tile's product runs: 16 registers more live across the wait, one ldmatrix/prmt round off the
    path of each product but the first. GPU only."""
    factor = lax.broadcast_in_dim(plgpu.load(fac_ref.at[0], layout=mgpu_kernel.COL), (BLOCK_M, HALF), [1])

    def vt(k):
        i, t = divmod(k, 2)
        return load_vt_quads(kv_slot.at[wg * mgpu_kernel.CHUNKS_PER_WG + i], t, visible)

    new_accs = []
    a_operand = vt(0)
    for k, acc in enumerate(accs):
        def product(acc_ref, a_operand=a_operand, k=k):
            plgpu.wgmma(acc_ref, a_operand, p8_ref.transpose((1, 0)))
            following = vt(k + 1) if k + 1 < len(accs) else None
            return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0), following

        fresh, a_operand = pl.run_scoped(product, plgpu.ACC((BLOCK_M, HALF), jnp.float32))
        new_accs.append(acc * factor + fresh)
    return new_accs


def publish_stats_none(mine_ref, bar, log_pv_max):
    """No statistics exchange: nothing published (``gather_stats_local`` waits for nothing)."""


def gather_stats_local(other_ref, bar, log_pv_max):
    """No statistics exchange: each warpgroup's own half's row max (wrong by design)."""
    return log_pv_max


def page_boxes_unclipped(bt_ref, b, step, layer_offset, num_pages, *, clamp_each_page: bool = False):
    """The TMA boxes without the page ids' clip into [0, num_pages) (the kernels before the
    fourteenth session): what the clip costs. ``clamp_each_page``: each page's table column
    clamped on its own, as before the thirtieth session (two dependent 32-bit loads a step
    where the batch row is a loaded value, against one 64-bit load)."""
    max_pages = bt_ref.shape[1]
    columns = ([jnp.minimum(step * 2 + half, max_pages - 1) for half in range(2)] if clamp_each_page
               else mgpu_kernel.step_page_columns(step, max_pages))
    for half, column in enumerate(columns):
        page = bt_ref[b, column]
        first_pair = mgpu_kernel._aligned((layer_offset + page * mgpu_kernel.PAGE) // 2, mgpu_kernel.PAGE // 2)
        for parity in range(2):
            yield (parity, pl.ds(first_pair, mgpu_kernel.PAGE // 2),
                   pl.ds(parity * HALF + half * (mgpu_kernel.PAGE // 2), mgpu_kernel.PAGE // 2))


VARIANTS = {
    "baseline": {},
    "rope_first": {"step_scores": scores_rope_first},
    "promotion_128": {"qk8_promoted": qk8_promotion_128},
    "qk_pipelined": {"qk8_promoted": qk8_pipelined},
    "no_rope": {"step_scores": scores_fp8_only},
    "no_qk": {"step_scores": scores_constant},
    # (With the producer warpgroup, ISSUE_BY_WARPS only matters with "no_producer".)
    "issue_by_one_thread": {"ISSUE_BY_WARPS": False, "PRODUCER_WG": False},
    # The ninth session's producer warpgroup: off (consumer 0 issues the ring, its
    # warps sharing the copies), other register splits, and its four warps sharing the issue.
    "no_producer": {"PRODUCER_WG": False},
    "registers_56_224": {"PRODUCER_REGISTERS": 56, "CONSUMER_REGISTERS": 224},
    "registers_40_232": {"PRODUCER_REGISTERS": 40, "CONSUMER_REGISTERS": 232},
    "producer_by_warps": {"PRODUCER_ISSUE_BY_WARPS": True},
    "pages_unclipped": {"page_boxes": page_boxes_unclipped},
    "pages_unclipped_each_clamped": {"page_boxes": functools.partial(page_boxes_unclipped, clamp_each_page=True)},
    "precise_math": {"APPROX_MATH": False},
    # Stand-ins of the transposed P'.V's step (the shipped path): what each part costs.
    "no_softmax_t": {"softmax_frame": softmax_t_none},
    "no_pv_t": {"pv_update_t": pv_t_none},
    "no_stats_exchange": {"publish_stats": publish_stats_none, "gather_stats": gather_stats_local},
    "no_compute_t": {"step_scores": scores_constant, "softmax_frame": softmax_t_none, "pv_update_t": pv_t_none},
    # The twenty-first session's changes undone: Q.K in two 256-feature chains, the statistics
    # and P' exchanges through mbarriers; each alone.
    "twentieth_session": {"QK_PROMOTION": 256, "NAMED_SYNC": False},
    "promotion_256": {"QK_PROMOTION": 256},
    "mbarrier_sync": {"NAMED_SYNC": False},
    # Twenty-second session: the per-row SMEM stores with Pallas's warpgroup barriers around them.
    "synced_row_stores": {"UNSYNCED_ROW_STORES": False},
    "commit_with_barrier": {"FENCE_ONLY_COMMIT": False},
    "step_warpgroup_barriers": {"UNSYNCED_ROW_STORES": False, "FENCE_ONLY_COMMIT": False},
    # Candidates for Q.K's wgmma round trips: RoPE beside the (first) chain; at 256, both chains
    # in flight.
    "rope_beside": {"step_scores": scores_rope_beside},
    "rope_beside_256": {"step_scores": scores_rope_beside, "QK_PROMOTION": 256},
    "chains_in_flight_256": {"qk8_promoted": qk8_chains_in_flight, "QK_PROMOTION": 256},
    # Twenty-fourth session: P' clamped to 448 before its (saturating) cast; the next V^T tile
    # loaded during a product. (Its "log2_in_step" left with the per-token logarithms' flag: the
    # twenty-sixth session's softmax needs them as an input, ``softmax_frame``.)
    "p_clamped": {"SATURATING_P_CAST": False},
    "pv_prefetch": {"pv_update_t": pv_t_prefetch},
    # Twenty-seventh session: fresh accumulators zeroed (Pallas's ACC) instead of overwritten by
    # their first wgmma (``mgpu_fresh_acc``).
    "zeroed_fresh_acc": {"FRESH_OVERWRITE": False},
}


SMALL_ROWS = small_kernel.ROWS


def small_scores_constant(q8_s, kv_slot, qr_s, rope_slot, q_scale, k_scales, *, interpret):
    """No QK wgmmas: constant S^T halves (the wait for the step's TMA remains)."""
    return [plgpu.layout_cast(jnp.full((HALF, SMALL_ROWS), 1.0, jnp.float32), plgpu.Layout.WGMMA)] * 2


def small_softmax_none(scores, k_scales, m, l, scale_log2, visible=None):
    """No softmax: P' is the scores (still rounded, stored and multiplied)."""
    one = l * 0.0 + 1.0
    return m, one, l, scores, one


def small_v_constant(chunk_ref, half, t0, seq_len, *, masked):
    """No V load or conversion: a constant f16 tile (the store to SMEM remains)."""
    return plgpu.layout_cast(jnp.full((HALF, CHUNK), 1.0, jnp.float16), plgpu.Layout.WGMMA)


def small_pv_none(accs, kv_slot, wg, pt_ref, v16_ref, alpha, pv_max, t0, seq_len, *, masked, first_converted=False):
    """No V conversion and no V^T.P'^T wgmma: the accumulators are only rescaled."""
    alpha_b = lax.broadcast_in_dim(alpha, (CHUNK, SMALL_ROWS), [1])
    return [acc * alpha_b for acc in accs]


SMALL_VARIANTS = {
    "baseline": {},
    "issuer_0": {"ISSUER": 0},
    "no_qk": {"step_scores_t": small_scores_constant},
    "no_softmax": {"softmax_t": small_softmax_none},
    "v_constant": {"v_half_f16": small_v_constant},
    "no_pv": {"pv_update_t": small_pv_none},
    "no_compute": {"step_scores_t": small_scores_constant, "softmax_t": small_softmax_none,
                   "pv_update_t": small_pv_none},
    # The TMA ring's issue (shared ``step_issuer``; a constant of the 64-row kernel's module).
    "issue_by_one_thread": {"ISSUE_BY_WARPS": False},
    "precise_math": {"APPROX_MATH": False},
    # Fewer fp32 promotions of S^T (the 64-row kernel's twenty-first session change; here all
    # chains are in flight under one wait, so fewer chains save adds and accumulators, not waits).
    "promotion_256": {"QK_PROMOTION": 256},
    "promotion_512": {"QK_PROMOTION": 512},
    # Twenty-third session: warpgroup 0's per-row stores with Pallas's warpgroup barriers around them.
    "synced_row_stores": {"UNSYNCED_ROW_STORES": False},
}
SMALL_ORIGINAL = {name: getattr(small_kernel, name) for name in
                  ("step_scores_t", "softmax_t", "v_half_f16", "pv_update_t", "ISSUER", "QK_PROMOTION",
                   "UNSYNCED_ROW_STORES")}

# ``--kernel bf16``: the Mosaic BF16 twin (mla_decode_mgpu_bf16.py, through ``mla_decode`` on
# the bf16 cache), with the other register split: the baseline should get what the FP8
# kernel gets.
BF16_VARIANTS = {
    "baseline": {},
    "registers_40_232": {"PRODUCER_REGISTERS": 40, "CONSUMER_REGISTERS": 232},
}
BF16_ORIGINAL = {name: getattr(bf16_kernel, name) for name in ("PRODUCER_REGISTERS", "CONSUMER_REGISTERS")}


def load_kernel_file(path: str):
    """``mla_decode_mgpu`` of another copy of pallas_kernels/mla_decode_mgpu.py (a module of
    its own; it imports the rest of pallas_kernels as the library's copy does)."""
    spec = importlib.util.spec_from_file_location(f"compare_{pathlib.Path(path).stem}", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    return other.mla_decode_mgpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/probe_mgpu_costs")
    parser.add_argument("--shape", default="64x16384x128x1")
    parser.add_argument("--kernel", choices=("mgpu", "small", "bf16"), default="mgpu",
                        help="the 64-row kernel (mgpu), the 16-row one (small) or the Mosaic BF16 twin (bf16)")
    parser.add_argument("--variants", nargs="*", help="default: all of the kernel's")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds over the variants")
    parser.add_argument("--min-sample-ms", type=float, default=10.0,
                        help="the shortest timed sample (of at least 10 calls), ms")
    parser.add_argument("--kernel-trace-rounds", type=int, default=0,
                        help="also the decode kernel's median GPU duration over this many rounds of "
                             "interleaved calls in one profiler trace (0: not measured)")
    parser.add_argument("--compare-file", action="append", default=[],
                        help="another mla_decode_mgpu.py whose kernel is timed as variant file:<stem>")
    args = parser.parse_args(argv)
    if args.compare_file and args.kernel != "mgpu":
        parser.error("--compare-file: the 64-row kernel's module only (--kernel mgpu)")
    module, original, variants, block_rows = {
        "small": (small_kernel, SMALL_ORIGINAL, SMALL_VARIANTS, SMALL_ROWS),
        "bf16": (bf16_kernel, BF16_ORIGINAL, BF16_VARIANTS, BLOCK_M),
    }.get(args.kernel, (mgpu_kernel, ORIGINAL, VARIANTS, BLOCK_M))
    spec = importlib.util.spec_from_file_location("bench_mgpu", ROOT / "bench_mgpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (batch, context, heads, s_q), fp8, block_table, q, q_rope, seq_lens, scale = bench.fp8_problem(
        args.shape, bf16=args.kernel == "bf16")
    splits = bench.mosaic_splits(batch, s_q * heads, context, block_rows)
    results = {"env": timing.environment(), "kernel": args.kernel, "shape": args.shape, "num_splits": splits,
               "ms": {}}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results["rel_l2_to_baseline"] = {}
    results["rounds"] = args.rounds
    reference = None
    call_args = (q, q_rope, fp8, block_table, seq_lens)
    compiled = {}
    other_kernels = {f"file:{pathlib.Path(path).stem}": load_kernel_file(path) for path in args.compare_file}
    for name in (args.variants or list(variants)) + list(other_kernels):
        for helper, fn in original.items():
            setattr(module, helper, variants.get(name, {}).get(helper, fn))
        # ``step_issuer`` is shared: the 16-row kernel's variants may set its constant too.
        for shared in ("ISSUE_BY_WARPS", "APPROX_MATH"):  # the 64-row module's, read by both kernels
            setattr(mgpu_kernel, shared, variants.get(name, {}).get(shared, ORIGINAL[shared]))
        bench.mla_decode_mgpu = other_kernels.get(name, mgpu_kernel.mla_decode_mgpu)
        jax.clear_caches()  # the kernel's jit cache would hand back the previous variant
        if args.kernel == "bf16":  # the twin through the API, with its split plan
            fn = jax.jit(lambda q, qr, c, bt, n: bench.mla_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                  backend="pallas", config=bench.MOSAIC_CONFIG))
        else:
            fn = jax.jit(lambda q, qr, c, bt, n: bench.mgpu_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                   small=args.kernel == "small", num_splits=splits))
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
    for helper, fn in original.items():
        setattr(module, helper, fn)
    for shared in ("ISSUE_BY_WARPS", "APPROX_MATH"):
        setattr(mgpu_kernel, shared, ORIGINAL[shared])
    bench.mla_decode_mgpu = mgpu_kernel.mla_decode_mgpu
    # Round-robin over the compiled variants (the order rotated each round), so that a drift of
    # the GPU's clocks during the run falls on all of them alike; two samples a round, each of
    # at least ``--min-sample-ms`` (so that its host dispatch and sync weigh ~1%); the median.
    results["min_sample_ms"] = args.min_sample_ms
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
    (out_dir / "probe_costs.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
