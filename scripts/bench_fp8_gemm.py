"""Time the block-FP8 weight product (``snapmla_jax.fp8_weights.fp8_matmul``) against the bf16 GEMM
of the same shape, from decode-sized token counts to prefill: the measurement behind
pallas_kernels/fp8_gemm_mgpu.py's and fp8_gemm_tiles_mgpu.py's docstrings.

    python scripts/bench_fp8_gemm.py --out /tmp/bench_fp8_gemm [--tokens 16 64 4096] [--shapes 18432x7168 ...]

Four or five programs a shape, side by side (``timing.time_round_robin``): "bf16" is XLA's x @ W^T
with W in bf16; "fp8" is ``fp8_matmul`` (on a Hopper GPU the Mosaic kernels with their activation
quantization and the sum of their partials); up to 64 tokens "fp8_qk", the same with the kernel
of few tokens quantizing x itself (``fp8_weights.kernel_quantization``); "fp8_xla" is
``fp8_matmul(..., backend="xla")``, the weight dequantized in the program; "fp8_tensor" is XLA's FP8 product with one scale for each
operand (cuBLAS's FP8 GEMM: the ceiling a product with block scales is held against). Below
COMPUTE_TOKENS tokens each program chains its product over enough weight copies (>= 384 MiB of
e4m3) that the weights come from HBM, not L2, and one call's time is the chain's over the copies;
from there on the product is compute-bound and runs once a call. GB/s counts the weight bytes
each program must read (2 a weight in bf16, 1 in FP8) against the copy bandwidth measured in the
run; TFLOP/s counts 2 x tokens x out x in. Writes bench_fp8_gemm.json and .md under --out.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from snapmla_jax.bench import timing
from snapmla_jax.fp8_weights import fp8_matmul, kernel_quantization, quantize_blocks
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import MAX_TOKENS

# [out, in] of DeepSeek-V3's MLP (18432 x 7168 and back), routed expert (2048 x 7168 and back),
# q up-projection (24576 x 1536), q down-projection (1536 x 7168), and V2-Lite's dense MLP.
SHAPES = ("18432x7168", "7168x18432", "2048x7168", "7168x2048", "24576x1536", "1536x7168", "10944x2048")
TOKENS = (16, 64)
CHAIN_BYTES = 384 << 20
COMPUTE_TOKENS = 1024
PROGRAMS = ("bf16", "fp8", "fp8_qk", "fp8_xla", "fp8_tensor")


def parse_shape(text: str) -> tuple[int, int]:
    try:
        out_dim, in_dim = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected OUTxIN (e.g. 18432x7168), got {text!r}") from None
    if out_dim < 1 or in_dim < 1:
        raise argparse.ArgumentTypeError(f"expected positive OUTxIN, got {text!r}")
    return out_dim, in_dim


def chained(product):
    """One jitted program: ``product(x, w)`` over every weight copy, summed in float32 (one copy:
    the product itself, with no sum to add memory traffic)."""
    def chain(x, ws):
        if len(ws) == 1:
            return product(x, ws[0])
        return sum(product(x, w).astype(jnp.float32) for w in ws)
    return jax.jit(chain)


def tensor_scaled_fp8(x: jax.Array, w8_scale: tuple) -> jax.Array:
    """XLA's FP8 product with per-tensor scales: x quantized to e4m3 by its amax, times the e4m3
    weight, the two scales applied to the float32 result -> [tokens, out] in x's dtype."""
    w8, w_scale = w8_scale
    x_scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / 448.0
    x8 = (x.astype(jnp.float32) / x_scale).astype(jnp.float8_e4m3fn)
    y = jax.lax.dot_general(x8, w8, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (x_scale * w_scale)).astype(x.dtype)


def copies_for(out_dim: int, in_dim: int, tokens: int, chain_bytes: int = CHAIN_BYTES) -> int:
    """Weight copies a chain runs over: enough that they come from HBM, or 1 from COMPUTE_TOKENS."""
    return 1 if tokens >= COMPUTE_TOKENS else max(2, -(-chain_bytes // (out_dim * in_dim)))


def programs(out_dim: int, in_dim: int, tokens: int, copies: int) -> dict:
    """name -> (jitted chain, [(x, weight copies)])."""
    keys = jax.random.split(jax.random.key(0), copies + 1)
    dense = [jax.random.normal(k, (out_dim, in_dim), jnp.bfloat16) * 0.02 for k in keys[1:]]
    fp8 = [quantize_blocks(w) for w in dense]
    tensor = [w8_tensor(w) for w in dense]
    x = jax.random.normal(keys[0], (tokens, in_dim), jnp.bfloat16)
    runs = {"bf16": (chained(lambda x, w: x @ w.T), [(x, dense)]),
            "fp8": (chained(fp8_matmul), [(x, fp8)])}
    if tokens <= MAX_TOKENS:
        with kernel_quantization(MAX_TOKENS):  # compiled here: the program keeps the setting
            runs["fp8_qk"] = (chained(fp8_matmul).lower(x, fp8).compile(), [(x, fp8)])
    runs["fp8_xla"] = (chained(lambda x, w: fp8_matmul(x, w, backend="xla")), [(x, fp8)])
    runs["fp8_tensor"] = (chained(tensor_scaled_fp8), [(x, tensor)])
    return runs


def w8_tensor(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w as e4m3 with one float32 scale (its amax on 448)."""
    scale = jnp.max(jnp.abs(w)).astype(jnp.float32) / 448.0
    return (w.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def table(env: dict, rows: list[dict]) -> str:
    lines = [f"# Block-FP8 weight product vs bf16 GEMM\n\n{env['device']}, jax {env['jax']}, {env['date']}; copy "
             f"{env['copy_gbps']:.0f} GB/s. Command: `{env.get('command', 'python scripts/bench_fp8_gemm.py')}`.\n",
             "| out x in | tokens | bf16 us | fp8 us | fp8_qk us | fp8_xla us | fp8_tensor us | fp8 / bf16 | "
             "fp8_qk / bf16 | fp8 GB/s | fp8 % copy | fp8 TFLOP/s | fp8 % fp8_tensor | fp8_xla / bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tflops = 2 * r["tokens"] * r["out"] * r["in"] / r["fp8_us"] / 1e6
        qk = r.get("fp8_qk_us")
        qk_us, qk_ratio = (f"{qk:.1f}", f"{r['bf16_us'] / qk:.2f}x") if qk else ("-", "-")
        lines.append(f"| {r['out']} x {r['in']} | {r['tokens']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {qk_us} | "
                     f"{r['fp8_xla_us']:.1f} | {r['fp8_tensor_us']:.1f} | {r['bf16_us'] / r['fp8_us']:.2f}x | {qk_ratio} | "
                     f"{r['fp8_gbps']:.0f} | {r['fp8_gbps'] / env['copy_gbps']:.0%} | {tflops:.0f} | "
                     f"{r['fp8_tensor_us'] / r['fp8_us']:.0%} | {r['bf16_us'] / r['fp8_xla_us']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for bench_fp8_gemm.json / .md")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES],
                        help="OUTxIN weight shapes")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--chain-mib", type=int, default=CHAIN_BYTES >> 20,
                        help="e4m3 weight bytes a chain reads (MiB; fewer compile faster on small matrices, "
                             "but under ~3x the L2 the copies are read from L2)")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens: expected ints >= 1")
    if args.chain_mib < 1:
        parser.error("--chain-mib: expected an int >= 1")
    if timing.missing_gpu("FP8 GEMM benchmark"):
        return 2
    env = dict(timing.environment(), copy_gbps=timing.measure_copy_gbps(), command=timing.command_text(
        "python scripts/bench_fp8_gemm.py", sys.argv[1:] if argv is None else argv))
    rows = []
    for out_dim, in_dim in args.shapes:
        for tokens in args.tokens:
            copies = copies_for(out_dim, in_dim, tokens, args.chain_mib << 20)
            times = timing.time_round_robin(programs(out_dim, in_dim, tokens, copies), iters=args.iters,
                                            min_sample_ms=5)
            for value in times.values():
                if isinstance(value, Exception):  # a program that did not run: nothing to compare
                    raise value
            row = dict(out=out_dim, **{"in": in_dim}, tokens=tokens,
                       **{f"{name}_us": times[name] * 1e3 / copies for name in PROGRAMS if name in times})
            row["fp8_gbps"] = out_dim * in_dim / row["fp8_us"] / 1e3
            print(row, flush=True)
            rows.append(row)
            timing.write_results(args.out, "bench_fp8_gemm", env, rows, table(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
