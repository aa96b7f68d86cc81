"""Time a decode step's absorbed attention products with block-FP8 ``w_uk`` / ``w_uv`` against the
same products in bf16: the measurement behind their path in models/attention.py.

    python scripts/bench_fp8_absorbed.py --out /tmp/bench_fp8_absorbed [--shapes v2_lite v3] [--tokens 1 16 64]

One layer's two products for T tokens: ``q_latent = q_nope @ W_UK^T`` (H heads of [T, qk_nope] x
[qk_nope, R]) and ``latent_out @ W_UV`` ([T, R] x [R, v] a head). "bf16" is XLA's einsum over the
bf16 weights [R, H, d] as the model stores them; "fp8" is ``per_head_fp8_product`` over the
block-FP8 stacks (one grouped FP8 GEMM launch a product, a group a head, x quantized by XLA); up to
64 tokens "fp8_qk", the same with the kernel quantizing x itself (``fp8_weights.kernel_quantization``);
"fp8_xla" the FP8 stacks dequantized in the program. Each program chains the products over enough
layer copies (>= CHAIN_BYTES of e4m3) that the weights come from HBM, not the L2, as in a step whose
other weights evict them; times are a layer's (the chain's over the copies). Round-robin medians
(``timing.time_round_robin``); GB/s counts the weight bytes a program must read. Writes
bench_fp8_absorbed.json and .md under --out.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from snapmla_jax.bench import timing
from snapmla_jax.fp8_weights import kernel_quantization, quantize_blocks
from snapmla_jax.models.attention import per_head_fp8_product
from snapmla_jax.models.layers import ABSORBED_WEIGHTS, fp8_layout
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import MAX_TOKENS

# (heads, kv_lora_rank, qk_nope_head_dim, v_head_dim)
SHAPES = {"v2_lite": (16, 512, 128, 128), "v3": (128, 512, 128, 128)}
TOKENS = (1, 16, 64)
CHAIN_BYTES = 128 << 20  # e4m3 bytes a chain reads at least: well past an H100's or H200's 50 MiB L2
PROGRAMS = ("bf16", "fp8", "fp8_qk", "fp8_xla")


def copies_for(heads: int, rank: int, nope: int, v: int) -> int:
    """Layer copies a chain runs over: CHAIN_BYTES of e4m3 weights, at least two."""
    return max(2, -(-CHAIN_BYTES // (heads * rank * (nope + v))))


def bf16_products(q_nope, latent, w):
    """q_nope [T, H, nope], latent [T, H, R], w (w_uk [R, H, nope], w_uv [R, H, v]) bf16."""
    return (jnp.einsum("thn,rhn->thr", q_nope, w[0]), jnp.einsum("thr,rhv->thv", latent, w[1]))


def fp8_products(backend: str):
    def products(q_nope, latent, w):
        return tuple(per_head_fp8_product(x, stack, backend).astype(x.dtype) for x, stack in zip((q_nope, latent), w))
    return products


def chained(products):
    """One jitted program: ``products`` over every layer copy, summed in float32."""
    def chain(q_nope, latent, layers):
        outs = [products(q_nope, latent, w) for w in layers]
        return tuple(sum(o[i].astype(jnp.float32) for o in outs) for i in range(2))
    return jax.jit(chain)


def programs(heads: int, rank: int, nope: int, v: int, tokens: int, copies: int, backend: str) -> dict:
    """name -> (jitted chain, [(q_nope, latent, layer copies)])."""
    keys = jax.random.split(jax.random.key(tokens), 2 * copies + 2)
    dense = [(jax.random.normal(keys[2 * i], (rank, heads, nope), jnp.bfloat16) * 0.05,
              jax.random.normal(keys[2 * i + 1], (rank, heads, v), jnp.bfloat16) * 0.05) for i in range(copies)]
    fp8 = [tuple(quantize_blocks(fp8_layout(name, w)) for name, w in zip(ABSORBED_WEIGHTS, layer)) for layer in dense]
    q_nope = jax.random.normal(keys[-2], (tokens, heads, nope), jnp.bfloat16)
    latent = jax.random.normal(keys[-1], (tokens, heads, rank), jnp.bfloat16)
    runs = {"bf16": (chained(bf16_products), [(q_nope, latent, dense)]),
            "fp8": (chained(fp8_products(backend)), [(q_nope, latent, fp8)])}
    if tokens <= MAX_TOKENS:
        with kernel_quantization(MAX_TOKENS):  # compiled here: the program keeps the setting
            runs["fp8_qk"] = (chained(fp8_products(backend)).lower(q_nope, latent, fp8).compile(),
                              [(q_nope, latent, fp8)])
    runs["fp8_xla"] = (chained(fp8_products("xla")), [(q_nope, latent, fp8)])
    return runs


def table(env: dict, rows: list[dict]) -> str:
    lines = [f"# Absorbed attention products: block-FP8 w_uk / w_uv vs bf16\n\n{env['device']}, jax {env['jax']}, "
             f"{env['date']}; copy {env['copy_gbps']:.0f} GB/s. Command: `python scripts/bench_fp8_absorbed.py "
             "--out DIR`. A layer's two products (q_nope @ W_UK^T, latent_out @ W_UV), chained over layer copies "
             "past the L2; round-robin medians.\n",
             "| shape | heads | tokens | bf16 us | fp8 us | fp8_qk us | fp8_xla us | fp8 / bf16 | fp8_qk / bf16 | "
             "bf16 % copy | fp8 % copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        qk = r.get("fp8_qk_us")
        qk_us, qk_ratio = (f"{qk:.1f}", f"{r['bf16_us'] / qk:.2f}x") if qk else ("-", "-")
        lines.append(f"| {r['shape']} | {r['heads']} | {r['tokens']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
                     f"{qk_us} | {r['fp8_xla_us']:.1f} | {r['bf16_us'] / r['fp8_us']:.2f}x | {qk_ratio} | "
                     f"{r['bf16_gbps'] / env['copy_gbps']:.0%} | {r['fp8_gbps'] / env['copy_gbps']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for bench_fp8_absorbed.json / .md")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens: expected ints >= 1")
    if timing.missing_gpu("FP8 absorbed-products benchmark"):
        return 2
    env = dict(timing.environment(), copy_gbps=timing.measure_copy_gbps())
    rows = []
    for name in args.shapes:
        heads, rank, nope, v = SHAPES[name]
        copies = copies_for(heads, rank, nope, v)
        for tokens in args.tokens:
            times = timing.time_round_robin(programs(heads, rank, nope, v, tokens, copies, "pallas"),
                                            iters=args.iters, min_sample_ms=5)
            for value in times.values():
                if isinstance(value, Exception):  # a program that did not run: nothing to compare
                    raise value
            row = dict(shape=name, heads=heads, tokens=tokens,
                       **{f"{p}_us": times[p] * 1e3 / copies for p in PROGRAMS if p in times})
            elements = heads * rank * (nope + v)
            row["bf16_gbps"], row["fp8_gbps"] = 2 * elements / row["bf16_us"] / 1e3, elements / row["fp8_us"] / 1e3
            print(row, flush=True)
            rows.append(row)
            timing.write_results(args.out, "bench_fp8_absorbed", env, rows, table(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
