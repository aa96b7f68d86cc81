"""Data-parallel attention with expert parallelism: a model's serving calls over a 1-D mesh.

The layout DeepSeek-style models are served with. On a mesh of N devices (one axis):

* each device holds the KV caches of its own B / N rows of the batch (its own page pool:
  the caches' page axis is split over the mesh, and a row's block table holds page ids of its
  device's pool) and runs their attention, the write and ``mla_decode`` unchanged on local
  arrays;
* the routed experts are split over the same devices (E / N each, ``expert_sharding``); a MoE
  layer gathers every device's tokens, runs its own experts and hands each device back its
  tokens' sums (``models.moe``, expert parallelism);
* everything else (embeddings, attention projections, dense MLPs, shared experts, norms, the
  LM head) is replicated and runs on each device's own rows.

``row_sharded`` runs ``MLAModel.prefill`` / ``decode`` that way inside ``jax.shard_map``; the
batch, lengths, block table and caches enter split along their leading axis, and the logits and
caches leave the same way. ``snapmla_jax.generate`` uses it when given ``mesh=``.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from snapmla_jax.models.layers import EXPERT_WEIGHTS
from snapmla_jax.models.moe import moe_layers
from snapmla_jax.models.sharding import PlacementError, expert_sharding, key_name, shard_model


def mesh_axis(mesh) -> str:
    """The axis name of a 1-D ``jax.sharding.Mesh``; ValueError naming ``mesh`` otherwise."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh: expected a 1-D jax.sharding.Mesh, got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh: expected one axis (the batch rows and the experts split over it), "
                         f"got axes {mesh.axis_names}")
    return mesh.axis_names[0]


def place_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """A copy of ``model`` for ``row_sharded`` calls on ``mesh``: routed expert weights split by
    expert over its axis, every other array replicated (arrays already placed so do not move),
    and each MoE layer set to run its experts in parallel over that axis (``MoE.expert_axis``),
    the top of its ``dense_token_range`` times the devices.
    ValueError naming ``mesh`` when the devices do not divide the routed experts."""
    axis = mesh_axis(mesh)
    try:
        placed = shard_model(model, expert_sharding(mesh, axis))
    except PlacementError as err:
        experts = getattr(getattr(model, "cfg", None), "n_routed_experts", None)
        raise ValueError(f"mesh: {mesh.size} devices must divide the model's {experts} routed experts "
                         f"(each device holds an equal share): {err}") from err
    for layer in moe_layers(placed):
        layer.expert_axis = axis
        if layer.dense_token_range is not None:
            # A layer here sees the gathered batch, N x the tokens, on E / N experts: its dense
            # dispatch's activations [E / N, T, inner] at N x the top are one device's at the top.
            # Past the top the ragged dispatch runs far slower (2 x H200, V2-Lite shapes, 784
            # gathered tokens, 16k context: 130 ms a decode step ragged, 53.9 dense).
            low, high = layer.dense_token_range
            layer.dense_token_range = (low, high * mesh.size)
    return placed


def param_spec(path: tuple, axis: str) -> PartitionSpec:
    """The ``PartitionSpec`` of the model-state array at ``path`` (a ``jax.tree_util`` key path of
    ``nnx.split``'s params) as ``place_model`` lays it out: a stacked expert weight (or a
    block-FP8 stack's values and scales) split along its expert axis, any other array whole."""
    names = {key_name(key) for key in path}
    return PartitionSpec(axis) if names & set(EXPERT_WEIGHTS) else PartitionSpec()


def param_specs(params, axis: str):
    """``param_spec`` of every array of a model state, as a tree of its structure."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_spec(path, axis), params)


def row_sharded(method: str, graphdef, mesh: jax.sharding.Mesh, **kwargs) -> Callable:
    """``fn(params, *row_args)``: ``MLAModel.<method>(*row_args, **kwargs)`` of the model
    ``nnx.merge(graphdef, params)`` (placed by ``place_model``) run on each device of ``mesh``
    over its share of the rows. Every array of ``row_args`` (input ids, lengths, caches, block
    table) and of the result is split along its leading axis, the batch's rows or the caches'
    pages; each device's block table addresses its own pages."""
    axis = mesh_axis(mesh)
    rows = PartitionSpec(axis)

    def call(params, *row_args):
        def body(local_params, *local_args):
            return getattr(nnx.merge(graphdef, local_params), method)(*local_args, **kwargs)
        # check_vma off: the Pallas kernels inside (the cache write, the decode kernels) do not
        # declare how their outputs vary over the mesh.
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs(params, axis), *(rows,) * len(row_args)),
                             out_specs=rows, check_vma=False)(params, *row_args)
    return call


def rows_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Arrays split along their leading axis over ``mesh`` (batch rows, cache pages)."""
    return NamedSharding(mesh, PartitionSpec(mesh_axis(mesh)))


def create_caches(model, pages_per_device: int, page_size: int, kv_cache: str, mesh: jax.sharding.Mesh) -> tuple:
    """``model.init_cache`` with ``pages_per_device`` pages on each device of ``mesh``: each
    layer's arrays [N * pages_per_device, page_size, ...], split along the page axis, each
    device making its own pool (no device holds the whole; the kernels' int32 bound on one
    cache array applies to a device's pool, which is what they address)."""
    axis = mesh_axis(mesh)
    make = jax.shard_map(lambda: model.init_cache(pages_per_device, page_size, kv_cache=kv_cache), mesh=mesh,
                         in_specs=(), out_specs=PartitionSpec(axis), check_vma=False)
    return jax.jit(make)()


def padded_rows(batch: int, mesh: jax.sharding.Mesh) -> int:
    """Rows of a batch of ``batch`` on ``mesh``: the next multiple of its size (the padding rows
    are decoded and dropped)."""
    return -(-batch // mesh.size) * mesh.size


def mesh_of(devices: int) -> jax.sharding.Mesh:
    """A 1-D mesh named "data" over the first ``devices`` of ``jax.devices()``."""
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
