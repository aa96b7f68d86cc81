"""Convert a Hugging Face DeepSeek-V2/V3 checkpoint into a snapmla-jax (orbax) checkpoint.

    python -m snapmla_jax.convert --hf-dir DIR --out DIR [--dtype bfloat16] [--overwrite] [--quiet] [--shard-experts]
                                  [--fp8-weights]

FP8 block-quantized releases are dequantized to ``--dtype``, or with
``--fp8-weights`` their linear kernels and routed experts are kept FP8 with their block scales
and the ones stored in higher precision (a bf16 release such as DeepSeek-V2's) quantized to
FP8 as they are read (``load_hf_checkpoint(fp8_weights=True, quantize_fp8_weights=True)``);
multi-token prediction layers are dropped. The tokenizer files found beside the weights
are copied into ``--out`` so that ``python -m snapmla_jax.generate --model OUT``
needs nothing else. ``--shard-experts`` loads the expert weights split over all
devices (the rest replicated) and saves each device's shards from there: the way
for a model larger than one device.

``--out`` must be a new or empty directory; with ``--overwrite`` it may also hold a
snapmla-jax checkpoint (config.json with our "format"), and nothing else: never the
``--hf-dir`` itself, a directory inside it or around it, a file, or a directory of other
files. The new checkpoint is written beside ``--out`` and renamed into place once complete,
so an interrupted conversion leaves the old one intact. Exit code 0 on success, 2 with a
one-line message on bad arguments or an unusable checkpoint (checked before any work).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp

from snapmla_jax import cli

PROG = "snapmla_jax.convert"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
# What snapmla_jax.tokenizer.load_tokenizer and generation read from a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _parser() -> cli.Parser:
    parser = cli.Parser(prog="python -m snapmla_jax.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True,
                        help="Hugging Face checkpoint directory (config.json + safetensors); only read")
    parser.add_argument("--out", required=True,
                        help="output checkpoint directory: new or empty (or, with --overwrite, a snapmla-jax "
                             "checkpoint); never inside or around --hf-dir")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="parameter dtype (default bfloat16)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the snapmla-jax checkpoint at --out (only one of ours; once the new one is "
                             "complete)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--shard-experts", action="store_true",
                        help="load the MoE expert weights split over all devices, the rest replicated, and save "
                             "from there (for models larger than one device; the expert count must divide evenly)")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="linear kernels (attention projections, dense and shared-expert MLPs) and routed "
                             "experts in block FP8: kept as stored where the checkpoint has them in FP8, else "
                             "quantized per block (128 x 128 unless the checkpoint names one) as they are read; "
                             "the rest in --dtype")
    cli.add_fp8_min_elements(parser)
    return parser


def _within(path: pathlib.Path, other: pathlib.Path) -> bool:
    return path == other or other in path.parents


def check_paths(hf_dir: str, out: str, overwrite: bool) -> None:
    """UsageError naming the flag unless ``hf_dir`` looks like a Hugging Face checkpoint and
    ``out`` may receive the converted one (see the module docstring)."""
    from snapmla_jax.models.checkpoint import is_checkpoint, target_problem

    source = pathlib.Path(hf_dir)
    if not source.is_dir():
        raise cli.UsageError(f"--hf-dir: {hf_dir} is not a directory")
    if is_checkpoint(source):
        raise cli.UsageError(f"--hf-dir: {hf_dir} is already a snapmla-jax checkpoint (converted); "
                             "pass it to generate --model as it is")
    if not (source / "config.json").is_file():
        raise cli.UsageError(f"--hf-dir: {hf_dir} has no config.json: not a Hugging Face checkpoint directory")
    source, target = source.resolve(), pathlib.Path(os.path.abspath(out))
    resolved = target.resolve()
    if _within(resolved, source):
        where = "is" if resolved == source else "is inside"
        raise cli.UsageError(f"--out: {out} {where} the --hf-dir directory {hf_dir}; choose a directory outside it")
    if _within(source, resolved):
        raise cli.UsageError(f"--out: {out} contains the --hf-dir directory {hf_dir}; choose a directory outside it")
    problem = target_problem(out, overwrite=overwrite)
    if problem is not None:
        raise cli.UsageError(problem.message("--out", "--overwrite"))


def _convert(argv: list[str]) -> int:
    from snapmla_jax.models import expert_sharding, load_hf_checkpoint
    from snapmla_jax.models.checkpoint import fp8_kernel_record, staged_checkpoint_dir, write_checkpoint
    from snapmla_jax.models.sharding import PlacementError
    from snapmla_jax.models.transformer import param_count

    args = _parser().parse_args(argv)
    check_paths(args.hf_dir, args.out, args.overwrite)
    cli.check_fp8_min_elements(args)
    try:
        model = load_hf_checkpoint(args.hf_dir, dtype=DTYPES[args.dtype], progress=not args.quiet,
                                   sharding=expert_sharding() if args.shard_experts else None,
                                   fp8_weights=args.fp8_weights, quantize_fp8_weights=args.fp8_weights,
                                   fp8_min_elements=args.fp8_min_elements)
    except PlacementError as err:  # the placement --shard-experts asked for, not the checkpoint
        raise cli.UsageError(f"--shard-experts: {jax.device_count()} devices: {err}") from err
    except ValueError as err:  # what the checkpoint holds: its config, tensors, shards
        raise cli.flag_error(err, {"hf_dir": "--hf-dir"}, default=f"--hf-dir: {args.hf_dir}") from err
    copied = [name for name in TOKENIZER_FILES if (pathlib.Path(args.hf_dir) / name).is_file()]
    with staged_checkpoint_dir(args.out, overwrite=args.overwrite) as staging:
        write_checkpoint(model, staging)
        for name in copied:
            shutil.copy2(pathlib.Path(args.hf_dir) / name, staging / name)
    kind = f"{args.dtype}, FP8 linear kernels" if fp8_kernel_record(model) else args.dtype
    print(f"saved {param_count(model):,} parameters ({kind}) to {args.out}"
          + (f" with {', '.join(copied)}" if copied else " (no tokenizer files found beside the weights)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the conversion; returns the process exit code (0 ok, 2 bad input or out of memory)."""
    return cli.run(PROG, _convert, argv, out_of_memory_hint="convert with --shard-experts over more devices")


if __name__ == "__main__":
    sys.exit(main())
