"""Convert a Hugging Face DeepSeek-V2/V3 checkpoint into a snapmla-jax (orbax) checkpoint.

    python -m snapmla_jax.convert --hf-dir DIR --out DIR [--dtype bfloat16] [--overwrite] [--quiet] [--shard-experts]

FP8 block-quantized releases are dequantized to ``--dtype``; multi-token
prediction layers are dropped. The tokenizer files found beside the weights
are copied into ``--out`` so that ``python -m snapmla_jax.generate --model OUT``
needs nothing else. ``--shard-experts`` loads the expert weights split over all
devices (the rest replicated) and saves each device's shards from there: the way
for a model larger than one device. Exit code 0 on success, 2 with a one-line
message on bad arguments or an unusable checkpoint.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
# What snapmla_jax.tokenizer.load_tokenizer and generation read from a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class _UsageError(Exception):
    """Raised instead of argparse's print-usage-and-exit, so main() can return 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m snapmla_jax.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output checkpoint directory (must be new or empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter dtype (default bfloat16)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--shard-experts", action="store_true",
                        help="load the MoE expert weights split over all devices, the rest replicated, and save "
                             "from there (for models larger than one device; the expert count must divide evenly)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the conversion; returns the process exit code (0 ok, 2 bad input)."""
    from snapmla_jax.models import expert_sharding, load_hf_checkpoint, save_checkpoint
    from snapmla_jax.models.sharding import PlacementError
    from snapmla_jax.models.transformer import param_count

    try:
        args = _parser().parse_args(argv)
        try:
            model = load_hf_checkpoint(args.hf_dir, dtype=DTYPES[args.dtype], progress=not args.quiet,
                                       sharding=expert_sharding() if args.shard_experts else None)
        except PlacementError as err:  # the placement --shard-experts asked for, not the checkpoint
            raise _UsageError(f"--shard-experts: {jax.device_count()} devices: {err}") from err
        save_checkpoint(model, args.out, overwrite=args.overwrite)
        copied = [name for name in TOKENIZER_FILES if (pathlib.Path(args.hf_dir) / name).is_file()]
        for name in copied:
            shutil.copy2(pathlib.Path(args.hf_dir) / name, pathlib.Path(args.out) / name)
    except (_UsageError, ValueError) as err:
        print(f"snapmla_jax.convert: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"saved {param_count(model):,} parameters ({args.dtype}) to {args.out}"
          + (f" with {', '.join(copied)}" if copied else " (no tokenizer files found beside the weights)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
