"""``python -m snapmla_jax.bench capacity``: decode throughput at capacity, FP8 against BF16 cache.

What SnapMLA's headline measures: a cache half the size holds more rows, and a serving batch is
as large as the cache allows. For a model shape (``--model``: DeepSeek-V2-Lite, V2 or V3 shapes,
random bf16 weights drawn on the devices, the routed experts split over them and the rest
replicated; ``--fp8-weights``: the linear kernels and routed experts made block-FP8 directly, as
DeepSeek-V2 on 4 x H100 needs) on ``--devices N`` (data-parallel attention with expert parallelism,
``snapmla_jax.data_parallel``; 1: one device), and for each ``--contexts`` length:

* the largest batch per device whose caches fit beside that device's weights (its free memory,
  measured once the weights are placed, less ``--reserve-gib`` for activations and XLA's
  workspace) and within the kernels' int32 row indices (one layer's cache array on a device at
  most 2**31 - 1 token slots), for the FP8 and for the BF16 cache;
* ``generate``'s compiled decode loop at that batch (every row holding ``context`` tokens; the
  caches filled with constant values instead of a prefill: the kernels' time does not depend on
  them): tokens/s, and FP8 / BF16, the throughput ratio at capacity.

``--sorted-moe-tokens N`` runs the MoE's sorted dispatch from N gathered tokens on instead of the
library's default (0: never, dense instead; to compare the two). ``--caches`` runs only the
cache dtypes named. ``--batch-per-device B`` times that batch instead of the largest (the
same per-device batch on 1 and N devices gives the scaling). The device memory the run may use
is XLA's (``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75 of the GPU); the table records it.
``--profile`` traces one more call a row and adds where a step's GPU time goes (``step_breakdown``:
attention, collectives, the rest). ``--tiny`` runs a 2-layer model anywhere (with
``--batch-per-device``: a CPU reports no memory).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax import cli, data_parallel, models
from snapmla_jax.backend import BACKENDS
from snapmla_jax.bench import e2e, timing
from snapmla_jax.cache import MAX_TOKEN_SLOTS
from snapmla_jax.capacity import CACHE_DTYPES, MODEL_SHAPES, RESERVE_GIB, row_bytes
from snapmla_jax.generate import DecodeState, decode_chunk
from snapmla_jax.paging import allocate_pages
from snapmla_jax.sampling import SamplingConfig

PAGE_SIZE = 64
GIB = 2**30
MODEL_NAMES = {"v2-lite": "DeepSeek-V2-Lite", "v2": "DeepSeek-V2", "v3": "DeepSeek-V3"}


def decode_steps(steps: int, iters: int, profile: bool) -> int:
    """Tokens a row gains over a measurement: the first decoded token, the warm-up call's and the
    timed calls' ``steps`` each, and the profiled call's with ``profile``."""
    return 1 + (iters + 1 + profile) * steps


def rows_that_fit(cfg, free_bytes: int | None, context: int, total_steps: int, kv_cache: str) -> tuple[int, str]:
    """(rows of ``context`` + ``total_steps`` tokens one device holds the caches of, what limits
    it: "memory" or "int32 rows"). ``free_bytes`` None: memory unknown, rows only. The rows one
    layer's cache array may hold are what the kernels' int32 row indices address
    (``snapmla_jax.cache.MAX_TOKEN_SLOTS``: 2**31 - 1 tokens)."""
    pages = -(-(context + total_steps) // PAGE_SIZE)
    by_rows = MAX_TOKEN_SLOTS // (pages * PAGE_SIZE)
    if free_bytes is None:
        return by_rows, "int32 rows"
    by_memory = max(0, free_bytes // row_bytes(cfg, context + total_steps, kv_cache))
    return (by_memory, "memory") if by_memory <= by_rows else (by_rows, "int32 rows")


def free_bytes_per_device(devices) -> int | None:
    """The least free memory (bytes_limit - bytes_in_use) over ``devices``; None when one reports none."""
    free = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free)


# Kernel names (prefixes) of the attention's launches: the decode kernels, their inputs launch and
# split plan, the merge of split partials and the cache write.
ATTENTION_KERNELS = ("snapmla_decode", "snapmla_mgpu_", "snapmla_combine", "snapmla_split_plan", "snapmla_write_kv")


def step_breakdown(events, steps: int, devices: int) -> dict[str, float]:
    """GPU time in ms a decode step and a device, from a profiler trace's ``events``
    (``timing.traced_events``) of ``steps`` steps on ``devices`` devices: "attention" (the
    ``ATTENTION_KERNELS``), "collectives" (NCCL's kernels: the MoE's all_gather and psum_scatter),
    "other" (everything else: projections, experts, norms, sampling) and their sum "busy"."""
    parts = dict.fromkeys(("attention", "collectives", "other"), 0.0)
    for event in events:
        part = ("collectives" if event.name.lower().startswith("nccl")
                else "attention" if event.name.startswith(ATTENTION_KERNELS) else "other")
        parts[part] += event.duration_ns / 1e6 / (steps * devices)
    return {**parts, "busy": sum(parts.values())}


def decode_tokens_per_s(model, mesh, per_device: int, context: int, kv_cache: str, *, steps: int, iters: int,
                        backend: str, profile: bool = False) -> dict:
    """Time ``generate``'s decode loop for ``per_device`` rows a device of ``context`` cached tokens;
    with ``profile`` also trace one more call (``step_breakdown``: "profile_ms")."""
    devices = 1 if mesh is None else mesh.size
    batch = per_device * devices
    total_steps = decode_steps(steps, iters, profile)
    pages = allocate_pages([context] * batch, total_steps, page_size=PAGE_SIZE, groups=devices)
    put = jnp.asarray if mesh is None else (lambda x: jax.device_put(x, data_parallel.rows_sharding(mesh)))
    graphdef, params = nnx.split(model)
    caches = e2e.filled_caches(model.cfg, pages.num_pages, kv_cache, mesh)
    state = {"s": DecodeState(caches=caches, tokens=put(np.ones((batch, total_steps), np.int32)),
                              step=jnp.asarray(1, jnp.int32), finished=put(np.zeros(batch, bool)))}
    del caches
    lengths, table, key = put(np.full(batch, context, np.int32)), put(pages.block_table), jax.random.key(0)

    def call():
        start = int(state["s"].step)
        state["s"] = decode_chunk(params, state["s"], lengths, table, key, jnp.asarray(start + steps, jnp.int32),
                                  graphdef=graphdef, sampling=SamplingConfig(), eos_id=None, backend=backend,
                                  mesh=mesh)
        # The loop stops where the tokens array ends: a call past it would time no steps at all.
        if int(state["s"].step) != start + steps:
            raise RuntimeError(f"decoded {int(state['s'].step) - start} of {steps} steps: the rows hold "
                               f"{total_steps} tokens")

    step_ms = e2e.timed_calls(call, iters) / steps * 1e3  # the first call compiles and warms up
    result = dict(step_ms=step_ms, tokens_per_s=batch / step_ms * 1e3, batch=batch)
    if profile:
        result["profile_ms"] = step_breakdown(timing.traced_events(call), steps, devices)
    state.clear()
    gc.collect()
    return result


def markdown(env: dict, rows: list[dict]) -> str:
    memory = env["xla_mem_fraction"]
    lines = ["# Decode throughput at capacity, FP8 against BF16 cache\n",
             f"{env['model']} ({env['params_b']:.1f}B parameters, random {env.get('weights', 'bf16')} weights, "
             f"{env['weights_gib']:.1f} GiB "
             f"a device) on " + (f"one {env['device']}" if env["devices"] == 1 else
                                 f"{env['devices']} x {env['device']}, data-parallel attention with the routed experts "
                                 f"split over the devices") + f"; jax {env['jax']}, {env['date']}. Device memory: "
             f"{f'XLA_PYTHON_CLIENT_MEM_FRACTION={memory}' if memory else 'XLA default 75%'} of each GPU, "
             f"{env['reserve_gib']:g} GiB of it kept for activations. "
             + (f"The MoE's sorted dispatch from {env['sorted_moe_tokens']} gathered tokens on. "
                if env.get("sorted_moe_tokens") else "The MoE's sorted dispatch off (dense). ")
             + "Each row: `generate`'s decode loop "
             f"({env['steps']} steps a timed call, median of {env['iters']}), every row of the batch holding the "
             f"context. Produced by `{env['command']}`.\n",
             "| context | cache | rows a device | limited by | batch | step ms | tokens/s | FP8 / BF16 |",
             "|---|---|---|---|---|---|---|---|"]
    by_context = {}
    for row in rows:
        by_context.setdefault(row["context"], {})[row["kv_cache"]] = row
    for context, cells in by_context.items():
        for kind, row in cells.items():
            ratio = ""
            if kind == "fp8" and "bf16" in cells and row.get("tokens_per_s") and cells["bf16"].get("tokens_per_s"):
                ratio = f"{row['tokens_per_s'] / cells['bf16']['tokens_per_s']:.2f}x"
            if row.get("tokens_per_s"):
                lines.append(f"| {context} | {kind} | {row['per_device']} | {row['limit']} | {row['batch']} | "
                             f"{row['step_ms']:.2f} | {row['tokens_per_s']:.0f} | {ratio} |")
            else:
                lines.append(f"| {context} | {kind} | {row['per_device']} | {row['limit']} | - | - | "
                             f"{row['status']} | |")
    profiled = [row for row in rows if row.get("profile_ms")]
    if profiled:
        lines += ["\nGPU time a decode step and a device, ms, from one profiler trace of a call a row (kernel "
                  "durations summed; gaps between launches not counted): attention = the decode kernels, their "
                  "inputs launch, the merge and the cache write; collectives = NCCL (the experts' all_gather and "
                  "psum_scatter); other = the rest (projections, experts, norms, sampling).\n",
                  "| context | cache | attention | collectives | other | busy | collectives / busy |",
                  "|---|---|---|---|---|---|---|"]
        for row in profiled:
            p = row["profile_ms"]
            share = f"{p['collectives'] / p['busy']:.1%}" if p["busy"] else "-"
            lines.append(f"| {row['context']} | {row['kv_cache']} | {p['attention']:.2f} | {p['collectives']:.2f} | "
                         f"{p['other']:.2f} | {p['busy']:.2f} | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The benchmark; raises cli.UsageError for bad flags (exit code 2), exit code 2 without a CUDA
    GPU unless ``--tiny``."""
    parser = cli.Parser(prog="python -m snapmla_jax.bench capacity", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="v2-lite", help="model shape (default v2-lite)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on any backend (a CPU test of the plumbing)")
    parser.add_argument("--devices", type=int, default=1, help="devices to serve over (default 1)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768], help="tokens a row holds (default 32768)")
    parser.add_argument("--batch-per-device", type=int, default=None,
                        help="time this many rows a device instead of the most that fit")
    parser.add_argument("--reserve-gib", type=float, default=RESERVE_GIB,
                        help=f"GiB a device keeps free of caches, for activations and XLA (default {RESERVE_GIB:g})")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call (default 8)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per measurement (default 3)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="write_kv/mla_decode backend (default auto)")
    parser.add_argument("--profile", action="store_true",
                        help="trace one more call a row: GPU ms a step and a device in attention, collectives, other")
    parser.add_argument("--sorted-moe-tokens", type=int, default=None, metavar="N",
                        help="run the MoE's sorted dispatch from N gathered tokens on, 0: never "
                             "(models.moe.set_sorted_min_tokens; default: the library's, "
                             "models.moe.default_sorted_min_tokens, block-FP8 experts' with --fp8-weights)")
    parser.add_argument("--caches", choices=CACHE_DTYPES, nargs="+", default=list(CACHE_DTYPES),
                        help="cache dtypes to run (default: %(default)s)")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="make the linear kernels and routed experts block-FP8 (never held in bf16)")
    cli.add_bench_output_flags(parser, "capacity.json / capacity.md")
    args = parser.parse_args(argv)
    cli.check_positive(args, "devices", "steps", "iters")
    if any(c < 1 for c in args.contexts):
        raise cli.UsageError(f"--contexts: expected ints >= 1, got {' '.join(map(str, args.contexts))}")
    if args.batch_per_device is not None and args.batch_per_device < 1:
        raise cli.UsageError(f"--batch-per-device: expected an int >= 1, got {args.batch_per_device}")
    if args.sorted_moe_tokens is not None and args.sorted_moe_tokens < 0:
        raise cli.UsageError(f"--sorted-moe-tokens: expected an int >= 0 (0: never), got {args.sorted_moe_tokens}")
    if not args.reserve_gib >= 0:
        raise cli.UsageError(f"--reserve-gib: expected a number >= 0, got {args.reserve_gib}")
    if args.devices > jax.device_count():
        raise cli.UsageError(f"--devices: expected 1 to {jax.device_count()} (the devices JAX sees), got {args.devices}")
    cfg = e2e.TINY if args.tiny else MODEL_SHAPES[args.model]
    if cfg.n_routed_experts and cfg.n_routed_experts % args.devices:
        raise cli.UsageError(f"--devices: expected a divisor of the model's {cfg.n_routed_experts} routed experts, "
                             f"got {args.devices}")
    cli.backend(args.backend)
    out = cli.bench_output_dir(args)
    if not args.tiny and timing.missing_gpu("capacity benchmark", "the model shapes need CUDA GPUs (use --tiny elsewhere)"):
        return 2
    mesh = data_parallel.mesh_of(args.devices) if args.devices > 1 else None
    model = e2e.random_model(cfg, jnp.bfloat16, mesh=mesh, fp8_weights=args.fp8_weights)
    # The MoE's sorted dispatch: the flag's (0: never), else the library's default for this shape.
    default_sorted = models.moe.default_sorted_min_tokens(cfg, fp8=args.fp8_weights)
    sorted_min_tokens = default_sorted if args.sorted_moe_tokens is None else args.sorted_moe_tokens or None
    if args.sorted_moe_tokens is not None:
        models.moe.set_sorted_min_tokens(model, sorted_min_tokens)
    devices = jax.devices()[:args.devices]
    free = free_bytes_per_device(devices)
    if free is None and args.batch_per_device is None:
        raise cli.UsageError("--batch-per-device: needed where the device reports no memory (a CPU)")
    budget = None if free is None else int(free - args.reserve_gib * GIB)
    state = nnx.state(model)
    weights = sum(s.data.nbytes for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards
                  if s.device == devices[0])
    env = timing.environment()
    env.update(model="tiny (2 layers)" if args.tiny else f"{MODEL_NAMES[args.model]} shapes", devices=args.devices,
               params_b=sum(x.size for x in jax.tree.leaves(state)) / 1e9, weights_gib=weights / GIB,
               reserve_gib=args.reserve_gib, xla_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
               steps=args.steps, iters=args.iters, backend=args.backend,
               weights="block-FP8" if args.fp8_weights else "bf16",
               sorted_moe_tokens=sorted_min_tokens,
               command=timing.command_text("python -m snapmla_jax.bench capacity",
                                           sys.argv[1:] if argv is None else argv))
    total_steps = decode_steps(args.steps, args.iters, args.profile)
    rows = []
    for context in args.contexts:
        for kind in (c for c in CACHE_DTYPES if c in args.caches):
            fit, limit = rows_that_fit(cfg, budget, context, total_steps, kind)
            per_device = args.batch_per_device or fit
            if args.batch_per_device is not None:
                limit = "given" if args.batch_per_device <= fit else f"given (over {limit}: {fit})"
            row = dict(context=context, kv_cache=kind, per_device=per_device, limit=limit, fits=fit)
            if per_device < 1 or per_device > fit:
                row["status"] = "does not fit"
            else:
                try:
                    row.update(decode_tokens_per_s(model, mesh, per_device, context, kind, steps=args.steps,
                                                   iters=args.iters, backend=args.backend, profile=args.profile),
                               status="ok")
                except Exception as err:  # one failing row must not lose the others
                    row["status"] = f"failed: {' '.join(str(err).split())[:120]}"
            print(row, flush=True)
            rows.append(row)
            timing.write_results(out, "capacity", env, rows, markdown(env, rows))
    print(f"wrote {out / 'capacity.json'} and {out / 'capacity.md'}")
    return 0
