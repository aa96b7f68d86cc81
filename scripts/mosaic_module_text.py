"""The Mosaic GPU decode kernels as the modules they lower to, on a machine without a GPU.

    python scripts/mosaic_module_text.py --out /tmp/modules_before
    ... change the kernels' Python code ...
    python scripts/mosaic_module_text.py --out /tmp/modules_after --compare /tmp/modules_before

Lowers the 64-row FP8 kernel (``mgpu``), the 16-row one (``small``) and the BF16 twin (``bf16``),
each with a uniform and a balanced split plan, for CUDA (``backend.lower_for_cuda``: layout
inference and SMEM allocation included) and writes each Mosaic module as MLIR text without debug
info (``backend.mosaic_module_texts``) to ``<kernel>_<plan>.mlir`` under --out. With --compare it
says which differ from an earlier dump and exits 1 if any does.

A refactor whose modules are the same text is the same kernel on the GPU: no device time needed
to check it. A different text says nothing about speed; that takes the GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import jax.numpy as jnp
import numpy as np

from snapmla_jax.pallas_kernels.mla_decode_mgpu import mla_decode_mgpu
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import mla_decode_mgpu_bf16
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import mla_decode_mgpu_small
from snapmla_jax.backend import lower_for_cuda, mosaic_module_texts

KERNELS = ("mgpu", "small", "bf16")
PLANS = ("uniform", "balanced")
PAGE = 64
PAGES_PER_ROW = 3


def lowered_module(kernel: str, plan: str) -> str:
    """The Mosaic decode module of ``kernel`` (``KERNELS``) with a ``plan`` (``PLANS``) split plan of two
    splits a row, over two batch rows of 3 pages (seq_lens 100 and 0), as MLIR text."""
    heads = 16 if kernel == "small" else 64
    batch, rows = 2, heads
    q = jnp.ones((batch, rows, 512), jnp.bfloat16)
    q_rope = jnp.ones((batch, rows, 64), jnp.bfloat16)
    tokens = batch * PAGES_PER_ROW * PAGE
    block_table = jnp.asarray(np.arange(batch * PAGES_PER_ROW, dtype=np.int32).reshape(batch, PAGES_PER_ROW))
    seq_lens = jnp.asarray([100, 0], jnp.int32)
    rope = jnp.ones((tokens, 64), jnp.bfloat16)
    if kernel == "bf16":
        fn, cache = mla_decode_mgpu_bf16, (jnp.ones((tokens, 512), jnp.bfloat16), rope)
    else:
        fn = mla_decode_mgpu_small if kernel == "small" else mla_decode_mgpu
        cache = (jnp.ones((tokens, 512), jnp.float8_e4m3fn), jnp.ones((tokens,), jnp.float32), rope)

    def call(q, q_rope, cache, block_table, seq_lens):
        return fn(q, q_rope, cache, block_table, seq_lens, jnp.zeros((1,), jnp.int32), softmax_scale=0.1,
                  page_size=PAGE, s_q=1, num_heads=heads, num_splits=2, balanced=plan == "balanced")

    # The call also lowers the Mosaic merge of its splits: the decode kernel's module is the one
    # named after it.
    modules = [module for module in mosaic_module_texts(lower_for_cuda(call, q, q_rope, cache, block_table, seq_lens))
               if "snapmla_decode" in module]
    if len(modules) != 1:
        raise RuntimeError(f"{kernel} ({plan} plan): expected one Mosaic decode module in the lowering, "
                           f"got {len(modules)}")
    # The dump file name Mosaic GPU would use counts the kernel's lowerings in this process.
    return re.sub(r'(mosaic_gpu\.dump_basename = "[^"]*)_\d+"', r'\1"', modules[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for <kernel>_<plan>.mlir")
    parser.add_argument("--kernels", nargs="*", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--plans", nargs="*", choices=PLANS, default=list(PLANS))
    parser.add_argument("--compare", help="an earlier --out directory to compare the modules with")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    differ = []
    for kernel in args.kernels:
        for plan in args.plans:
            name = f"{kernel}_{plan}.mlir"
            text = lowered_module(kernel, plan)
            (out / name).write_text(text)
            if args.compare is None:
                print(f"{name}: {len(text)} characters", flush=True)
                continue
            earlier = pathlib.Path(args.compare) / name
            if not earlier.exists():
                print(f"{name}: not in {args.compare}", flush=True)
                differ.append(name)
            elif earlier.read_text() != text:
                print(f"{name}: differs from {earlier}", flush=True)
                differ.append(name)
            else:
                print(f"{name}: the same", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
