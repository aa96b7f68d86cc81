"""Where a model's arrays go as they are loaded: one placement rule shared by the
orbax loader (``load_checkpoint``) and the Hugging Face loader (``load_hf_checkpoint``).

A placement is given as ``sharding=``:

* None: every array on this process's first device (``jax.local_devices()[0]``: the default
  device; under ``jax.distributed``, the first of its own);
* one ``jax.sharding.Sharding`` for every array;
* a function ``(path, jax.ShapeDtypeStruct) -> Sharding`` (or None for the default
  device), called once per array with its path in the model's state, e.g.
  ``"layers/0/mlp/w_gate"`` (the names ``save_checkpoint`` writes; a block-FP8 weight is
  two arrays, ``"<path>/values"`` and ``"<path>/scales"``).

A function may split, say, the stacked expert weights [E, ...] over a mesh axis
and replicate the rest (``expert_sharding``), so that a model larger than one
device's memory loads straight onto a mesh, each device receiving only its shards.
``shard_model`` places a model already in memory the same way.
"""

from __future__ import annotations

from typing import Callable, Union

import jax
import numpy as np
from flax import nnx

from snapmla_jax.models.layers import EXPERT_WEIGHTS
from snapmla_jax.models.moe import match_dispatch_to_placement


ParamSharding = Union[jax.sharding.Sharding, Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding], None]


class PlacementError(ValueError):
    """A ``sharding=`` that is not a placement, or that does not fit one of the model's arrays."""


def param_path(path: tuple) -> str:
    """A state path as a string: ("layers", 0, "mlp", "w_gate") -> "layers/0/mlp/w_gate"."""
    return "/".join(str(k) for k in path)


def key_name(key) -> str:
    """The name of one key of a ``jax.tree_util`` key path (a dict key, an attribute, an index)."""
    return str(getattr(key, "key", getattr(key, "name", key)))


def flat_arrays(state: nnx.State) -> dict[str, jax.Array]:
    """Every array of ``state`` by its path string: "layers/0/self_attn/w_uk", and for a
    ``BlockFP8Weight`` kernel its leaves "…/kernel/values" and "…/kernel/scales". Abstract
    states give their ShapeDtypeStructs. The order is ``jax.tree`` order, as
    ``fill_arrays`` expects."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {"/".join(key_name(k) for k in path): leaf for path, leaf in leaves}


def fill_arrays(state: nnx.State, arrays: dict[str, jax.Array]) -> None:
    """Put ``arrays`` (keyed as ``flat_arrays(state)``, every key present) into ``state`` in place."""
    structure = jax.tree.structure(nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(structure, [arrays[p] for p in flat_arrays(state)]))


def resolve_sharding(sharding: ParamSharding, path: str, shape: tuple[int, ...], dtype) -> jax.sharding.Sharding:
    """The ``jax.sharding.Sharding`` the array at ``path`` (``shape``, ``dtype``) goes to under
    ``sharding`` (see the module docstring).

    Raises PlacementError (a ValueError) naming ``sharding`` when it is neither None, a
    Sharding nor a callable, when the callable returns something other than a Sharding or
    None for ``path``, or when the placement does not fit the array (a split axis that the
    mesh does not divide, a spec longer than the array's rank).
    """
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return _fitting(sharding, path, shape)
    if not callable(sharding):
        raise PlacementError(f"sharding: expected None, a jax.sharding.Sharding or a function "
                             f"(path, ShapeDtypeStruct) -> Sharding, got {type(sharding).__name__}")
    chosen = sharding(path, jax.ShapeDtypeStruct(tuple(shape), dtype))
    if chosen is None:
        return resolve_sharding(None, path, shape, dtype)
    if not isinstance(chosen, jax.sharding.Sharding):
        raise PlacementError(f"sharding: the function returned {type(chosen).__name__} for {path}, "
                             f"expected a jax.sharding.Sharding or None")
    return _fitting(chosen, path, shape)


def _fitting(target: jax.sharding.Sharding, path: str, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """``target``, after checking that it can hold an array of ``shape`` (a PlacementError naming
    ``sharding`` and ``path`` before any data moves, rather than deep inside a transfer)."""
    try:
        check_rank = getattr(target, "check_compatible_aval", None)  # JAX's shardings have it
        if check_rank is not None:
            check_rank(tuple(shape))  # a spec longer than the array's rank
        target.shard_shape(tuple(shape))  # a split axis that the mesh does not divide
    except (ValueError, IndexError) as err:
        raise PlacementError(f"sharding: {target} does not fit {path} of shape {list(shape)}: {err}") from err
    return target


def expert_sharding(mesh: jax.sharding.Mesh | None = None, axis: str = "expert"
                    ) -> Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding]:
    """A ``sharding=`` function that splits every stacked expert weight [E, ...] by expert over
    ``mesh``'s ``axis`` and replicates every other array on the mesh (expert parallelism: the
    experts hold most of a DeepSeek MoE's weights). ``mesh`` None: a 1-D mesh named ``axis``
    over all of ``jax.devices()``. The number of experts must be a multiple of the axis size
    (else the loaders raise PlacementError naming ``sharding``)."""
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()), (axis,))
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {mesh.axis_names}")
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return lambda path, leaf: split if expert_weight_name(path) in EXPERT_WEIGHTS else replicated


def expert_weight_name(path: str) -> str:
    """The parameter name of an array's path: its last part, or for a block-FP8 weight's leaves
    ("layers/1/mlp/w_gate/values", ".../scales") the part before."""
    parts = path.split("/")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("values", "scales") else parts[-1]


def shard_model(model: nnx.Module, sharding: ParamSharding) -> nnx.Module:
    """A copy of ``model`` with every array placed where ``sharding`` puts it (the loaders'
    ``sharding=``, e.g. ``expert_sharding()``), for a model already in memory; ``model`` itself
    is left as it was. Raises PlacementError as ``resolve_sharding``, before anything moves."""
    graphdef, state = nnx.split(model)
    flat = flat_arrays(state)
    targets = {path: resolve_sharding(sharding, path, leaf.shape, leaf.dtype) for path, leaf in flat.items()}
    fill_arrays(state, {path: _put(leaf, targets[path]) for path, leaf in flat.items()})
    return merge_placed(graphdef, state)


def _put(leaf: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
    """``leaf`` placed by ``target``. An array on this process's devices going to a placement
    over several processes' devices (``jax.distributed``) goes through host memory: every process
    holds the same model and hands over its own copy, as ``device_put`` of a host array expects
    (a backend without cross-host transfers refuses the direct move)."""
    if getattr(leaf, "is_fully_addressable", True) and not target.is_fully_addressable:
        return jax.device_put(np.asarray(leaf), target)
    return jax.device_put(leaf, target)


def merge_placed(graphdef, state) -> nnx.Module:
    """``nnx.merge`` of a model whose arrays a placement has put on their devices, with each MoE
    layer's dispatch fitted to where its experts went (``models.moe.match_dispatch_to_placement``)."""
    model = nnx.merge(graphdef, state)
    match_dispatch_to_placement(model)
    return model
