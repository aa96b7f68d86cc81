"""Where a model's arrays go as they are loaded: one placement rule shared by the
orbax loader (``load_checkpoint``) and the Hugging Face loader (``load_hf_checkpoint``).

A placement is given as ``sharding=``:

* None: every array on the default device (``jax.devices()[0]``);
* one ``jax.sharding.Sharding`` for every array;
* a function ``(path, jax.ShapeDtypeStruct) -> Sharding`` (or None for the default
  device), called once per array with its path in the model's state, e.g.
  ``"layers/0/mlp/w_gate"`` (the names ``save_checkpoint`` writes).

A function may split, say, the stacked expert weights [E, ...] over a mesh axis
and replicate the rest, so that a model larger than one device's memory loads
straight onto a mesh, each device receiving only its shards.
"""

from __future__ import annotations

from typing import Callable, Union

import jax

ParamSharding = Union[jax.sharding.Sharding, Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding], None]


def param_path(path: tuple) -> str:
    """A state path as a string: ("layers", 0, "mlp", "w_gate") -> "layers/0/mlp/w_gate"."""
    return "/".join(str(k) for k in path)


def resolve_sharding(sharding: ParamSharding, path: str, shape: tuple[int, ...], dtype) -> jax.sharding.Sharding:
    """The ``jax.sharding.Sharding`` the array at ``path`` (``shape``, ``dtype``) goes to under
    ``sharding`` (see the module docstring).

    Raises ValueError naming ``sharding`` when it is neither None, a Sharding nor a callable,
    when the callable returns something other than a Sharding or None for ``path``, or when
    the placement does not fit the array (a split axis that the mesh does not divide, a spec
    longer than the array's rank).
    """
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return _fitting(sharding, path, shape)
    if not callable(sharding):
        raise ValueError(f"sharding: expected None, a jax.sharding.Sharding or a function "
                         f"(path, ShapeDtypeStruct) -> Sharding, got {type(sharding).__name__}")
    chosen = sharding(path, jax.ShapeDtypeStruct(tuple(shape), dtype))
    if chosen is None:
        return resolve_sharding(None, path, shape, dtype)
    if not isinstance(chosen, jax.sharding.Sharding):
        raise ValueError(f"sharding: the function returned {type(chosen).__name__} for {path}, "
                         f"expected a jax.sharding.Sharding or None")
    return _fitting(chosen, path, shape)


def _fitting(target: jax.sharding.Sharding, path: str, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """``target``, after checking that it can hold an array of ``shape`` (a ValueError naming
    ``sharding`` and ``path`` before any data moves, rather than deep inside a transfer)."""
    try:
        check_rank = getattr(target, "check_compatible_aval", None)  # JAX's shardings have it
        if check_rank is not None:
            check_rank(tuple(shape))  # a spec longer than the array's rank
        target.shard_shape(tuple(shape))  # a split axis that the mesh does not divide
    except (ValueError, IndexError) as err:
        raise ValueError(f"sharding: {target} does not fit {path} of shape {list(shape)}: {err}") from err
    return target

