"""A Mosaic FP8 decode call against its kernel alone: what the launches around the kernel cost.

    PYTHONPATH=. python scripts/probe_call_parts.py --out $OUT [--shapes 32x16384x128x2 ...]

For each shape "BxCONTEXTxHxS_Q" (the decode bench's caches and queries, page 64, one layer):
"full" is ``mla_decode_mgpu`` as the bench calls it (the inputs launch: query quantization and
the token scales' planes; the kernel; the split merge when there are splits), "kernel" the same
launch with its inputs computed once beforehand (``prepare_inputs`` replaced by them), timed side
by side (``timing.time_round_robin``, samples of >= 10 ms). One call a sample: at small shapes
the host's dispatch sets both times; use ``scripts/profile_decode_launches.py`` there.
Writes call_parts.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
from snapmla_jax.pallas_kernels.split_plan import uniform_plan
from snapmla_jax.bench import timing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="*", default=["32x16384x128x2", "32x65536x128x2", "64x16384x128x1"])
    args = parser.parse_args(argv)
    if timing.missing_gpu("probe_call_parts"):
        return 2
    import bench_mgpu as bench  # scripts/bench_mgpu.py: scripts/ is sys.path[0] when run as a script
    results = {"env": timing.environment(), "rows": []}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        (batch, context, heads, s_q), fp8, block_table, q, q_rope, seq_lens, scale = bench.fp8_problem(shape)
        splits = bench.mosaic_splits(batch, s_q * heads, context, mgpu_kernel.BLOCK_M)
        rows = s_q * heads
        q_rows, qr_rows = q.reshape(batch, rows, -1), q_rope.reshape(batch, rows, -1)
        flat = (fp8.latent.reshape(-1, fp8.latent.shape[-1]), fp8.scale.reshape(-1),
                fp8.rope.reshape(-1, fp8.rope.shape[-1]))
        layer_offset = jnp.zeros((1,), jnp.int32)
        full = jax.jit(lambda q, qr, c, bt, n: bench.mgpu_decode(q, qr, c, bt, n, softmax_scale=scale,
                                                                num_splits=splits))
        # The inputs without the plan (a uniform plan is a constant of the traced call, rebuilt there).
        prepared = mgpu_kernel.prepare_inputs(q_rows, qr_rows, flat, block_table, seq_lens, layer_offset,
                                              page_size=64, num_splits=splits, balanced=False,
                                              num_pages=flat[0].shape[0] // 64, scale_planes=True)[:-1]

        def kernel_only(prepared, qr_rows, cache, bt, lens):
            original = mgpu_kernel.prepare_inputs
            # While this traces:
            mgpu_kernel.prepare_inputs = lambda *a, **k: (*prepared, uniform_plan(batch, splits))
            try:
                return mgpu_kernel.launch(q_rows, qr_rows, cache, bt, lens, layer_offset, softmax_scale=scale,
                                          page_size=64, s_q=s_q, num_heads=heads, num_splits=splits,
                                          balanced=False, num_pages=None, interpret=False)
            finally:
                mgpu_kernel.prepare_inputs = original

        runs = {"full": (full, [(q, q_rope, fp8, block_table, seq_lens)]),
                "kernel": (jax.jit(kernel_only), [(prepared, qr_rows, flat, block_table, seq_lens)])}
        times = timing.time_round_robin(runs, rounds=5, iters=10, min_sample_ms=10.0)
        row = {"shape": shape, "splits": splits,
               **{name: ms if isinstance(ms, float) else repr(ms) for name, ms in times.items()}}
        print(row, flush=True)
        results["rows"].append(row)
        (out / "call_parts.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
