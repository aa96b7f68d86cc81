"""What the 64-row FP8 kernel's Q.K chain settings cost in accuracy, on the GPU.

    python tools/qk_precision.py --out $OUT [--seeds 6]

Hopper's FP8 wgmma adds each K = 32 slice of products to its accumulator with
only ~14 significant bits, so the longer a chain of wgmmas, the larger the
error of a score (``mla_decode_mgpu.QK_PROMOTION``: features per chain, each
chain summed in fp32 registers). For each variant of the module constants
(``VARIANTS``) and each seeded case (heads 16, 64, 128; s_q 1 and 2; ragged
seq_lens up to 4k; 2% of tokens with 300x larger latents, so per-token scales
300x apart, as in the tests; ``--outlier-scale``), the compiled kernel's output is compared with

- the xla emulation of its e4m3 roundings (``mla_decode_reference``, block_n
  128): what ``tests/test_mla_decode_mgpu.py`` bounds (``MGPU_TOL``), and
- exact attention in float64 over the dequantized cache (Q and P unrounded):
  the error a user pays, which the e4m3 roundings of Q and P dominate (with
  300x outliers, whose scores are ~300x larger, the rounding of Q alone moves
  the output by ~10% of its largest value).

Errors are max |out - ref| / max |ref| and the relative L2 norm, per case;
the summary takes the max (and the mean) over cases. Writes
qk_precision.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
from snapmla_jax.pallas_kernels.fp8 import quantize_per_token
from snapmla_jax.pallas_kernels.mla_decode_reference import mla_decode_reference
from snapmla_jax.bench import timing

VARIANTS = {
    "promotion_256": {"QK_PROMOTION": 256},
    "promotion_512": {"QK_PROMOTION": 512},
    "promotion_128": {"QK_PROMOTION": 128},
}
CASES = [(16, 2, [1500, 4000, 333]), (64, 1, [4000, 77, 2100]), (128, 1, [3000, 4000, 1]),
         (128, 2, [2500, 640, 4000])]
PAGES_PER_ROW = 64
BATCH = 3
PAGE = 64


def make_case(seed: int, heads: int, s_q: int, seq_lens: list, outlier_scale: float = 300.0):
    """Random inputs: (q [B, s_q, H, 512] bf16, q_rope bf16, latent e4m3 [P, 64, 512], scale [P, 64],
    rope bf16 [P, 64, 64], block_table [B, 64], seq_lens [B], the unquantized latent f32)."""
    rng = np.random.default_rng(seed)
    num_pages = BATCH * PAGES_PER_ROW + 7
    x = rng.standard_normal((num_pages, PAGE, 512)).astype(np.float32)
    x[rng.random((num_pages, PAGE)) < 0.02] *= outlier_scale  # outlier tokens: scales this far apart
    latent, scale = quantize_per_token(jnp.asarray(x))
    rope = jnp.asarray(rng.standard_normal((num_pages, PAGE, 64)), jnp.bfloat16)
    block_table = jnp.asarray(rng.permutation(num_pages)[:BATCH * PAGES_PER_ROW].reshape(BATCH, PAGES_PER_ROW),
                              jnp.int32)
    q = jnp.asarray(rng.standard_normal((BATCH, s_q, heads, 512)) * 0.3, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((BATCH, s_q, heads, 64)) * 0.3, jnp.bfloat16)
    return q, q_rope, latent, scale, rope, block_table, jnp.asarray(seq_lens, jnp.int32)


def run_kernel(q, q_rope, latent, scale, rope, block_table, seq_lens, softmax_scale, *, interpret: bool = False):
    """The 64-row kernel on the API's shapes (rows padded to 64, the cache flattened, one split;
    ``interpret``: on the CPU, where the wgmma is exact and every variant matches the emulation)."""
    batch, s_q, heads, rank = q.shape
    rows = s_q * heads
    padded = -(-rows // mgpu_kernel.BLOCK_M) * mgpu_kernel.BLOCK_M
    to_rows = lambda a: jnp.pad(a.reshape(batch, rows, a.shape[-1]), [(0, 0), (0, padded - rows), (0, 0)])
    n = latent.shape[0] * PAGE
    cache = (latent.reshape(n, rank), scale.reshape(n), rope.reshape(n, 64))
    out, _ = mgpu_kernel.mla_decode_mgpu(to_rows(q), to_rows(q_rope), cache, block_table, seq_lens,
                                         jnp.zeros((1,), jnp.int32), softmax_scale=softmax_scale, page_size=PAGE,
                                         s_q=s_q, num_heads=heads, interpret=interpret)
    return np.asarray(out[:, :rows].reshape(q.shape), np.float64)


def exact_attention(q, q_rope, latent, scale, rope, block_table, seq_lens, softmax_scale) -> np.ndarray:
    """float64 attention over the dequantized cache with the causal rule of s_q > 1 (query
    position i of s_q sees seq_len - s_q + 1 + i tokens): [B, s_q, H, 512]."""
    q, q_rope = np.asarray(q, np.float64), np.asarray(q_rope, np.float64)
    kv = np.asarray(latent, np.float64) * np.asarray(scale, np.float64)[..., None]
    kr = np.asarray(rope, np.float64)
    batch, s_q = q.shape[:2]
    out = np.zeros(q.shape)
    for b in range(batch):
        pages = np.asarray(block_table[b])
        k_b, r_b = kv[pages].reshape(-1, 512), kr[pages].reshape(-1, 64)
        length = int(seq_lens[b])
        for i in range(s_q):
            seen = length - s_q + 1 + i
            if seen <= 0:
                continue
            s = (q[b, i] @ k_b[:seen].T + q_rope[b, i] @ r_b[:seen].T) * softmax_scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[b, i] = (p / p.sum(axis=1, keepdims=True)) @ k_b[:seen]
    return out


def errors(out: np.ndarray, ref: np.ndarray, seen: np.ndarray) -> dict:
    """max |out - ref| / max |ref| and the relative L2 norm, over the rows that saw a token."""
    o, r = out[seen], ref[seen]
    return {"max": float(np.max(np.abs(o - r)) / np.max(np.abs(r))),
            "rel_l2": float(np.linalg.norm(o - r) / np.linalg.norm(r))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/qk_precision")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--variants", nargs="*", help="default: all of VARIANTS")
    parser.add_argument("--cases", type=int, help="only the first this many of CASES")
    parser.add_argument("--outlier-scale", type=float, default=300.0,
                        help="2%% of tokens' latents this many times larger (the tests' 300; 1: none)")
    parser.add_argument("--interpret", action="store_true", help="the interpreter (CPU): a check of the script")
    args = parser.parse_args(argv)
    softmax_scale = 576 ** -0.5
    problems = [(seed, case, make_case(seed, *case, args.outlier_scale)) for seed in range(args.seeds)
                for case in CASES[:args.cases]]
    references = []
    for seed, (heads, s_q, lens), inputs in problems:
        emulated, _ = mla_decode_reference(*inputs, softmax_scale=softmax_scale, block_n=128)
        seen = np.broadcast_to((np.asarray(lens) > 0)[:, None, None], (BATCH, s_q, heads))
        references.append((np.asarray(emulated, np.float64), exact_attention(*inputs, softmax_scale), seen))
    original = {"QK_PROMOTION": mgpu_kernel.QK_PROMOTION}
    results = {"env": timing.environment(), "cases": [list(map(str, c)) for c in CASES], "seeds": args.seeds,
               "outlier_scale": args.outlier_scale, "variants": {}}
    for name in args.variants or list(VARIANTS):
        for constant, value in {**original, **VARIANTS[name]}.items():
            setattr(mgpu_kernel, constant, value)
        jax.clear_caches()  # the kernel's jit cache would hand back the previous variant
        per_case = []
        for (seed, case, inputs), (emulated, exact, seen) in zip(problems, references):
            out = run_kernel(*inputs, softmax_scale, interpret=args.interpret)
            per_case.append({"seed": seed, "case": str(case), "vs_emulation": errors(out, emulated, seen),
                             "vs_exact": errors(out, exact, seen)})
        summary = {f"{against}_{kind}_{stat}": fn([c[against][kind] for c in per_case])
                   for against in ("vs_emulation", "vs_exact") for kind in ("max", "rel_l2")
                   for stat, fn in (("max", max), ("mean", statistics.fmean))}
        results["variants"][name] = {"settings": VARIANTS[name], "summary": summary, "per_case": per_case}
        print(name, json.dumps({k: round(v, 5) for k, v in summary.items()}), flush=True)
    for constant, value in original.items():
        setattr(mgpu_kernel, constant, value)
    # The emulation's own distance to exact attention: the e4m3 roundings of Q and P.
    emulation_vs_exact = [errors(emulated, exact, seen) for emulated, exact, seen in references]
    results["emulation_vs_exact"] = {kind: {"max": max(e[kind] for e in emulation_vs_exact),
                                            "mean": statistics.fmean(e[kind] for e in emulation_vs_exact)}
                                     for kind in ("max", "rel_l2")}
    print("emulation vs exact", json.dumps(results["emulation_vs_exact"]), flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "qk_precision.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
