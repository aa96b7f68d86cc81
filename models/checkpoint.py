"""orbax checkpoints of ``MLAModel``: the weights under ``<dir>/state`` and the
config beside them in ``<dir>/config.json``.

Layout::

    <dir>/state/        orbax StandardCheckpointer save of the model's state
                        (every nnx Variable, as a nested dict of arrays)
    <dir>/config.json   {"format": ..., "dtype": ..., "config": MLAConfig.to_dict(),
                         "arrays": {path: [shape, dtype]}}

config.json is written last, so a save that did not finish leaves a
directory ``load_checkpoint`` rejects as incomplete. The array manifest lets
the loader name a missing or mis-shaped array instead of failing inside orbax.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx, traverse_util

from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.sharding import ParamSharding, merge_placed, param_path, resolve_sharding
from snapmla_jax.models.transformer import MLAModel

CHECKPOINT_FORMAT = "snapmla-jax/mla-model/1"
CONFIG_FILE = "config.json"
STATE_DIR = "state"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete, corrupted or does not fit the model."""


def _flat_pure(state: nnx.State) -> dict[str, jax.Array]:
    """State -> {"layers/0/self_attn/w_uk": array, ...} (string keys: orbax wants them)."""
    return {param_path(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def save_checkpoint(model: MLAModel, ckpt_dir: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Save ``model``'s state and config to ``ckpt_dir`` (created; must not exist unless ``overwrite``).

    Raises ValueError for a non-MLAModel or an existing directory without ``overwrite``.
    """
    if not isinstance(model, MLAModel):
        raise ValueError(f"model: expected an MLAModel, got {type(model).__name__}")
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    if os.path.exists(ckpt_dir) and os.listdir(ckpt_dir):
        if not overwrite:
            raise ValueError(f"ckpt_dir: {ckpt_dir} exists and is not empty (pass overwrite=True to replace it)")
        config_path = os.path.join(ckpt_dir, CONFIG_FILE)
        if os.path.exists(config_path):
            os.remove(config_path)  # first, so an interrupted overwrite reads as incomplete
    os.makedirs(ckpt_dir, exist_ok=True)
    flat = _flat_pure(nnx.state(model))
    with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the write
        checkpointer.save(os.path.join(ckpt_dir, STATE_DIR), flat, force=overwrite)
        checkpointer.wait_until_finished()
    record = {
        "format": CHECKPOINT_FORMAT,
        "dtype": jnp.dtype(model.dtype).name,
        "config": model.cfg.to_dict(),
        "arrays": {path: [list(a.shape), jnp.dtype(a.dtype).name] for path, a in flat.items()},
    }
    with open(os.path.join(ckpt_dir, CONFIG_FILE), "w") as f:
        json.dump(record, f, indent=1)


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
        router's correction bias stays float32.
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
    abstract = nnx.eval_shape(lambda: MLAModel(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    wanted = _flat_pure(abstract_state)
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
    pure = traverse_util.unflatten_dict({tuple(int(k) if k.isdigit() else k for k in path.split("/")): value
                                         for path, value in restored.items()})
    nnx.replace_by_pure_dict(abstract_state, pure)
    return merge_placed(graphdef, abstract_state)
