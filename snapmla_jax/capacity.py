"""How many decode rows fit: the memory plan of a DeepSeek-shaped model on N devices.

    python -m snapmla_jax.capacity --model v3 --devices 8 --device-gib 140.4 --contexts 16384 32768 131072

The layout planned is the one DeepSeek-style models are served with: every device runs attention
for its own share of the batch rows and holds their caches (data-parallel attention), the routed
experts are split over the devices (expert parallelism) and every other weight is replicated.
Per device:

    weights = the replicated weights + the routed experts / N    (``weight_bytes``, exact: counted
              from the model's own arrays, block-FP8 scales included with ``--fp8-weights``)
    free    = device memory - weights - reserve                  (reserve: activations, logits,
              the split-KV partials, XLA's workspace; a stated allowance, not a measurement)
    rows    = floor(free / (pages(context) x 64 x layers x cache bytes a token a layer))

and the batch is N x rows. A token takes 644 bytes a layer in the FP8 cache (512 e4m3 + a float32
scale + 64 bf16 RoPE) and 1152 in the BF16 cache, so at long contexts the FP8 cache holds up to
1.79x the rows: the ceiling of what it can buy in decode throughput at capacity (the paper's
DP-attention gain), before any kernel speed. What is planned here is memory only; decode tokens/s
at these batches is measured on GPUs, not computed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from snapmla_jax import cli
from snapmla_jax.models import MLAModel, quantize_weights
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.layers import EXPERT_WEIGHTS
from snapmla_jax.models.sharding import expert_weight_name, flat_arrays

PROG = "snapmla_jax.capacity"
PAGE_SIZE = 64
GIB = 2**30
CACHE_DTYPES = ("fp8", "bf16")
# Bytes a token takes in one layer of each cache (``cache.LatentCache.nbytes_per_token``).
CACHE_TOKEN_BYTES = {"fp8": 512 + 4 + 64 * 2, "bf16": (512 + 64) * 2}
# Device memory as the driver reports it (nvidia-smi's total, MiB / 1024).
DEVICE_GIB = {"h100": 81559 / 1024, "h200": 143771 / 1024}
RESERVE_GIB = 8.0  # the default allowance for everything but weights and caches, per device

_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, rope_type="yarn", rope_beta_fast=32.0, rope_beta_slow=1.0)
# Model shapes of the published checkpoints' config.json files (the fields the memory plan reads).
MODEL_SHAPES = {
    "v2-lite": MLAConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None, max_position_embeddings=163840, rope_factor=40.0,
        rope_original_max_position=4096, rope_mscale=0.707, rope_mscale_all_dim=0.707, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
        topk_method="greedy", **_MLA),
    "v2": MLAConfig(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, num_hidden_layers=60, num_attention_heads=128,
        qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536, max_position_embeddings=163840, rope_factor=40.0,
        rope_original_max_position=4096, rope_mscale=0.707, rope_mscale_all_dim=0.707, n_routed_experts=160,
        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1536, first_k_dense_replace=1, n_group=8,
        topk_group=3, topk_method="group_limited_greedy", routed_scaling_factor=16.0, **_MLA),
    "v3": MLAConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536, max_position_embeddings=163840, rope_factor=40.0,
        rope_original_max_position=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3, n_group=8,
        topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        **_MLA),
}


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """A model's weight bytes: ``replicated`` (everything but the routed experts, on every
    device) and ``experts`` (the routed experts' stacks, split over the devices)."""

    replicated: int
    experts: int

    def per_device(self, devices: int) -> int:
        return self.replicated + math.ceil(self.experts / devices)


def weight_bytes(cfg: MLAConfig, *, fp8_weights: bool, dtype=jnp.bfloat16, fp8_min_elements: int = 0) -> WeightBytes:
    """Bytes of ``cfg``'s model in ``dtype``, its linear kernels and routed experts block-FP8 with
    ``fp8_weights`` (``models.quantize_weights``: 1 byte an element plus a float32 scale a
    block; those of fewer than ``fp8_min_elements`` elements left in ``dtype``), counted from the
    model's arrays built abstractly (nothing is allocated)."""
    def build():
        model = MLAModel(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        return (quantize_weights(model, cfg.weight_block_size, min_elements=fp8_min_elements) if fp8_weights
                else model)

    arrays = flat_arrays(nnx.state(nnx.eval_shape(build)))
    nbytes = lambda leaf: math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    experts = sum(nbytes(leaf) for path, leaf in arrays.items() if expert_weight_name(path) in EXPERT_WEIGHTS)
    return WeightBytes(replicated=sum(map(nbytes, arrays.values())) - experts, experts=experts)


def row_bytes(cfg: MLAConfig, tokens: int, kv_cache: str) -> int:
    """Bytes of one row's caches holding ``tokens`` tokens: whole pages of 64, every layer."""
    return math.ceil(tokens / PAGE_SIZE) * PAGE_SIZE * cfg.num_hidden_layers * CACHE_TOKEN_BYTES[kv_cache]


def rows_per_device(cfg: MLAConfig, weights: WeightBytes, *, devices: int, device_gib: float, reserve_gib: float,
                    context: int, kv_cache: str) -> int:
    """Decode rows of ``context`` tokens one device holds the caches of (0 when the weights and the
    reserve leave no room); pages of 64 tokens, every layer's cache."""
    free = device_gib * GIB - reserve_gib * GIB - weights.per_device(devices)
    return max(0, int(free // row_bytes(cfg, context, kv_cache)))


def capacity_table(cfg: MLAConfig, *, devices: int, device_gib: float, reserve_gib: float, contexts: Sequence[int],
                   fp8_weights: bool, fp8_min_elements: int = 0) -> tuple[WeightBytes, list[dict]]:
    """The plan for each context: batch (all devices) per cache dtype and FP8 / BF16."""
    weights = weight_bytes(cfg, fp8_weights=fp8_weights, fp8_min_elements=fp8_min_elements)
    rows = []
    for context in contexts:
        batch = {kind: devices * rows_per_device(cfg, weights, devices=devices, device_gib=device_gib,
                                                 reserve_gib=reserve_gib, context=context, kv_cache=kind)
                 for kind in CACHE_DTYPES}
        rows.append({"context": context, **{f"batch_{k}": v for k, v in batch.items()},
                     "fp8_over_bf16": batch["fp8"] / batch["bf16"] if batch["bf16"] else None})
    return weights, rows


def weights_text(args) -> str:
    """What the weights are, for the table's first line."""
    if not args.fp8_weights:
        return "bf16"
    return f"block-FP8 from {args.fp8_min_elements} elements" if args.fp8_min_elements else "block-FP8"


def to_markdown(args, weights: WeightBytes, rows: list[dict]) -> str:
    per_device = weights.per_device(args.devices) / GIB
    lines = [f"{args.model} on {args.devices} device(s) of {args.device_gib:.1f} GiB, weights "
             f"{weights_text(args)}: {per_device:.1f} GiB a device "
             f"({weights.replicated / GIB:.1f} GiB replicated + {weights.experts / GIB:.1f} GiB of routed experts / "
             f"{args.devices}); reserve {args.reserve_gib:.1f} GiB a device.", "",
             "| context | batch, FP8 cache | batch, BF16 cache | FP8 / BF16 |", "|---|---|---|---|"]
    for r in rows:
        ratio = (f"{r['fp8_over_bf16']:.2f}x" if r["fp8_over_bf16"] is not None
                 else "none fits" if not r["batch_fp8"] else "BF16 fits none")
        lines.append(f"| {r['context']} | {r['batch_fp8']} | {r['batch_bf16']} | {ratio} |")
    return "\n".join(lines) + "\n"


def _parser() -> cli.Parser:
    p = cli.Parser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="v2-lite", help="model shape")
    p.add_argument("--devices", type=int, default=1, help="devices the model is spread over (DP attention + EP)")
    p.add_argument("--device", choices=sorted(DEVICE_GIB), default="h100",
                   help="device memory preset (--device-gib overrides it)")
    p.add_argument("--device-gib", type=float, help="memory of one device, GiB")
    p.add_argument("--reserve-gib", type=float, default=RESERVE_GIB,
                   help=f"per device, for activations, logits and XLA's workspace (default {RESERVE_GIB})")
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768], help="tokens a row")
    p.add_argument("--fp8-weights", action="store_true", help="linear kernels and routed experts block-FP8")
    cli.add_fp8_min_elements(p)
    return p


def _capacity(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cli.check_positive(args, "devices")
    cli.check_fp8_min_elements(args)
    if any(c < 1 for c in args.contexts):
        raise cli.UsageError(f"--contexts: expected positive ints, got {args.contexts}")
    if args.device_gib is None:
        args.device_gib = DEVICE_GIB[args.device]
    if not args.device_gib > 0 or not 0 <= args.reserve_gib < args.device_gib:
        raise cli.UsageError(f"--reserve-gib: expected 0 <= reserve < the device's {args.device_gib} GiB, "
                             f"got {args.reserve_gib}")
    cfg = MODEL_SHAPES[args.model]
    if cfg.n_routed_experts % args.devices:
        raise cli.UsageError(f"--devices: expected a divisor of {args.model}'s {cfg.n_routed_experts} routed experts, "
                             f"got {args.devices}")
    with jax.default_device(jax.devices("cpu")[0]):
        weights, rows = capacity_table(cfg, devices=args.devices, device_gib=args.device_gib,
                                       reserve_gib=args.reserve_gib, contexts=args.contexts,
                                       fp8_weights=args.fp8_weights, fp8_min_elements=args.fp8_min_elements)
    print(to_markdown(args, weights, rows), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input)."""
    return cli.run(PROG, _capacity, argv)


if __name__ == "__main__":
    sys.exit(main())
