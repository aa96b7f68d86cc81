"""Time write_kv's Mosaic launch configurations side by side on a GPU (fp8 cache).

    python scripts/tune_write_kv.py

Sets ``pallas_kernels.write_kv.WriteKVConfig``: block_tokens (tokens a CTA) x group_rows (token
rows a quantize step holds in registers), at a decode-sized write (4096 tokens) and a large
prefill (256k tokens), each against a device-to-device copy.
"""

import functools

from snapmla_jax.bench.timing import measure_copy_gbps, time_ms
from snapmla_jax.bench.write import PAGE_SIZE, _bytes_moved, _inputs, _num_pages, _repeated_write
from snapmla_jax.cache import LatentCache
from snapmla_jax.pallas_kernels.write_kv import WriteKVConfig, write_kv_pallas

REPEAT = 20  # writes per timed call, looped on the device (as the benchmark does)
copy = measure_copy_gbps()
print(f"copy {copy:.0f} GB/s")
for num_tokens in (4096, 262144):
    for block_tokens in (32, 64, 128):
        for group_rows in (4, 8, 16):
            config = WriteKVConfig(block_tokens=block_tokens, group_rows=group_rows)
            step = _repeated_write(functools.partial(write_kv_pallas, config=config), REPEAT)
            cache = LatentCache.create(_num_pages(num_tokens), PAGE_SIZE, dtype="fp8")
            state = {"cache": cache}

            def call(latent, rope, slots):
                state["cache"] = step(state["cache"], latent, rope, slots)
                return state["cache"]

            ms = time_ms(call, [_inputs(num_tokens, s) for s in range(2)], iters=10, inner=1) / REPEAT
            gbps = _bytes_moved(num_tokens, cache) / ms / 1e6
            print(f"tokens={num_tokens:6d} block_tokens={block_tokens:3d} group_rows={group_rows:2d} "
                  f"{ms:.4f} ms {gbps:.0f} GB/s {gbps / copy:.2f} of copy")
