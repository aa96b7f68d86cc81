"""``python -m snapmla_jax.bench decode``: MLA decode, FP8 kernel vs its BF16 twin,
the plain-XLA path and JAX's stock Pallas decode kernel, with roofline fractions.

For every (batch B, context, heads H, s_q) the same random cache contents are
stored as fp8 and bf16 LatentCaches (page_size 64, each row's pages in order),
and each method is timed as the median of synchronised samples of back-to-back
calls (at least 10, and enough to last ``MIN_SAMPLE_MS``), the methods' samples
taken round-robin (``timing.time_round_robin``: by default one sample of every method
a round) so that a drift of the GPU's clocks during the row falls on all of them
alike. Columns:

  ms           median time of one decode call (all B rows, one layer)
  layers       calls a timed sample chains inside one jit (``chain_layers``), each
               over its own layer of a layered cache and taking the previous
               call's output as its query, as a model's layers do; ms is the
               chain's time / layers. Small problems need it: one call from
               Python costs ~0.06 ms of host dispatch, more than the kernel
               at B = 1, and one layer's cache would sit in L2 between calls
  GB/s         cache bytes + query/output bytes moved, per second
  TFLOP/s      2 * B * s_q * H * ctx * (576 + 512) per second
  % roof       roofline time / measured time, from ceilings measured in the run
               that timed the row (``ceil``): copy bandwidth, and the FP8 / BF16 GEMM rates (the FP8
               kernel's 512-dim products are e4m3, its 64-dim RoPE product bf16).

Writes ``decode.json`` and ``decode.md`` under ``--out`` (default: outside the source tree,
printed; ``--publish``: the repository's docs/benchmarks/).
``--merge`` keeps rows of an earlier run whose shapes this run does not cover,
so a long grid can be measured in several invocations; the "measured" column
says when each row was (a kernel change between invocations shows there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import traceback

import jax
import jax.numpy as jnp

from snapmla_jax.pallas_kernels.mla_decode import FP8_CONFIG
from snapmla_jax import cli
from snapmla_jax.bench import timing
from snapmla_jax.cache import INT32_LIMIT, LatentCache, kernel_addressable
from snapmla_jax.decode import mla_decode
from snapmla_jax.quantization import quantize_per_token

RANK, ROPE, PAGE = 512, 64, 64
FULL = dict(batches=(1, 8, 32, 64, 128), contexts=(1024, 4096, 16384, 65536), heads=(16, 128), s_qs=(1, 2))
QUICK = dict(batches=(1, 64), contexts=(4096, 16384), heads=(128,), s_qs=(1,))
# Share of device memory a configuration may plan to use (caches + the XLA path's temporaries).
MEMORY_FRACTION = 0.7
# How long a timed sample of back-to-back calls lasts at least (``timing.time_round_robin``):
# the host's dispatch before a sample's first launch and the synchronisation after its last
# (~50-100 us) stay within ~1% of it. Samples of 10 calls of 0.24 ms had charged the FP8 path at
# B=32 x 16k x 128 ~5 us a call for its first call's host gap (docs/benchmarks/mgpu.md,
# twenty-third session).
MIN_SAMPLE_MS = 10.0
# FP8 cache bytes a chain of layers reads at least (``chain_layers``): 5x an H100's or
# H200's 50 MB L2, so that no layer's pages are still cached when the chain comes back.
CHAIN_BYTES = 256 << 20
MAX_CHAIN = 256
FP8_BYTES_PER_TOKEN = RANK + 4 + 2 * ROPE


def chain_layers(batch: int, context: int) -> int:
    """Layers a timed sample chains for a B x context problem: enough that their fp8 caches
    hold CHAIN_BYTES (1 from B x context = 400k tokens up), at most MAX_CHAIN and within
    the kernels' int32 offsets."""
    tokens = batch * context
    layers = min(MAX_CHAIN, max(1, -(-CHAIN_BYTES // (tokens * FP8_BYTES_PER_TOKEN))))
    while layers > 1 and not kernel_addressable(layers * tokens, RANK):
        layers -= 1
    return layers


def decode_chain(softmax_scale: float, layers: int, backend: str = "auto", config=None, num_splits=None):
    """jit of ``layers`` mla_decode calls (``backend``, ``config``, ``num_splits``), call i over
    layer i of the cache (no layer axis when ``layers`` is 1), each call's output the next call's
    query: (q, q_rope, cache, block_table, seq_lens) -> out [B, s_q, H, 512]."""
    def one(q, q_rope, cache, block_table, seq_lens, layer):
        return mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=softmax_scale, layer=layer,
                          backend=backend, config=config, num_splits=num_splits)

    if layers == 1:
        return jax.jit(lambda q, *rest: one(q, *rest, None))
    # A traced layer, as a model scanning its layers passes it: one compiled body.
    return jax.jit(lambda q, *rest: jax.lax.fori_loop(0, layers, lambda i, x: one(x, *rest, i), q))


def _device_memory() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 16 << 30))


def make_caches(batch: int, context: int, seed: int = 0,
                layers: int = 1) -> tuple[LatentCache, LatentCache, jax.Array]:
    """fp8 and bf16 caches of the same random contents (per-token magnitudes e^N(0,1)), and the block table.

    ``layers`` > 1: caches with a layer axis, every layer a copy of the same contents (the
    timing reads each layer's own bytes; their values need not differ)."""
    pages = batch * context // PAGE
    fp8, bf16 = random_caches(pages, layers, seed)
    block_table = jnp.arange(pages, dtype=jnp.int32).reshape(batch, context // PAGE)
    return fp8, bf16, block_table


def random_caches(pages: int, layers: int = 1, seed: int = 0) -> tuple[LatentCache, LatentCache]:
    """fp8 and bf16 caches of ``pages`` pages of the same random contents (per-token magnitudes
    e^N(0,1)); ``layers`` > 1: with a layer axis, every layer a copy of the same contents."""
    k = jax.random.split(jax.random.key(seed), 3)
    latent = (jax.random.normal(k[0], (pages, PAGE, RANK), jnp.bfloat16)
              * jnp.exp(jax.random.normal(k[1], (pages, PAGE, 1), jnp.bfloat16)))
    rope = jax.random.normal(k[2], (pages, PAGE, ROPE), jnp.bfloat16)
    latent_fp8, scale = jax.jit(quantize_per_token)(latent)
    if layers > 1:
        stack = lambda a: jnp.broadcast_to(a[None], (layers, *a.shape)).copy()
        latent, latent_fp8, scale, rope = map(stack, (latent, latent_fp8, scale, rope))
    return LatentCache(latent=latent_fp8, scale=scale, rope=rope), LatentCache(latent=latent, scale=None, rope=rope)


def first_layer(cache: LatentCache) -> LatentCache:
    """Layer 0 of a layered cache (the stock kernel takes no layer), else the cache itself."""
    return cache.layer_arrays(0) if cache.num_layers else cache


def stock_mqa(q, q_rope, cache: LatentCache, block_table, seq_lens, softmax_scale):
    """JAX's stock Pallas decode kernel on MLA shapes: MQA with the 576-dim
    [latent, rope] as K and as V (its V must match K's width; the first 512
    output dims are the MLA output), on a contiguous copy of the cache."""
    from jax.experimental.pallas.ops.gpu.decode_attention import mqa

    batch = q.shape[0]
    contiguous = lambda a: jnp.take(a, block_table, axis=0).reshape(batch, -1, a.shape[-1])
    k = jnp.concatenate([contiguous(cache.latent), contiguous(cache.rope)], axis=-1)
    qk = jnp.concatenate([q[:, 0], q_rope[:, 0]], axis=-1)
    return (jax.jit(lambda qk, k, n: mqa(qk, k, k, kv_seq_len=n, sm_scale=softmax_scale)[..., :RANK]),
            (qk, k, seq_lens))


def _probe_stock(q, q_rope, cache, block_table, seq_lens, scale) -> str | None:
    """None if the stock kernel runs on these MLA shapes, else why not (first line of the error)."""
    try:
        fn, args = stock_mqa(q, q_rope, cache, block_table, seq_lens, scale)
        jax.block_until_ready(fn(*args))
        return None
    except Exception as err:  # the reason is the result here
        lines = [l for l in str(err).splitlines() if l.strip()]
        return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def roofline_ms(nbytes: float, flops_fp8: float, flops_bf16: float, ceilings: timing.Ceilings) -> float:
    memory = nbytes / (ceilings.copy_gbps * 1e9)
    compute = flops_fp8 / (ceilings.fp8_tflops * 1e12) + flops_bf16 / (ceilings.bf16_tflops * 1e12)
    return max(memory, compute) * 1e3


BF16_BYTES_PER_TOKEN = 2 * (RANK + ROPE)
# The measured methods: the cache each reads (bytes a token) and whether its QK content
# and PV products run in FP8 (the RoPE product is bf16 in all).
METHODS = {"fp8": (FP8_BYTES_PER_TOKEN, True), "fp8_triton": (FP8_BYTES_PER_TOKEN, True),
           "bf16": (BF16_BYTES_PER_TOKEN, False), "xla_bf16": (BF16_BYTES_PER_TOKEN, False)}


def method_work(method: str, batch: int, context: int, heads: int, s_q: int) -> tuple[int, int, int]:
    """(bytes, FP8 FLOPs, BF16 FLOPs) of one decode call of ``method`` (``METHODS``): the cache
    read plus the queries and outputs in bf16; Q.K over 512 + 64 features and P.V over 512."""
    per_token, fp8 = METHODS[method]
    nbytes = batch * context * per_token + batch * s_q * heads * (RANK + ROPE + RANK) * 2
    flops = 2 * batch * s_q * heads * context * (RANK + ROPE + RANK)
    flops_rope = 2 * batch * s_q * heads * context * ROPE
    return (nbytes, flops - flops_rope, flops_rope) if fp8 else (nbytes, 0, flops)


def with_run_ceilings(row: dict, ceilings: dict, device: str) -> dict:
    """``row`` carrying the ceilings (``timing.Ceilings`` as a dict) and device its % roof was
    computed with: a row of this version carries its own run's (``measure_config``); a row
    written before rows carried them gets those its file was last saved with (until then every
    save restated kept rows' fractions with the saving run's ceilings)."""
    row = dict(row)
    row.setdefault("ceilings", dict(ceilings))
    row.setdefault("device", device)
    return row


def ceiling_runs(rows: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """The distinct (device, ceilings) of ``rows`` in order of first appearance, labelled c1, c2, ...:
    (label, {"device", "ceilings"}, the rows measured with them)."""
    runs: dict[str, tuple[dict, list[dict]]] = {}
    for row in rows:
        key = json.dumps([row.get("device"), row.get("ceilings")], sort_keys=True)
        runs.setdefault(key, ({"device": row.get("device"), "ceilings": row.get("ceilings")}, []))[1].append(row)
    return [(f"c{i + 1}", run, members) for i, (run, members) in enumerate(runs.values())]


def make_queries(batch: int, context: int, heads: int, s_q: int) -> tuple[jax.Array, jax.Array, jax.Array, float]:
    """Random bf16 queries (q [B, s_q, H, 512], q_rope [B, s_q, H, 64]), seq_lens at the full
    context, and the softmax scale 1/sqrt(576)."""
    k = jax.random.split(jax.random.key(batch * 7 + heads + s_q), 2)
    q = jax.random.normal(k[0], (batch, s_q, heads, RANK), jnp.bfloat16)
    q_rope = jax.random.normal(k[1], (batch, s_q, heads, ROPE), jnp.bfloat16)
    return q, q_rope, jnp.full((batch,), context, jnp.int32), 1.0 / math.sqrt(RANK + ROPE)


def measure_config(batch, context, heads, s_q, caches, ceilings, iters, stock_reason, memory,
                   rounds: int | None = None):
    fp8, bf16, block_table = caches
    layers = fp8.num_layers or 1
    q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
    # The cache is an argument of the jitted step (as in a serving loop), not a
    # closed-over constant that XLA would have to embed.
    run = lambda backend, config=None: decode_chain(scale, layers, backend, config)
    row = dict(batch=batch, context=context, heads=heads, s_q=s_q, layers=layers,
               measured_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    plans = {
        # The default FP8 kernel (page 64: the Mosaic GPU kernel) and the Triton FP8 kernel, same math.
        "fp8": (fp8, "pallas", None),
        "fp8_triton": (fp8, "pallas", FP8_CONFIG),
        "bf16": (bf16, "pallas", None),
        "xla_bf16": (bf16, "xla", None),
    }
    # The XLA path gathers the pages (a bf16 copy) and keeps fp32 scores and weights.
    xla_bytes = batch * context * bf16.nbytes_per_token + 3 * batch * s_q * heads * context * 4
    runs = {}
    for name, (cache, backend, config) in plans.items():
        assert cache.nbytes_per_token == METHODS[name][0], (name, cache.nbytes_per_token)
        if name == "xla_bf16" and xla_bytes > MEMORY_FRACTION * memory / 2:
            row[f"{name}_ms"] = None
            row[f"{name}_note"] = "skipped: does not fit memory"
            continue
        runs[name] = (run(backend, config), [(q, q_rope, cache, block_table, seq_lens)])
    if stock_reason is None:
        stock_fn, stock_args = stock_mqa(q, q_rope, first_layer(bf16), block_table, seq_lens, scale)
        runs["stock_mqa"] = (stock_fn, [stock_args])
    else:
        row["stock_mqa_ms"] = None
        row["stock_mqa_note"] = "does not run: " + stock_reason
    # Side by side, round-robin (``timing.time_round_robin``): the ratios between the methods
    # do not depend on which ran first while the GPU's clocks drifted.
    for name, result in timing.time_round_robin(runs, rounds=rounds, iters=iters, min_sample_ms=MIN_SAMPLE_MS).items():
        if isinstance(result, Exception):  # a failing method is reported, the run goes on
            row[f"{name}_ms"] = None
            row[f"{name}_note"] = f"{type(result).__name__}: {str(result).splitlines()[0][:160]}"
            continue
        if name == "stock_mqa":  # one layer, one call
            row["stock_mqa_ms"] = result
            continue
        ms = result / layers
        nbytes, f8, f16 = method_work(name, batch, context, heads, s_q)
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = nbytes / (ms * 1e-3) / 1e9
        row[f"{name}_tflops"] = (f8 + f16) / (ms * 1e-3) / 1e12
        row[f"{name}_roofline"] = roofline_ms(nbytes, f8, f16, ceilings) / ms
    if row.get("fp8_ms") and row.get("bf16_ms"):
        row["fp8_over_bf16"] = row["bf16_ms"] / row["fp8_ms"]
    if row.get("fp8_ms") and row.get("xla_bf16_ms"):
        row["fp8_over_xla"] = row["xla_bf16_ms"] / row["fp8_ms"]
    if row.get("fp8_triton_ms") and row.get("bf16_ms"):
        row["fp8_triton_over_bf16"] = row["bf16_ms"] / row["fp8_triton_ms"]
    return row


def shape_key(row: dict) -> tuple[int, int, int, int]:
    return row["batch"], row["context"], row["heads"], row["s_q"]


def to_markdown(env: dict, ceilings: dict, rows: list[dict], stock_reason: str | None,
                merged: bool = False) -> str:
    fmt = lambda v, spec="{:.3g}": "-" if v is None else spec.format(v)
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"
    cols = ["B", "ctx", "H", "s_q", "layers", "FP8 ms", "BF16 ms", "XLA bf16 ms", "FP8/BF16", "FP8/XLA",
            "FP8 GB/s", "FP8 TFLOP/s", "FP8 % roof", "BF16 GB/s", "BF16 TFLOP/s", "BF16 % roof", "XLA % roof",
            "Triton FP8 ms", "Triton/BF16", "Triton % roof", "ceil", "measured (UTC)"]
    runs = ceiling_runs(rows)
    label = {id(row): name for name, run, members in runs if run["ceilings"] for row in members}
    body = [[r["batch"], r["context"], r["heads"], r["s_q"], r.get("layers", "-"), fmt(r.get("fp8_ms")),
             fmt(r.get("bf16_ms")), fmt(r.get("xla_bf16_ms")), fmt(r.get("fp8_over_bf16"), "{:.2f}x"),
             fmt(r.get("fp8_over_xla"), "{:.2f}x"),
             fmt(r.get("fp8_gbps"), "{:.0f}"), fmt(r.get("fp8_tflops"), "{:.0f}"), pct(r.get("fp8_roofline")),
             fmt(r.get("bf16_gbps"), "{:.0f}"), fmt(r.get("bf16_tflops"), "{:.0f}"), pct(r.get("bf16_roofline")),
             pct(r.get("xla_bf16_roofline")), fmt(r.get("fp8_triton_ms")),
             fmt(r.get("fp8_triton_over_bf16"), "{:.2f}x"), pct(r.get("fp8_triton_roofline")),
             label.get(id(r), "-"), r.get("measured_utc", "-")] for r in rows]
    stamps = lambda members: sorted(m["measured_utc"] for m in members if m.get("measured_utc"))
    legend = [f"- {name}: {run['device']}, copy {run['ceilings']['copy_gbps']:.0f} GB/s, BF16 GEMM "
              f"{run['ceilings']['bf16_tflops']:.0f} TFLOP/s, FP8 GEMM {run['ceilings']['fp8_tflops']:.0f} TFLOP/s"
              + (f" (rows measured {stamps(members)[0]} to {stamps(members)[-1]} UTC)" if stamps(members) else "")
              for name, run, members in runs if run["ceilings"]]
    notes = sorted({f"{k[:-5]}: {r[k]}" for r in rows for k in r if k.endswith("_note") and k != "stock_mqa_note"})
    stock = ("runs (times in decode.json)" if stock_reason is None else f"does not run: {stock_reason}")
    lines = [
        "# MLA decode benchmark",
        "",
        f"Device: {env['device']}, jax {env['jax']}, Python {env['python']}, date {env['date']}.",
        f"Ceilings measured in this run: copy {ceilings['copy_gbps']:.0f} GB/s, "
        f"BF16 GEMM {ceilings['bf16_tflops']:.0f} TFLOP/s, FP8 GEMM {ceilings['fp8_tflops']:.0f} TFLOP/s.",
        *(["Rows kept from earlier invocations (--merge) were measured with the kernels of their time (the",
           "\"measured\" column)."] if merged else []),
        "Each row's % roof is against the ceilings its own run measured (column \"ceil\"; the rates differ",
        "between GPUs of one model and between runs, FP8 GEMM 1401-1487 TFLOP/s on H100s on 2026-11-26).",
        "Rows saved before rows carried their ceilings (twenty-seventh session, 2026-11-26) were restated at",
        "every save with the saving run's ceilings: theirs are the last such run's.",
        *legend,
        "",
        "One decode call over one layer, page_size 64, all rows at the full context; times are medians.",
        "Rows measured from 2026-11-26 11:05 UTC take the methods' samples round-robin (5 rounds, each",
        "timing every method in turn), so that the GPU's clocks drifting during a row fall on all methods",
        "alike; earlier rows timed one method after the other (the BF16 twin, timed after the FP8 kernel,",
        "then moved ~5% between runs). Rows measured from 2026-11-26 11:50 UTC run samples of at least",
        f"{MIN_SAMPLE_MS:g} ms (of at least 10 calls) instead of 10 calls, so that a sample's host dispatch",
        "and synchronisation weigh ~1% of it (samples of 10 calls of 0.24 ms charged the FP8 path ~5 us a",
        "call at B=32 x 16k x 128).",
        "Rows measured from 2026-11-26 13:30 UTC run the kernels of the twenty-fourth session: the split",
        "merge computes each split's weight once a row instead of once a value (1.3-2x faster, both",
        "methods), split partials are bf16 for a bf16 output (`combine_splits.partial_dtype`), and the",
        "64-row FP8 kernel reads its token scales' logarithms from the inputs launch and casts P' without",
        "a clamp (1-4%; docs/benchmarks/mgpu.md).",
        "Rows measured from 2026-11-26 17:40 UTC run the twenty-sixth session's 64-row FP8 kernel: its",
        "softmax in the log domain of P * k_scale, one row statistic a step instead of two (1-7%, the",
        "same P' roundings; docs/benchmarks/mgpu.md).",
        "Rows measured from 2026-11-26 19:50 UTC run the twenty-seventh session's 64-row FP8 kernel: its",
        "fresh Q.K and P'.V accumulators overwritten by their first wgmma instead of zeroed first",
        "(`pallas_kernels/mgpu_fresh_acc.py`; the same bits, 18% fewer instructions a step, -1% to +4%",
        "side by side), and each row's % roof against its own run's ceilings (column \"ceil\").",
        "Rows measured before 2026-11-26 22:30 UTC predate the twenty-eighth session's split plan",
        "(`pallas_kernels/split_plan.py`: each row's CTAs in proportion to its seq_len, the Mosaic kernels'",
        "default since). On these uniform batches it makes a call 4-7% slower, the kernels themselves as",
        "fast as before (H100, side by side, 22:17 UTC: 32 x 16k x 128 0.228 vs 0.212 ms, 128 x 16k x 128",
        "0.895 vs 0.852, 64 x 16k x 128 x 2 0.838 vs 0.796; docs/benchmarks/mgpu.md, twenty-eighth session);",
        "over ragged batches 1.5-7.3x faster (ragged.md).",
        "Rows measured from 2026-11-27 00:15 UTC run the twenty-ninth session's plan and sampling: the",
        "plan in one launch (`pallas_kernels/split_plan_kernel.py`, 1.7-2.6 us, instead of five XLA",
        "launches, ~7 us), the consumers' masked tail locating its CTA again (`walk_steps`' relocate:",
        "1-2% on the FP8 kernel), and samples taken one of each method a round in a shuffled order",
        "(`timing.time_round_robin`; under the H100's software power cap the SM clock moved between 1740",
        "and 1980 MHz within 0.5 s, and what a sample follows sets its clock: the same code measured",
        "FP8/BF16 1.63x and 1.60x at 32 x 16k x 128 under 5 rounds of two samples and one sample a round",
        "in a fixed rotation). Side by side with the code before the plan (H100, 2026-11-27 00:15 UTC),",
        "FP8 is still 3-5% slower a call on these uniform batches (32 x 16k x 128 0.223-0.226 vs",
        "0.212-0.214 ms, 32 x 64k 0.843-0.880 vs 0.817-0.829; docs/benchmarks/mgpu.md, twenty-ninth",
        "session); the rows' ratios come out of one run each and moved by up to 4% between runs.",
        "Rows measured from 2026-11-27 02:20 UTC run the thirtieth session's FP8 kernels: the producer",
        "reads a step's two page ids in one 64-bit load (the step clamped, not each page: `page_boxes`).",
        "That was the plan's cost on uniform batches: on the work-item grid the batch row is a loaded",
        "value, ptxas then emitted two dependent 32-bit loads a step, and the consumers waited ~135 SM",
        "cycles a step longer for their data. Side by side, GPU kernel durations from one trace of",
        "interleaved calls (H100, 02:10 UTC): the FP8 kernel 1.002-1.006x the code before the plan, was",
        "1.036-1.039x (32 x 16k and 64k x 128; docs/mosaic_gpu_decode_plan.md, thirtieth session).",
        "Rows measured from 2026-11-27 04:50 UTC run the thirty-first session's FP8 launches: the balanced",
        "plan computed in the inputs launch (one launch a call fewer: 0.5-10% a call) and query rows",
        "short of whole blocks (H = 16 at s_q = 2, H = 24, 32) padded there too, where XLA padded q and",
        "q_rope in two launches (1-6%); the BF16 twin still pads in XLA. Same bits; side by side in",
        "docs/benchmarks/fused_plan_s31/.",
        "Rows measured from 2026-11-27 06:23 UTC run the thirty-second session's BF16 twin, which pads",
        "its query rows and computes its plan in one launch (`mgpu_decode_inputs.bf16_rows_and_plan`)",
        "as the FP8 path does, where XLA padded q and q_rope in two launches and the plan had a third.",
        "Same bits; side by side (H100, 06:21 UTC) the twin's call 0.974x at 64 x 4k x 16 x 2, 0.99-1.01x",
        "at 128 x 16k x 16 x 2 and 32 x 16k x 32 (docs/benchmarks/fused_plan_s31/twin_rows.json).",
        "layers: each timed sample runs that many calls in one jit, each over its own layer of a layered",
        "cache and taking the last call's output as its query (as a model's layers do), ms = its time /",
        "layers; enough layers that they read >= 256 MiB of fp8 cache (5x the L2), 1 from B x ctx = 400k",
        "tokens up. \"-\": measured before this, one call at a time from Python, whose ~0.06 ms of host",
        "dispatch set the time of the smallest problems.",
        "Shapes whose cache exceeds the kernels' int32 offsets (2**31 - 1 latent elements, e.g. B=128 x 64k)",
        "are not run: one decode call cannot address them (mla_decode raises ValueError).",
        "FP8 = the default SnapMLA FP8 kernel on the fp8 cache (644 B/token): with page_size 64 a",
        "Mosaic GPU kernel (`snapmla_jax.decode.mosaic_kernel`): up to 16 query rows (H=16, s_q=1)",
        "pallas_kernels/mla_decode_mgpu_small.py (16 rows on the wgmma N dimension; rows of 32 measured",
        "before 2026-11-25 22:50 UTC ran it in 32-row blocks), above that",
        "pallas_kernels/mla_decode_mgpu.py (64-row blocks; two consumer warpgroups, each scoring half of a",
        "step's tokens and owning half of the output columns, and a TMA producer warpgroup; rows measured",
        "before 2026-11-26 04:50 UTC ran its P'.V untransposed, V^T written to SMEM, 4-8% slower side by",
        "side: docs/benchmarks/mgpu.md, twentieth session; rows measured before 2026-11-26 07:25 UTC ran",
        "its Q.K as two 256-feature chains and its exchanges through mbarriers, 11-16% slower side by side:",
        "twenty-first session; rows measured before 2026-11-26 10:00 UTC ran its step with Pallas's",
        "warpgroup barriers around the exchanged stores, 3-5% slower side by side: twenty-second session;",
        "rows of the 16-row kernel measured before 2026-11-26 09:45 UTC promoted S^T every 128 features,",
        "1.5-3% slower); up to 32 query",
        "rows and 16k tokens of block-table capacity over the batch the Triton FP8 kernel",
        "(`snapmla_jax.decode.TRITON_FP8_MAX_TOKENS`; rows measured before 2026-11-26 03:00 UTC ran the",
        "Mosaic kernels there, 1.0-1.4x slower). BF16 = the default",
        "BF16 twin on the bf16 cache (1152 B/token): above 16 query rows the Mosaic GPU twin",
        "(pallas_kernels/mla_decode_mgpu_bf16.py, 64-row blocks; rows measured before 2026-11-25 22:30 UTC",
        "ran the Triton twin there, 1.3-2.2x slower at H=128), up to 16 the Triton twin. XLA bf16 =",
        "`mla_decode(..., backend=\"xla\")` on the bf16 cache (gather + einsum + softmax, what a JAX user",
        "writes today). Triton FP8 = the Triton FP8 kernel (`FP8_CONFIG`), the Triton BF16 twin's sibling;",
        "Triton/BF16 divides by the BF16 column; \"-\" where not measured or failed (notes).",
        f"JAX stock `pallas.ops.gpu.decode_attention.mqa` (the 576-dim [latent, rope] as K and V): {stock}.",
        "",
        timing.markdown_table(cols, body),
    ]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m snapmla_jax.bench decode", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    cli.add_bench_output_flags(parser, "decode.json / decode.md")
    parser.add_argument("--iters", type=int, default=10, help="timed samples (of 10 calls) per measurement")
    parser.add_argument("--rounds", type=int, default=None,
                        help="round-robin rounds the samples are spread over (timing.time_round_robin; "
                             "default: --iters, one sample of each method a round)")
    parser.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    parser.add_argument("--contexts", type=int, nargs="*", help="override the context lengths")
    parser.add_argument("--heads", type=int, nargs="*", help="override the head counts")
    parser.add_argument("--s-q", type=int, nargs="*", dest="s_qs", help="override the query lengths")
    parser.add_argument("--merge", action="store_true", help="keep earlier rows of shapes not measured now")
    args = parser.parse_args(argv)
    out = cli.bench_output_dir(args)
    if timing.missing_gpu("decode benchmark"):
        return 2
    grid = dict(QUICK if args.quick else FULL)
    for key in grid:
        if getattr(args, key):
            grid[key] = tuple(getattr(args, key))
    env = timing.environment()
    ceilings = timing.measure_ceilings()
    memory = _device_memory()
    print(f"{env}\n{ceilings}", flush=True)
    rows, stock_reason = [], None
    earlier, earlier_ceilings = [], None
    if args.merge and (out / "decode.json").exists():
        saved = json.loads((out / "decode.json").read_text())
        earlier = saved["rows"]
        earlier_ceilings = (saved["environment"]["ceilings"], saved["environment"]["device"])

    def save(measured: list[dict]) -> str:
        done = {shape_key(r) for r in measured}
        # Each row keeps the % roof of the run that timed it: ceilings differ between machines
        # and runs (FP8 GEMM 1401-1487 TFLOP/s on H100s in one day), and a row's fraction is
        # against what its own GPU measured in the same run.
        kept = [with_run_ceilings(r, *earlier_ceilings) for r in earlier if shape_key(r) not in done]
        merged = sorted(kept + measured, key=lambda r: (r["heads"], r["s_q"], r["batch"], r["context"]))
        ceil = dataclasses.asdict(ceilings)
        markdown = to_markdown(env, ceil, merged, stock_reason, merged=bool(kept))
        timing.write_results(out, "decode", {**env, "ceilings": ceil, "stock_mqa": stock_reason or "runs"}, merged,
                             markdown)
        return markdown

    stock_probed = False
    for batch in grid["batches"]:
        for context in grid["contexts"]:
            cache_bytes = batch * context * (644 + 1152)
            if not kernel_addressable(batch * context, RANK):
                print(f"skip B={batch} ctx={context}: {batch * context * RANK} latent elements, {INT32_LIMIT}",
                      flush=True)
                continue
            if cache_bytes > MEMORY_FRACTION * memory:
                print(f"skip B={batch} ctx={context}: caches need {cache_bytes / 2**30:.1f} GiB", flush=True)
                continue
            caches = make_caches(batch, context, layers=chain_layers(batch, context))
            if not stock_probed:
                q = jnp.ones((batch, 1, grid["heads"][0], RANK), jnp.bfloat16)
                stock_reason = _probe_stock(q, q[..., :ROPE], first_layer(caches[1]), caches[2],
                                            jnp.full((batch,), context, jnp.int32), 0.04)
                stock_probed = True
                print(f"stock mqa: {stock_reason or 'runs'}", flush=True)
            for heads in grid["heads"]:
                for s_q in grid["s_qs"]:
                    try:
                        row = measure_config(batch, context, heads, s_q, caches, ceilings, args.iters,
                                             stock_reason, memory, rounds=args.rounds)
                    except Exception:
                        traceback.print_exc()
                        continue
                    row = with_run_ceilings(row, dataclasses.asdict(ceilings), env["device"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(rows)  # after every row: a run cut short keeps what it measured
            del caches
    print(save(rows))
    return 0
