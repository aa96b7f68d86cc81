"""Time write_kv's launch configurations side by side on a GPU (fp8 cache, 256k tokens).

    python scripts/tune_write_kv.py
"""

import functools

import jax

from snapmla_jax.pallas_kernels.write_kv import WriteKVConfig, write_kv_pallas
from snapmla_jax.bench.timing import measure_copy_gbps, time_ms
from snapmla_jax.bench.write import _bytes_moved, _inputs
from snapmla_jax.cache import LatentCache
from snapmla_jax.write import _flat_arrays

NUM_TOKENS = 262144
copy = measure_copy_gbps()
cache = LatentCache.create(2 * NUM_TOKENS // 64, 64, dtype="fp8")
print(f"copy {copy:.0f} GB/s")
for tpp in (1, 2, 4, 8, 16):
    for warps in (1, 2, 4):
        cfg = WriteKVConfig(tokens_per_program=tpp, num_warps=warps)
        step = jax.jit(functools.partial(write_kv_pallas, config=cfg), donate_argnums=0)
        state = {"arrays": _flat_arrays(LatentCache.create(2 * NUM_TOKENS // 64, 64, dtype="fp8"))}

        def call(latent, rope, slots):
            state["arrays"] = step(state["arrays"], latent, rope, slots)
            return state["arrays"]

        ms = time_ms(call, [_inputs(NUM_TOKENS, s) for s in range(2)], iters=10)
        gbps = _bytes_moved(NUM_TOKENS, cache) / ms / 1e6
        print(f"tpp={tpp:2d} warps={warps} {ms:.3f} ms {gbps:.0f} GB/s {gbps / copy:.2f} of copy")
