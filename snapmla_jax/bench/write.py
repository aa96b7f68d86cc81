"""``python -m snapmla_jax.bench write``: the fused quantize + cache write kernel.

For T new tokens (bf16 latent [T, 512] and RoPE [T, 64]) scattered page by page
into a cache twice their size, time the write's backends side by side (all under
jit with the cache donated, so all update in place) and compare their bandwidth
with a device-to-device copy measured in the same run:

  pallas     the Mosaic GPU kernel (``pallas_kernels.write_kv``), at each ``--block-tokens``
  xla        the XLA scatter (``write_kv_reference``)
  interpret  the Mosaic kernel in Pallas' interpreter (CPU; for the plumbing, not for timings)

Bytes counted: inputs read once (latent, RoPE, slot ids), cache bytes written once.

Each timed call runs the write ``--repeat`` times in an on-device loop (the
cache carried through it), so that short writes are not hidden behind the
host's dispatch of one jitted call (~0.08 ms on the H100 machine). The backends'
samples are taken round-robin, one of each a round in a shuffled order; times are
medians.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax import cli
from snapmla_jax.bench.timing import environment, markdown_table, measure_copy_gbps, time_round_robin, write_results
from snapmla_jax.cache import LatentCache
from snapmla_jax.pallas_kernels.write_kv import WriteKVConfig, write_kv_pallas, write_kv_reference
from snapmla_jax.write import write_rows

PAGE_SIZE = 64


def _num_pages(num_tokens: int) -> int:
    """Pages of the benchmark's cache: twice those the tokens fill."""
    return 2 * -(-num_tokens // PAGE_SIZE)


def _inputs(num_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    latent = jnp.asarray(rng.standard_normal((num_tokens, 512)) * rng.uniform(0.1, 3, (num_tokens, 1)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((num_tokens, 64)) * 30, jnp.bfloat16)
    # Pages in random order, as a paged allocator hands them out, filled from their first slot.
    pages = rng.permutation(_num_pages(num_tokens))[: _num_pages(num_tokens) // 2]
    slots = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)[:num_tokens].astype(np.int32)
    return latent, rope, jnp.asarray(slots)


def _bytes_moved(num_tokens: int, cache: LatentCache) -> int:
    return num_tokens * (512 * 2 + 64 * 2 + 4 + cache.nbytes_per_token)


def _variants(backends, block_tokens) -> list[tuple[str, str, object]]:
    """(backend, config label, scatter) for each timed variant: the Mosaic kernel (compiled or
    interpreted) once per block size, the others once."""
    scatters = {"xla": write_kv_reference}
    out = []
    for backend in backends:
        if backend in scatters:
            out.append((backend, "", scatters[backend]))
            continue
        for bt in block_tokens:
            scatter = functools.partial(write_kv_pallas, interpret=backend == "interpret",
                                        config=WriteKVConfig(block_tokens=bt))
            out.append((backend, f"block_tokens={bt}", scatter))
    return out


def _repeated_write(scatter, repeat: int):
    """jit(cache, latent, rope, slots) -> cache that writes ``repeat`` times on the device, through
    ``write_kv``'s own wrapper (``write_rows``) with the given scatter."""

    def body(cache, latent, rope, slots):
        write = lambda c: write_rows(c, latent, rope, slots, None, scatter)
        return jax.lax.fori_loop(0, repeat, lambda _, c: write(c), cache)

    return jax.jit(body, donate_argnums=0)


def run(token_counts, iters: int, repeat: int, backends, copy_mib: int = 2048,
        block_tokens=(WriteKVConfig.block_tokens,)) -> tuple[dict, list[dict]]:
    env = environment()
    copy_gbps = measure_copy_gbps(copy_mib << 20)
    rows = []
    for num_tokens in token_counts:
        for dtype in ("fp8", "bf16"):
            # Every variant's samples taken round-robin (``time_round_robin``), so that a drift of
            # the GPU's clocks falls on all of them alike.
            runs = {}
            arg_sets = [_inputs(num_tokens, seed) for seed in range(2)]  # the same inputs for every variant
            for backend, config, scatter in _variants(backends, block_tokens):
                step = _repeated_write(scatter, repeat)
                state = {"cache": LatentCache.create(_num_pages(num_tokens), PAGE_SIZE, dtype=dtype)}

                def call(latent, rope, slots, step=step, state=state):
                    state["cache"] = step(state["cache"], latent, rope, slots)
                    return state["cache"]

                runs[(backend, config)] = (call, arg_sets)
            nbytes = _bytes_moved(num_tokens, state["cache"])  # the same for every variant of this cache dtype
            times = time_round_robin(runs, warmup=3, iters=iters, inner=1)
            for (backend, config), ms in times.items():
                if isinstance(ms, Exception):
                    raise ms
                ms /= repeat
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append(dict(tokens=num_tokens, cache=dtype, backend=backend, config=config, ms=ms, gbps=gbps,
                                 copy_fraction=gbps / copy_gbps))
    env["copy_gbps"] = copy_gbps
    env["repeat"] = repeat
    return env, rows


def main(argv: list[str] | None = None) -> int:
    """The benchmark; raises cli.UsageError for bad flags, or a compiled backend without a
    CUDA GPU (``python -m snapmla_jax.bench write`` prints it on one line, exit code 2)."""
    parser = cli.Parser(prog="python -m snapmla_jax.bench write", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536, 262144],
                        help="new tokens per write, e.g. 1 64 256 4096 65536 262144 (default 4096 65536 262144)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (default 20)")
    parser.add_argument("--repeat", type=int, default=20,
                        help="writes per timed call, looped on the device (default 20)")
    parser.add_argument("--backends", nargs="+", default=["pallas", "xla"],
                        choices=["pallas", "interpret", "xla"],
                        help="write backends to compare (default pallas xla; pallas needs a CUDA GPU)")
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[WriteKVConfig.block_tokens],
                        help="the Mosaic kernel's tokens a CTA, one timed variant each "
                             f"(default {WriteKVConfig.block_tokens}; multiples of 32)")
    parser.add_argument("--copy-mib", type=int, default=2048, help="size of the reference copy in MiB (default 2048)")
    cli.add_bench_output_flags(parser, "write.json / write.md")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        raise cli.UsageError(f"--tokens: expected positive ints, got {args.tokens}")
    for bt in args.block_tokens:
        try:
            WriteKVConfig(block_tokens=bt)
        except ValueError as err:
            raise cli.UsageError(f"--block-tokens: {err}") from None
    cli.check_positive(args, "iters", "repeat", "copy_mib")
    compiled = [b for b in args.backends if b == "pallas"]
    if compiled and jax.default_backend() != "gpu":
        raise cli.UsageError("--backends: pallas: compiled for a CUDA GPU, and none is "
                             "present; use --backends interpret xla on this machine")
    out = cli.bench_output_dir(args)
    env, rows = run(args.tokens, args.iters, args.repeat, args.backends, args.copy_mib, args.block_tokens)
    command = shlex.join(["python", "-m", "snapmla_jax.bench", "write",
                          *(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--publish")])
    table = markdown_table(
        ["tokens", "cache", "backend", "config", "median ms", "GB/s", "fraction of copy"],
        [[r["tokens"], r["cache"], r["backend"], r["config"], r["ms"], r["gbps"], r["copy_fraction"]] for r in rows])
    md = (f"# write_kv: fused quantize + paged cache write\n\n"
          f"Device {env['device']}, jax {env['jax']}, {env['date']}. Device-to-device copy in the same run: "
          f"{env['copy_gbps']:.0f} GB/s (read + write). Bytes: bf16 inputs read once + cache bytes written once; "
          f"cache donated (in place) for every backend; each call loops the write {env['repeat']} times on the "
          f"device; medians of samples taken round-robin over the backends. Backends: pallas = the Mosaic GPU kernel, xla = the "
          f"XLA scatter. Produced by `{command}` (the published table with `--publish`)."
          f"\n\n" + table)
    write_results(out, "write", env, rows, md)
    print(md)
    print(f"wrote {out / 'write.json'} and {out / 'write.md'}")
    return 0
