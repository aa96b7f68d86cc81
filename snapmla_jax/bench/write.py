"""``python -m snapmla_jax.bench write``: the fused quantize + cache write kernel.

For T new tokens (bf16 latent [T, 512] and RoPE [T, 64]) scattered page by page
into a cache twice their size, time the Pallas kernel and the XLA reference
(both under jit with the cache donated, so both update in place) and compare
their bandwidth with a device-to-device copy measured in the same run.
Bytes counted: inputs read once (latent, RoPE, slot ids), cache bytes written once.

Each timed call runs the write ``--repeat`` times in an on-device loop (the
cache carried through it), so that short writes are not hidden behind the
host's dispatch of one jitted call (~0.08 ms on the H100 machine).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax import cli
from snapmla_jax.bench.timing import environment, markdown_table, measure_copy_gbps, time_ms, write_results
from snapmla_jax.cache import LatentCache
from snapmla_jax.write import write_kv

PAGE_SIZE = 64


def _inputs(num_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    latent = jnp.asarray(rng.standard_normal((num_tokens, 512)) * rng.uniform(0.1, 3, (num_tokens, 1)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((num_tokens, 64)) * 30, jnp.bfloat16)
    # Whole pages in random order, as a paged allocator hands them out.
    pages = rng.permutation(2 * num_tokens // PAGE_SIZE)[: num_tokens // PAGE_SIZE]
    slots = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1).astype(np.int32)
    return latent, rope, jnp.asarray(slots)


def _bytes_moved(num_tokens: int, cache: LatentCache) -> int:
    return num_tokens * (512 * 2 + 64 * 2 + 4 + cache.nbytes_per_token)


def _repeated_write(backend: str, repeat: int):
    """jit(cache, latent, rope, slots) -> cache that writes ``repeat`` times on the device."""

    def body(cache, latent, rope, slots):
        write = functools.partial(write_kv, latent=latent, k_rope=rope, slot_mapping=slots, backend=backend)
        return jax.lax.fori_loop(0, repeat, lambda _, c: write(c), cache)

    return jax.jit(body, donate_argnums=0)


def run(token_counts, iters: int, repeat: int, backends, copy_mib: int = 2048) -> tuple[dict, list[dict]]:
    env = environment()
    copy_gbps = measure_copy_gbps(copy_mib << 20)
    rows = []
    for num_tokens in token_counts:
        for dtype in ("fp8", "bf16"):
            for backend in backends:
                step = _repeated_write(backend, repeat)
                cache = LatentCache.create(2 * num_tokens // PAGE_SIZE, PAGE_SIZE, dtype=dtype)
                arg_sets = [_inputs(num_tokens, seed) for seed in range(2)]
                state = {"cache": cache}

                def call(latent, rope, slots):
                    state["cache"] = step(state["cache"], latent, rope, slots)
                    return state["cache"]

                ms = time_ms(call, arg_sets, warmup=3, iters=iters, inner=1) / repeat
                gbps = _bytes_moved(num_tokens, cache) / (ms * 1e-3) / 1e9
                rows.append(dict(tokens=num_tokens, cache=dtype, backend=backend, ms=ms, gbps=gbps,
                                 copy_fraction=gbps / copy_gbps))
    env["copy_gbps"] = copy_gbps
    env["repeat"] = repeat
    return env, rows


def main(argv: list[str] | None = None) -> int:
    """The benchmark; raises cli.UsageError for bad flags, or the pallas backend without a
    CUDA GPU (``python -m snapmla_jax.bench write`` prints it on one line, exit code 2)."""
    parser = cli.Parser(prog="python -m snapmla_jax.bench write", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536, 262144],
                        help=f"new tokens per write, multiples of {PAGE_SIZE} (default 4096 65536 262144)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (default 20)")
    parser.add_argument("--repeat", type=int, default=20,
                        help="writes per timed call, looped on the device (default 20)")
    parser.add_argument("--backends", nargs="+", default=["pallas", "xla"],
                        choices=["pallas", "interpret", "xla"],
                        help="write_kv backends to compare (default pallas xla; pallas needs a CUDA GPU)")
    parser.add_argument("--copy-mib", type=int, default=2048, help="size of the reference copy in MiB (default 2048)")
    cli.add_bench_output_flags(parser, "write.json / write.md")
    args = parser.parse_args(argv)
    if any(t < PAGE_SIZE or t % PAGE_SIZE for t in args.tokens):
        raise cli.UsageError(f"--tokens: expected positive multiples of {PAGE_SIZE}, got {args.tokens}")
    for flag in ("iters", "repeat", "copy_mib"):
        if getattr(args, flag) < 1:
            raise cli.UsageError(f"--{flag.replace('_', '-')}: expected an int >= 1, got {getattr(args, flag)}")
    if "pallas" in args.backends and jax.default_backend() != "gpu":
        raise cli.UsageError("--backends: pallas compiles for a CUDA GPU and none is present; "
                             "use --backends interpret xla on this machine")
    out = cli.bench_output_dir(args)
    env, rows = run(args.tokens, args.iters, args.repeat, args.backends, args.copy_mib)
    table = markdown_table(
        ["tokens", "cache", "backend", "median ms", "GB/s", "fraction of copy"],
        [[r["tokens"], r["cache"], r["backend"], r["ms"], r["gbps"], r["copy_fraction"]] for r in rows])
    md = (f"# write_kv: fused quantize + paged cache write\n\n"
          f"Device {env['device']}, jax {env['jax']}, {env['date']}. Device-to-device copy in the same run: "
          f"{env['copy_gbps']:.0f} GB/s (read + write). Bytes: bf16 inputs read once + cache bytes written once; "
          f"cache donated (in place) for both backends; each call loops the write {env['repeat']} times on the "
          f"device. Produced by `python -m snapmla_jax.bench write` (the published table with `--publish`)."
          f"\n\n" + table)
    write_results(out, "write", env, rows, md)
    print(md)
    print(f"wrote {out / 'write.json'} and {out / 'write.md'}")
    return 0
