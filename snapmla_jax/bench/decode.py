"""``python -m snapmla_jax.bench decode``: MLA decode, our FP8 kernel beside FlashMLA's BF16
kernel, our BF16 twin, the plain-XLA path and JAX's stock Pallas decode kernel, with roofline
fractions.

For every (batch B, context, heads H, s_q) the same random cache contents are stored as fp8 and
bf16 LatentCaches (page_size 64, each row's pages in order), and each method is timed as the
median of synchronised samples of back-to-back calls (at least 10, and enough to last
``MIN_SAMPLE_MS``), the methods' samples taken round-robin (``timing.time_round_robin``: one
sample of every method a round, in a shuffled order) so that a drift of the GPU's clocks during
the row falls on all of them alike. Columns:

  ms           median time of one decode call (all B rows, one layer)
  layers       layers of the cache a timed sample reads (``chain_layers``): enough that no
               layer is still in the L2 when the chain comes back to it
  calls        calls a timed sample chains inside one jit (``decode_chain``: at least
               ``MIN_CHAIN_CALLS``, unrolled), call i over layer i mod layers and taking the
               previous call's output as its query, as a model's layers do; ms is the chain's
               time / calls. One call from Python costs ~0.06 ms of host dispatch, more than the
               kernel at B = 1, and one call alone in an executable pays the gap between two
               executables; FlashMLA's CUDA graph replays as many calls
  GB/s         cache bytes + query/output bytes moved, per second
  TFLOP/s      2 * B * s_q * H * ctx * (576 + 512) per second
  % roof       roofline time / measured time, from ceilings measured in the same run (copy
               bandwidth, FP8 and BF16 GEMM rates; the FP8 kernel's 512-dim products are e4m3,
               its 64-dim RoPE product bf16)
  FlashMLA     FlashMLA's dense BF16 decode (``bench.flashmla``) on the bf16 cache's contents, in
               the same process, its layers replayed from one CUDA graph; present only when
               ``--flashmla`` finds it. "FlashMLA/FP8" = FlashMLA's time / ours (> 1: ours faster)

Writes ``decode.json`` and ``decode.md`` (``--name``: other file names) under ``--out``
(default: outside the source tree, printed; ``--publish``: the repository's docs/benchmarks/).
``--merge`` keeps rows of an earlier run whose shapes this run does not cover, so a long grid can
be measured in several invocations; the "measured" column says when each row was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from snapmla_jax import cli
from snapmla_jax.bench import flashmla as flashmla_lib
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
# (~50-100 us) stay within ~1% of it (samples of 10 calls of 0.24 ms charge the FP8 path at
# B=32 x 16k x 128 ~5 us a call for a sample's first host gap).
MIN_SAMPLE_MS = 10.0
# FP8 cache bytes a chain of layers reads at least (``chain_layers``): 5x an H100's or
# H200's 50 MB L2, so that no layer's pages are still cached when the chain comes back.
CHAIN_BYTES = 256 << 20
MAX_CHAIN = 256
# Calls a timed sample's executable runs at least, unrolled as a model's layers are
# (``decode_chain``; FlashMLA's CUDA graph replays as many): a call alone in its executable
# also pays the gap between two executables on the stream, which a model's decode step, all its
# layers in one jit, does not. Chains of more layers run groups of this many calls in a loop.
MIN_CHAIN_CALLS = 8
FP8_BYTES_PER_TOKEN = RANK + 4 + 2 * ROPE


def chain_layers(batch: int, context: int) -> int:
    """Layers a timed sample chains for a B x context problem: enough that their fp8 caches
    hold CHAIN_BYTES (1 from B x context = 400k tokens up), at most MAX_CHAIN and within
    the kernels' int32 row indices; above MIN_CHAIN_CALLS a multiple of it (``decode_chain``'s
    groups)."""
    tokens = batch * context
    layers = min(MAX_CHAIN, max(1, -(-CHAIN_BYTES // (tokens * FP8_BYTES_PER_TOKEN))))
    if layers > MIN_CHAIN_CALLS:
        layers = min(MAX_CHAIN, -(-layers // MIN_CHAIN_CALLS) * MIN_CHAIN_CALLS)
    while layers > 1 and not kernel_addressable(layers * tokens):
        layers -= MIN_CHAIN_CALLS if layers > MIN_CHAIN_CALLS else 1
    return layers


def chain_calls(layers: int) -> int:
    """Calls ``decode_chain`` makes over ``layers`` layers: each layer once, and at least
    MIN_CHAIN_CALLS, coming back to layer 0 after the last (the layers read CHAIN_BYTES between
    two visits of one layer, so none is still in the L2)."""
    return max(layers, MIN_CHAIN_CALLS)


def decode_chain(softmax_scale: float, layers: int, backend: str = "auto", num_splits=None, query_terms: int = 1):
    """jit of ``chain_calls(layers)`` mla_decode calls (``backend``, ``num_splits``, ``query_terms``), call i over
    layer i mod ``layers`` of the cache (no layer axis when ``layers`` is 1), each call's output
    the next call's query: (q, q_rope, cache, block_table, seq_lens) -> out [B, s_q, H, 512].

    Up to MIN_CHAIN_CALLS layers the calls are unrolled with static layers, as a model's decode
    step runs its layers; more layers (small problems) run groups of MIN_CHAIN_CALLS unrolled
    calls in a loop over a traced layer, so that the compiled program stays small."""
    def one(q, q_rope, cache, block_table, seq_lens, layer):
        return mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=softmax_scale, layer=layer,
                          backend=backend, num_splits=num_splits, query_terms=query_terms)

    if layers <= MIN_CHAIN_CALLS:
        def unrolled(q, *rest):
            for call in range(chain_calls(layers)):
                q = one(q, *rest, None if layers == 1 else call % layers)
            return q
        return jax.jit(unrolled)
    if layers % MIN_CHAIN_CALLS:
        raise ValueError(f"layers: expected at most {MIN_CHAIN_CALLS} or a multiple of it, got {layers}")

    def group(index, q, rest):
        for call in range(MIN_CHAIN_CALLS):
            q = one(q, *rest, index * MIN_CHAIN_CALLS + call)
        return q
    return jax.jit(lambda q, *rest: jax.lax.fori_loop(0, layers // MIN_CHAIN_CALLS,
                                                      lambda index, x: group(index, x, rest), q))


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
METHODS = {"fp8": (FP8_BYTES_PER_TOKEN, True), "bf16": (BF16_BYTES_PER_TOKEN, False),
           "xla_bf16": (BF16_BYTES_PER_TOKEN, False), "flashmla": (BF16_BYTES_PER_TOKEN, False),
           "fp8_q2": (FP8_BYTES_PER_TOKEN, True)}
# What ``--methods`` selects from (JAX's stock kernel is "stock_mqa"); all but "fp8_q2" (the FP8
# cache with ``mla_decode(query_terms=2)``, an option) are timed unless told.
METHOD_NAMES = (*METHODS, "stock_mqa")
DEFAULT_METHODS = tuple(m for m in METHOD_NAMES if m != "fp8_q2")


def method_work(method: str, batch: int, context: int, heads: int, s_q: int) -> tuple[int, int, int]:
    """(bytes, FP8 FLOPs, BF16 FLOPs) of one decode call of ``method`` (``METHODS``): the cache
    read plus the queries and outputs in bf16; Q.K over 512 + 64 features (twice over the 512 with
    two query terms) and P.V over 512."""
    per_token, fp8 = METHODS[method]
    nbytes = batch * context * per_token + batch * s_q * heads * (RANK + ROPE + RANK) * 2
    flops = 2 * batch * s_q * heads * context * (RANK + ROPE + RANK + (RANK if method == "fp8_q2" else 0))
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
                   rounds: int | None = None, methods: tuple[str, ...] = DEFAULT_METHODS,
                   flashmla: flashmla_lib.FlashMLA | None = None):
    """One row: every method of ``methods`` (``DEFAULT_METHODS`` unless told) timed side by side on these
    caches; FlashMLA too where ``flashmla`` is given and "flashmla" is among ``methods``."""
    fp8, bf16, block_table = caches
    layers = fp8.num_layers or 1
    q, q_rope, seq_lens, scale = make_queries(batch, context, heads, s_q)
    # The cache is an argument of the jitted step (as in a serving loop), not a
    # closed-over constant that XLA would have to embed.
    run = lambda backend, **kwargs: decode_chain(scale, layers, backend, **kwargs)
    row = dict(batch=batch, context=context, heads=heads, s_q=s_q, layers=layers, calls=chain_calls(layers),
               measured_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    plans = {"fp8": (fp8, "pallas"), "bf16": (bf16, "pallas"), "xla_bf16": (bf16, "xla"), "fp8_q2": (fp8, "pallas")}
    # The XLA path gathers the pages (a bf16 copy) and keeps fp32 scores and weights.
    xla_bytes = batch * context * bf16.nbytes_per_token + 3 * batch * s_q * heads * context * 4
    runs = {}
    for name, (cache, backend) in plans.items():
        if name not in methods:
            continue
        assert cache.nbytes_per_token == METHODS[name][0], (name, cache.nbytes_per_token)
        if name == "xla_bf16" and xla_bytes > MEMORY_FRACTION * memory / 2:
            row[f"{name}_ms"] = None
            row[f"{name}_note"] = "skipped: does not fit memory"
            continue
        runs[name] = (run(backend, **({"query_terms": 2} if name == "fp8_q2" else {})),
                      [(q, q_rope, cache, block_table, seq_lens)])
    flash_run = None
    if flashmla is not None and "flashmla" in methods:
        try:
            flash_run = flashmla_lib.FlashMLARun(flashmla, q, q_rope, bf16, block_table, seq_lens, scale,
                                                 calls=chain_calls(layers))
            runs["flashmla"] = (flash_run.run, [()])
            if "bf16" in runs:
                twin = jax.jit(lambda *args: mla_decode(*args, softmax_scale=scale, layer=None if layers == 1 else 0,
                                                        backend="pallas"))
                row["flashmla_agreement"] = flashmla_agreement(flash_run, twin, runs["bf16"][1][0])
        except Exception as err:  # reported in the row; our methods are still timed
            row["flashmla_ms"] = None
            row["flashmla_note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    if "stock_mqa" in methods and stock_reason is None:
        stock_fn, stock_args = stock_mqa(q, q_rope, first_layer(bf16), block_table, seq_lens, scale)
        runs["stock_mqa"] = (stock_fn, [stock_args])
    elif "stock_mqa" in methods:
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
        ms = result / chain_calls(layers)
        nbytes, f8, f16 = method_work(name, batch, context, heads, s_q)
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = nbytes / (ms * 1e-3) / 1e9
        row[f"{name}_tflops"] = (f8 + f16) / (ms * 1e-3) / 1e12
        row[f"{name}_roofline"] = roofline_ms(nbytes, f8, f16, ceilings) / ms
    for num, den, key in (("bf16", "fp8", "fp8_over_bf16"), ("xla_bf16", "fp8", "fp8_over_xla"),
                          ("flashmla", "fp8", "flashmla_over_fp8"),
                          ("flashmla", "bf16", "flashmla_over_bf16"), ("fp8_q2", "fp8", "fp8_q2_over_fp8")):
        if row.get(f"{num}_ms") and row.get(f"{den}_ms"):
            row[key] = row[f"{num}_ms"] / row[f"{den}_ms"]
    del flash_run
    return row


def flashmla_agreement(flash_run, bf16_fn, bf16_args: tuple) -> dict:
    """How far our BF16 twin's output (``bf16_fn(*bf16_args)``, one layer) is from FlashMLA's on
    the same inputs (both bf16 products with float32 accumulation: ~1e-2 of the largest output
    at most), a check that the two columns time the same problem: max |ours - FlashMLA| /
    max |FlashMLA| and 1 - cosine."""
    import numpy as np

    ref = np.asarray(flash_run.first_layer_output().cpu())
    ours = np.asarray(bf16_fn(*bf16_args), np.float32)
    cosine = float(np.sum(ours * ref) / (np.linalg.norm(ours) * np.linalg.norm(ref)))
    return {"rel_to_max": float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref))), "cos_diff": 1.0 - cosine}


def shape_key(row: dict) -> tuple[int, int, int, int]:
    return row["batch"], row["context"], row["heads"], row["s_q"]


# Columns of the markdown table: (header, row key, format); a column whose key no row has is left out.
COLUMNS = [
    ("FP8 ms", "fp8_ms", "ms"), ("FP8 2-term query ms", "fp8_q2_ms", "ms"), ("FlashMLA ms", "flashmla_ms", "ms"),
    ("BF16 ms", "bf16_ms", "ms"), ("FP8 2-term / FP8", "fp8_q2_over_fp8", "x"),
    ("XLA bf16 ms", "xla_bf16_ms", "ms"), ("FlashMLA/FP8", "flashmla_over_fp8", "x"),
    ("FlashMLA/BF16", "flashmla_over_bf16", "x"), ("FP8/BF16", "fp8_over_bf16", "x"), ("FP8/XLA", "fp8_over_xla", "x"),
    ("FP8 GB/s", "fp8_gbps", "int"), ("FP8 TFLOP/s", "fp8_tflops", "int"), ("FP8 % roof", "fp8_roofline", "%"),
    ("FlashMLA % roof", "flashmla_roofline", "%"), ("BF16 % roof", "bf16_roofline", "%"),
    ("XLA % roof", "xla_bf16_roofline", "%"),
]
FORMATS = {"ms": "{:.3g}", "x": "{:.2f}x", "int": "{:.0f}"}
# Methods whose time over batch sizes ``smoothness`` reports.
SMOOTH_METHODS = ("fp8", "flashmla", "bf16")


def cell(value, kind: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if kind == "%" else FORMATS[kind].format(value)


def smoothness(rows: list[dict]) -> list[dict]:
    """Per (context, H, s_q) measured at three or more batch sizes, and per method: the largest
    ratio of a row's time to the line through the smallest and the largest batch's times, and
    the batch where it falls. 1.0 is a time linear in B; a cliff past a wave of CTAs shows as
    ~2 just past it."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["context"], row["heads"], row["s_q"]), []).append(row)
    result = []
    for (context, heads, s_q), members in sorted(groups.items()):
        for method in SMOOTH_METHODS:
            timed = sorted((r["batch"], r[f"{method}_ms"]) for r in members if r.get(f"{method}_ms"))
            if len(timed) < 3:
                continue
            (b0, t0), (b1, t1) = timed[0], timed[-1]
            line = lambda b: t0 + (t1 - t0) * (b - b0) / (b1 - b0)
            worst = max(timed, key=lambda bt: bt[1] / line(bt[0]))
            result.append(dict(context=context, heads=heads, s_q=s_q, method=method, batches=len(timed),
                               worst_batch=worst[0], worst_ratio=worst[1] / line(worst[0])))
    return result


def to_markdown(env: dict, ceilings: dict, rows: list[dict], stock_reason: str | None, command: str,
                merged: bool = False, flashmla_name: str | None = None,
                skipped: tuple[tuple[str, str], ...] = ()) -> str:
    """The page: how the rows were measured, their table and the time-over-batch summary.
    ``skipped``: (shape, why) of shapes asked for that have no row (e.g. past the kernels' int32
    offsets)."""
    timed = lambda method: any(r.get(f"{method}_ms") is not None for r in rows)
    columns = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
    runs = ceiling_runs(rows)
    label = {id(row): name for name, run, members in runs if run["ceilings"] for row in members}
    body = [[r["batch"], r["context"], r["heads"], r["s_q"], r.get("layers", "-"), r.get("calls", r.get("layers", "-")),
             *(cell(r.get(key), kind) for _, key, kind in columns), label.get(id(r), "-"),
             r.get("measured_utc", "-")] for r in rows]
    stamps = lambda members: sorted(m["measured_utc"] for m in members if m.get("measured_utc"))
    legend = [f"- {name}: {run['device']}, copy {run['ceilings']['copy_gbps']:.0f} GB/s, BF16 GEMM "
              f"{run['ceilings']['bf16_tflops']:.0f} TFLOP/s, FP8 GEMM {run['ceilings']['fp8_tflops']:.0f} TFLOP/s"
              + (f" (rows measured {stamps(members)[0]} to {stamps(members)[-1]} UTC)" if stamps(members) else "")
              for name, run, members in runs if run["ceilings"]]
    notes = sorted({f"{k[:-5]}: {r[k]}" for r in rows for k in r if k.endswith("_note") and k != "stock_mqa_note"})
    agreement = [r["flashmla_agreement"]["rel_to_max"] for r in rows if r.get("flashmla_agreement")]
    lines = [
        "# MLA decode benchmark",
        "",
        f"Device: {env['device']}, jax {env['jax']}, Python {env['python']}, date {env['date']}.",
        f"Regenerate: `{command}`.",
        f"Ceilings measured in this run: copy {ceilings['copy_gbps']:.0f} GB/s, "
        f"BF16 GEMM {ceilings['bf16_tflops']:.0f} TFLOP/s, FP8 GEMM {ceilings['fp8_tflops']:.0f} TFLOP/s.",
        *(["Rows kept from earlier invocations (--merge) were measured with the code of their time (the",
           "\"measured\" column)."] if merged else []),
        "Each row's % roof is against the ceilings its own run measured (column \"ceil\"):",
        *legend,
        "",
        "One decode call over one layer, page_size 64, all rows at the full context; times are medians of",
        f"samples of at least {MIN_SAMPLE_MS:g} ms, every method sampled once a round in a shuffled order.",
        "layers: the cache's layers a timed sample reads (>= 256 MiB of fp8 cache in all, 5x the L2);",
        "calls: decode calls it chains in one jit" + (" (FlashMLA: in one CUDA graph)" if flashmla_name else "")
        + ", call i over layer i mod layers,",
        f"unrolled as a model's layers (loops of {MIN_CHAIN_CALLS} above {MIN_CHAIN_CALLS} layers); "
        "ms = the chain's time / calls.",
        "FP8 = `mla_decode` on the fp8 cache (644 B/token) with its default kernel and split plan. BF16 = the",
        "same on the bf16 cache (1152 B/token): our BF16 twin.",
        *(["XLA bf16 = `mla_decode(..., backend=\"xla\")` on the bf16 cache."] if timed("xla_bf16") else []),
        *(["FP8 2-term query = the same with `query_terms=2` (the query as two FP8 terms, the 16-row kernel)."]
          if timed("fp8_q2") else []),
        *([f"FlashMLA = {flashmla_name}: FlashMLA's dense BF16 decode on the bf16 cache's contents (576 bf16 a",
           "token), same process, its calls replayed from one CUDA graph; FlashMLA/FP8 = its time / ours",
           "(> 1: ours faster). Its layer-0 output against our BF16 twin's: max |diff| / max |FlashMLA| "
           f"<= {max(agreement):.3g}." if agreement else ""] if flashmla_name else []),
        *(["JAX stock `pallas.ops.gpu.decode_attention.mqa` (the 576-dim [latent, rope] as K and V): "
           + ("runs (times in the JSON beside this page)." if stock_reason is None else f"does not run: {stock_reason}.")]
          if any("stock_mqa_ms" in r for r in rows) else []),
        *(f"Not run ({reason}): {', '.join(shape for shape, why in skipped if why == reason)}."
          for reason in dict.fromkeys(why for _, why in skipped)),
        "",
        timing.markdown_table(["B", "ctx", "H", "s_q", "layers", "calls", *(c[0] for c in columns), "ceil", "measured (UTC)"],
                              body),
    ]
    smooth = smoothness(rows)
    if smooth:
        lines += ["", "Time over batch size: the largest ratio of a row's time to the line through the smallest",
                  "and the largest batch's (1.00: linear in B).", "",
                  timing.markdown_table(["ctx", "H", "s_q", "method", "batches", "worst B", "time / line"],
                                        [[g["context"], g["heads"], g["s_q"], g["method"], g["batches"],
                                          g["worst_batch"], f"{g['worst_ratio']:.2f}"] for g in smooth])]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# The options that choose what an invocation measures (value count, "*": any), and --merge.
GRID_OPTIONS = {"--shapes": "*", "--batches": "*", "--contexts": "*", "--heads": "*", "--s-q": "*", "--preset": 1,
                "--quick": 0, "--merge": 0}


def full_page_argv(argv: list[str], shapes: list[tuple[int, int, int, int]]) -> list[str]:
    """The arguments of one invocation that measures every row of a merged page: ``argv``
    without the options that choose its shapes and without --merge, --shapes ``shapes`` first
    (a page merged over several runs names the command that regenerates all of it)."""
    kept, i = [], 0
    while i < len(argv):
        name, inline = argv[i].partition("=")[::2]
        i += 1
        if name not in GRID_OPTIONS:
            kept.append(argv[i - 1])
        elif not inline and GRID_OPTIONS[name] == 1:
            i += 1
        elif not inline and GRID_OPTIONS[name] == "*":
            while i < len(argv) and not argv[i].startswith("-"):
                i += 1
    return ["--shapes", *("x".join(map(str, shape)) for shape in shapes), *kept]


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """"BxCTXxHxSQ" -> (batch, context, heads, s_q), all positive."""
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected BxCTXxHxSQ of positive ints (e.g. 64x16384x128x1), got {text!r}")
    return shape


# Against FlashMLA: the rows users compare on (H = 128 at s_q 1 and 2, H = 16), and batch sweeps
# at one context each (H = 128 x 16k, H = 16 x 32k) past the multiples of a wave of CTAs.
SWEEP_BATCHES = (1, 8, 32, 40, 64, 66, 67, 72, 100, 128, 132, 140, 200, 256)
VS_FLASHMLA = [*((b, 16384, 128, 1) for b in SWEEP_BATCHES), (32, 65536, 128, 1), (1, 65536, 128, 1),
               (128, 4096, 128, 1), (32, 16384, 128, 2), (64, 16384, 128, 2), (128, 16384, 128, 2),
               *((b, 32768, 16, 1) for b in SWEEP_BATCHES), (64, 16384, 16, 1), (128, 16384, 16, 1)]
PRESETS = {"vs-flashmla": ("the rows compared with FlashMLA and batch sweeps at 16k x 128 and 32k x 16 heads",
                           VS_FLASHMLA)}


def file_stem(text: str) -> str:
    """A file name without a directory: letters, digits, '.', '_' and '-'."""
    if not text or not all(c.isalnum() or c in "._-" for c in text) or text.startswith("."):
        raise argparse.ArgumentTypeError(f"expected a file name of letters, digits, '.', '_' and '-', got {text!r}")
    return text


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
    parser.add_argument("--shapes", nargs="*", type=parse_shape, metavar="BxCTXxHxSQ",
                        help="explicit shapes instead of the grid, e.g. 64x16384x128x1 (batch, context, heads, s_q)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a named list of shapes: " + "; ".join(f"{k}: {v[0]}" for k, v in PRESETS.items()))
    parser.add_argument("--methods", nargs="*", choices=METHOD_NAMES, default=list(DEFAULT_METHODS),
                        help="methods to time (default: all); flashmla needs --flashmla to find "
                             "FlashMLA")
    parser.add_argument("--flashmla", default="auto",
                        help="FlashMLA to time beside ours: 'auto' (the flash_mla package if importable), 'none', "
                             "or the path of an extension .so with FlashMLA's dense_decode_fwd")
    parser.add_argument("--flashmla-label", default=None,
                        help="what the page calls the FlashMLA it timed (e.g. its commit); default: its module")
    parser.add_argument("--name", default="decode", type=file_stem,
                        help="the results' file names, NAME.json and NAME.md (default: decode)")
    parser.add_argument("--merge", action="store_true", help="keep earlier rows of shapes not measured now")
    args = parser.parse_args(argv)
    out = cli.bench_output_dir(args)
    try:
        flashmla_lib.check_spec(args.flashmla)  # before the GPU check: a typo is reported anywhere
        if timing.missing_gpu("decode benchmark"):
            return 2
        flashmla = flashmla_lib.load(args.flashmla) if "flashmla" in args.methods else None
    except ValueError as err:
        raise cli.UsageError(str(err)) from None
    shapes = args.shapes or (PRESETS[args.preset][1] if args.preset else None)
    grid = dict(QUICK if args.quick else FULL)
    for key in grid:
        if getattr(args, key):
            grid[key] = tuple(getattr(args, key))
    if shapes is None:
        shapes = [(b, c, h, s) for b in grid["batches"] for c in grid["contexts"] for h in grid["heads"]
                  for s in grid["s_qs"]]
    given = list(argv if argv is not None else sys.argv[1:])
    command = shlex.join(["python", "-m", "snapmla_jax.bench", "decode", *given])
    print(f"FlashMLA: {flashmla.name if flashmla else 'absent'}", flush=True)
    env = timing.environment()
    ceilings = timing.measure_ceilings()
    memory = _device_memory()
    print(f"{env}\n{ceilings}", flush=True)
    rows, stock_reason, skipped = [], None, []
    earlier, earlier_ceilings = [], None
    if args.merge and (out / f"{args.name}.json").exists():
        saved = json.loads((out / f"{args.name}.json").read_text())
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
        page_command = command if not kept else shlex.join(
            ["python", "-m", "snapmla_jax.bench", "decode", *full_page_argv(given, [shape_key(r) for r in merged])])
        markdown = to_markdown(env, ceil, merged, stock_reason, page_command, merged=bool(kept),
                               flashmla_name=(args.flashmla_label or flashmla.name) if flashmla else None,
                               skipped=tuple(skipped))
        timing.write_results(out, args.name, {**env, "ceilings": ceil, "stock_mqa": stock_reason or "runs"}, merged,
                             markdown)
        return markdown

    stock_probed = "stock_mqa" not in args.methods
    # Shapes sharing (batch, context) share their caches.
    by_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for batch, context, heads, s_q in shapes:
        by_cache.setdefault((batch, context), []).append((heads, s_q))
    for (batch, context), head_shapes in by_cache.items():
        cache_bytes = batch * context * (644 + 1152)
        if not kernel_addressable(batch * context):
            skipped.append((f"B={batch} x {context}", INT32_LIMIT))
            print("skip {}: {}".format(*skipped[-1]), flush=True)
            continue
        if cache_bytes > MEMORY_FRACTION * memory:
            skipped.append((f"B={batch} x {context}", f"caches over {MEMORY_FRACTION:.0%} of the device memory"))
            print("skip {}: {}".format(*skipped[-1]), flush=True)
            continue
        caches = make_caches(batch, context, layers=chain_layers(batch, context))
        if not stock_probed:
            q = jnp.ones((batch, 1, head_shapes[0][0], RANK), jnp.bfloat16)
            stock_reason = _probe_stock(q, q[..., :ROPE], first_layer(caches[1]), caches[2],
                                        jnp.full((batch,), context, jnp.int32), 0.04)
            stock_probed = True
            print(f"stock mqa: {stock_reason or 'runs'}", flush=True)
        for heads, s_q in head_shapes:
            try:
                row = measure_config(batch, context, heads, s_q, caches, ceilings, args.iters, stock_reason,
                                     memory, rounds=args.rounds, methods=tuple(args.methods), flashmla=flashmla)
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
