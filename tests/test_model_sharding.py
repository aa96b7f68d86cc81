"""models.sharding: how ``sharding=`` resolves to a placement per model array, and its errors.
(Loading onto a two-device mesh is tested with the loaders: test_model_checkpoint.py and
test_model_hf.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from snapmla_jax.models.sharding import PlacementError, expert_sharding, param_path, resolve_sharding, shard_model

MESH = Mesh(np.array(jax.devices()[:1]), ("model",))


def test_param_path_joins_names_and_layer_indices():
    assert param_path(("layers", 0, "mlp", "w_gate")) == "layers/0/mlp/w_gate"


def test_none_places_on_the_default_device():
    assert resolve_sharding(None, "embed_tokens/embedding", (8, 4), jnp.float32) == \
        jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_one_sharding_serves_every_array():
    sharding = NamedSharding(MESH, P())
    assert resolve_sharding(sharding, "a", (3,), jnp.float32) is sharding
    assert resolve_sharding(sharding, "b", (2, 5), jnp.bfloat16) is sharding


def test_a_function_sees_each_path_with_its_shape_and_dtype():
    seen = []
    split = NamedSharding(MESH, P("model"))

    def by_path(path, leaf):
        seen.append((path, leaf.shape, leaf.dtype))
        return split if path.endswith("w_gate") else None  # None: the default device

    assert resolve_sharding(by_path, "layers/1/mlp/w_gate", (8, 4, 6), jnp.bfloat16) is split
    assert resolve_sharding(by_path, "norm/scale", (4,), jnp.float32) == \
        jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert seen == [("layers/1/mlp/w_gate", (8, 4, 6), jnp.bfloat16), ("norm/scale", (4,), jnp.float32)]


@pytest.mark.parametrize("sharding, message", [
    ("cuda:0", r"sharding: expected None, a jax.sharding.Sharding or a function .* got str"),
    (lambda path, leaf: jax.devices()[0], r"sharding: the function returned \w*Device for layers/0/x"),
    (NamedSharding(MESH, P(None, None, None)), r"sharding: .* does not fit layers/0/x of shape \[4, 4\]"),
])
def test_bad_placements_are_named(sharding, message):
    with pytest.raises(ValueError, match=message):
        resolve_sharding(sharding, "layers/0/x", (4, 4), jnp.float32)


def test_expert_sharding_splits_the_expert_stacks_and_replicates_the_rest():
    by_path = expert_sharding(MESH, "model")
    leaf = jax.ShapeDtypeStruct((8, 4, 6), jnp.bfloat16)
    for name in ("w_gate", "w_up", "w_down"):
        assert by_path(f"layers/1/mlp/{name}", leaf) == NamedSharding(MESH, P("model"))
    for path in ("layers/1/mlp/gate/kernel", "layers/0/self_attn/w_uk", "embed_tokens/embedding"):
        assert by_path(path, leaf) == NamedSharding(MESH, P())


def test_expert_sharding_defaults_to_every_device_and_names_a_missing_axis():
    by_path = expert_sharding()
    assert by_path("layers/1/mlp/w_up", None).mesh.devices.tolist() == jax.devices()
    with pytest.raises(ValueError, match=r"axis: 'tp' is not an axis of the mesh \('model',\)"):
        expert_sharding(MESH, "tp")


def test_shard_model_places_a_copy_and_leaves_the_model_as_it_was():
    from flax import nnx

    model = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
    replicated = NamedSharding(MESH, P())
    placed = shard_model(model, lambda path, leaf: replicated if path == "kernel" else None)
    assert placed.kernel[...].sharding == replicated
    assert placed.bias[...].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(placed.kernel[...]), np.asarray(model.kernel[...]))
    assert placed is not model and placed.kernel is not model.kernel
    with pytest.raises(PlacementError, match=r"sharding: .* does not fit (bias|kernel) of shape"):
        shard_model(model, NamedSharding(MESH, P(None, None, None)))
