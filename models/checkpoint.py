"""orbax checkpoints of ``MLAModel``: the weights under ``<dir>/state`` and the
config beside them in ``<dir>/config.json``.

Layout::

    <dir>/state/        orbax StandardCheckpointer save of the model's state
                        (every nnx Variable, as a nested dict of arrays)
    <dir>/config.json   {"format": ..., "dtype": ..., "config": MLAConfig.to_dict(),
                         "arrays": {path: [shape, dtype]},
                         "fp8_weights": {"block": [rows, cols], "kernels": [path, ...]}}

"fp8_weights" is present only for a model holding block-FP8 kernels
(``models.layers.quantize_weights``): each such kernel is saved as two arrays,
``<path>/values`` (float8_e4m3fn) and ``<path>/scales`` (float32), and restored as FP8.

config.json is written last, so a save that did not finish leaves a
directory ``load_checkpoint`` rejects as incomplete. The array manifest lets
the loader name a missing or mis-shaped array instead of failing inside orbax.

A directory is one of our checkpoints when its config.json has ``"format":
CHECKPOINT_FORMAT``: only such a directory is ever replaced (``overwrite=True``).
Saves are staged: the checkpoint is written into a new directory beside the
target (``.<name>.partial-<hex>``) and renamed into place once complete, so a
save that is interrupted leaves the target as it was (and the partial directory,
which can be deleted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
from typing import Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from snapmla_jax.fp8_weights import BlockFP8Weight
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.layers import fp8_eligible_weights, quantize_weights
from snapmla_jax.models.sharding import ParamSharding, fill_arrays, flat_arrays, merge_placed, resolve_sharding
from snapmla_jax.models.transformer import MLAModel

CHECKPOINT_FORMAT = "snapmla-jax/mla-model/1"
CONFIG_FILE = "config.json"
STATE_DIR = "state"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete, corrupted or does not fit the model,
    or a path a checkpoint may not be saved to."""


def fp8_kernel_record(model: nnx.Module) -> dict | None:
    """{"block": [rows, cols], "kernels": [path, ...]} of ``model``'s block-FP8 weights (linear
    kernels, w_uk / w_uv and routed-expert stacks, ``fp8_eligible_weights``), or None when it holds none.
    ValueError when they do not share one block shape."""
    kernels = {path: weight.get_value() for path, weight in fp8_eligible_weights(model).items()
               if isinstance(weight.get_value(), BlockFP8Weight)}
    if not kernels:
        return None
    blocks = {w.block for w in kernels.values()}
    if len(blocks) != 1:
        raise ValueError(f"model: FP8 kernels with different block shapes {sorted(blocks)}; one is supported")
    return {"block": list(blocks.pop()), "kernels": sorted(kernels)}


@dataclasses.dataclass(frozen=True)
class TargetProblem:
    """Why a path cannot receive a checkpoint: ``path`` followed by ``reason`` reads as a
    sentence; ``overwrite_helps``: replacing is allowed there when asked for."""

    path: str
    reason: str
    overwrite_helps: bool = False

    def message(self, name: str, overwrite: str) -> str:
        """One line naming the argument ``name`` ("ckpt_dir", "--out") and, where it would
        help, how to ask for a replacement (``overwrite``: "overwrite=True", "--overwrite")."""
        hint = f" (pass {overwrite} to replace it)" if self.overwrite_helps else ""
        return f"{name}: {self.path} {self.reason}{hint}"


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose config.json declares ``CHECKPOINT_FORMAT``: one of
    our checkpoints, complete or not (the only kind of directory a save may replace)."""
    try:
        with open(os.path.join(os.fspath(path), CONFIG_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("format") == CHECKPOINT_FORMAT


def target_problem(ckpt_dir: str | os.PathLike, *, overwrite: bool) -> TargetProblem | None:
    """None when a checkpoint can be saved to ``ckpt_dir``, else why not.

    Accepted: a path that does not exist (its parents are created), an empty directory,
    and with ``overwrite`` a directory holding one of our checkpoints (``is_checkpoint``).
    Refused: a file, a path below a file, an unwritable parent, a non-empty directory that
    is not one of our checkpoints (whatever ``overwrite`` says), and without ``overwrite``
    one of our checkpoints.
    """
    shown = os.fspath(ckpt_dir)  # as the caller wrote it
    path = os.path.abspath(shown)
    if os.path.lexists(path) and not os.path.isdir(path):
        return TargetProblem(shown, "is a file; expected a new or empty directory, or a snapmla-jax checkpoint "
                                    "to replace")
    if os.path.isdir(path) and os.listdir(path):
        if not is_checkpoint(path):
            return TargetProblem(shown, f"is a non-empty directory and not a snapmla-jax checkpoint (no {CONFIG_FILE} "
                                       f"with \"format\": \"{CHECKPOINT_FORMAT}\"); only those are replaced: "
                                       "choose a new or empty directory")
        if not overwrite:
            return TargetProblem(shown, "holds a snapmla-jax checkpoint", overwrite_helps=True)
    existing = path if os.path.isdir(path) else next(p for p in map(str, pathlib.Path(path).parents)
                                                    if os.path.lexists(p))
    if not os.path.isdir(existing):
        return TargetProblem(shown, f"cannot be created: {existing} is a file")
    parent = os.path.dirname(path) if existing == path else existing
    if not os.access(parent, os.W_OK | os.X_OK):
        return TargetProblem(shown, f"cannot be written: {parent} is not writable")
    return None


@contextlib.contextmanager
def staged_checkpoint_dir(ckpt_dir: str | os.PathLike, *, overwrite: bool = False) -> Iterator[pathlib.Path]:
    """A new empty directory beside ``ckpt_dir`` to write a checkpoint (and files to keep with
    it) into. Leaving the block normally renames it to ``ckpt_dir``, which an existing
    checkpoint there leaves only then; an exception deletes it and leaves ``ckpt_dir`` as it
    was. Raises CheckpointError (a ValueError) naming ``ckpt_dir`` when ``target_problem``
    refuses it, before anything is created."""
    problem = target_problem(ckpt_dir, overwrite=overwrite)
    if problem is not None:
        raise CheckpointError(problem.message("ckpt_dir", "overwrite=True"))
    target = os.path.abspath(os.fspath(ckpt_dir))
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    while True:
        tag = secrets.token_hex(4)
        staging = os.path.join(parent, f".{name}.partial-{tag}")
        try:
            os.mkdir(staging)
            break
        except FileExistsError:
            continue
    try:
        yield pathlib.Path(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    # Two renames: a directory cannot atomically replace a non-empty one. Between them the
    # old checkpoint sits at `old`, complete.
    old = os.path.join(parent, f".{name}.old-{tag}")
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(model: MLAModel, directory: str | os.PathLike) -> None:
    """Write ``model``'s state and config into ``directory``, an existing empty directory
    (``staged_checkpoint_dir`` gives one). No checks: ``save_checkpoint`` is the safe entry."""
    directory = os.fspath(directory)
    flat = flat_arrays(nnx.state(model))
    with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the write
        checkpointer.save(os.path.join(directory, STATE_DIR), flat)
        checkpointer.wait_until_finished()
    record = {
        "format": CHECKPOINT_FORMAT,
        "dtype": jnp.dtype(model.dtype).name,
        "config": model.cfg.to_dict(),
        "arrays": {path: [list(a.shape), jnp.dtype(a.dtype).name] for path, a in flat.items()},
    }
    fp8 = fp8_kernel_record(model)
    if fp8 is not None:
        record["fp8_weights"] = fp8
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(record, f, indent=1)


def save_checkpoint(model: MLAModel, ckpt_dir: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Save ``model``'s state and config to ``ckpt_dir``.

    ``ckpt_dir`` must be new or an empty directory, or with ``overwrite`` hold one of our
    checkpoints (``is_checkpoint``), which is replaced only once the new one is complete
    (``staged_checkpoint_dir``). Raises ValueError for a non-MLAModel, and CheckpointError
    (a ValueError) naming ``ckpt_dir`` for any other target (``target_problem``) before
    writing anything.
    """
    if not isinstance(model, MLAModel):
        raise ValueError(f"model: expected an MLAModel, got {type(model).__name__}")
    with staged_checkpoint_dir(ckpt_dir, overwrite=overwrite) as staging:
        write_checkpoint(model, staging)


def _read_record(ckpt_dir: str) -> dict:
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"ckpt_dir: {ckpt_dir} is not a directory")
    config_path = os.path.join(ckpt_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"ckpt_dir: {ckpt_dir} has no {CONFIG_FILE}: not a snapmla-jax checkpoint, "
                              "or its save did not finish")
    try:
        with open(config_path) as f:
            record = json.load(f)
        if record.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"ckpt_dir: {config_path} has format {record.get('format')!r}, "
                                  f"expected {CHECKPOINT_FORMAT!r}")
        record["config"] = MLAConfig.from_dict(record["config"])
        record["arrays"] = dict(record["arrays"])
        if "fp8_weights" in record:
            record["fp8_weights"] = {"block": tuple(int(n) for n in record["fp8_weights"]["block"]),
                                     "kernels": [str(p) for p in record["fp8_weights"]["kernels"]]}
        jnp.dtype(record["dtype"])
    except CheckpointError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"ckpt_dir: {config_path} is corrupted ({type(err).__name__}: {err})") from err
    if not os.path.isdir(os.path.join(ckpt_dir, STATE_DIR)):
        raise CheckpointError(f"ckpt_dir: {ckpt_dir} has no {STATE_DIR}/ directory: the weights are missing")
    return record


def load_checkpoint(ckpt_dir: str | os.PathLike, *, dtype=None, sharding: ParamSharding = None) -> MLAModel:
    """Restore a model saved by ``save_checkpoint``.

    Args:
      ckpt_dir: the checkpoint directory.
      dtype: parameter dtype to restore into (None: the saved one). The V3
        router's correction bias stays float32, and block-FP8 kernels stay FP8
        (their values float8_e4m3fn, their scales float32).
      sharding: where the arrays go: None (default device), one
        ``jax.sharding.Sharding`` for every array, or a function
        ``(path "layers/0/mlp/w_gate", ShapeDtypeStruct) -> Sharding``
        (``models.sharding``).

    Raises CheckpointError (a ValueError) naming the directory and the
    problem for a missing directory, config.json or state/, an unfinished
    save, a corrupted config, arrays missing from or mis-shaped in the saved
    state, or data orbax cannot read.
    """
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    record = _read_record(ckpt_dir)
    cfg: MLAConfig = record["config"]
    dtype = jnp.dtype(record["dtype"] if dtype is None else dtype)
    fp8 = record.get("fp8_weights")

    def build():
        model = MLAModel(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        return model if fp8 is None else quantize_weights(model, fp8["block"], paths=fp8["kernels"])

    try:
        abstract = nnx.eval_shape(build)
    except ValueError as err:  # kernels the config's model does not have
        raise CheckpointError(f"ckpt_dir: {ckpt_dir}: fp8_weights does not fit the config: {err}") from err
    graphdef, abstract_state = nnx.split(abstract)
    wanted = flat_arrays(abstract_state)
    saved = record["arrays"]
    missing = sorted(set(wanted) - set(saved))
    misshaped = sorted(p for p in wanted if p in saved and list(wanted[p].shape) != saved[p][0])
    if missing or misshaped:
        raise CheckpointError(f"ckpt_dir: {ckpt_dir}: the saved state does not fit its config: "
                              f"missing {missing[:8]}, mis-shaped {misshaped[:8]}")

    # Always name a target sharding (resolve_sharding's default is one device): without
    # one orbax restores onto the saved topology and refuses a checkpoint written on
    # another platform (GPU -> CPU).
    targets = {path: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                          sharding=resolve_sharding(sharding, path, leaf.shape, leaf.dtype))
               for path, leaf in wanted.items()}
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(os.path.join(ckpt_dir, STATE_DIR), targets)
    except Exception as err:  # orbax/tensorstore raise many types; report them as one clear error
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        first_line = first_line.split(" See full TensorStore details")[0]
        raise CheckpointError(f"ckpt_dir: {ckpt_dir}: cannot read the saved weights "
                              f"({type(err).__name__}: {first_line[:300]})") from err
    fill_arrays(abstract_state, restored)
    return merge_placed(graphdef, abstract_state)
