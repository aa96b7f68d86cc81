"""models.layers.Linear: a one-row input is multiplied as two rows (XLA's GPU compiler turns a
one-row product into a slow multiply + reduce), with the product of the row itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from snapmla_jax.models.layers import Linear, linear


def _dot_lhs_shapes(layer, x) -> list[tuple[int, ...]]:
    jaxpr = jax.make_jaxpr(lambda x: layer(x))(x)
    return [tuple(eqn.invars[0].aval.shape) for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"]


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 48), (48,), (3, 1, 48), (2, 5, 48)])
def test_linear_matches_float64_for_any_leading_shape(shape):
    """float32 weights and inputs: only the float32 sum of 48 products differs from float64
    (~1e-7 relative a value): 1e-5 of the output scale."""
    layer = linear(48, 40, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert isinstance(layer, Linear)
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    with jax.default_matmul_precision("float32"):
        out = layer(x)
    want = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
    assert out.shape == (*shape[:-1], 40) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5 * np.abs(want).max())


def test_one_row_is_multiplied_as_two_rows_and_more_rows_as_they_are():
    layer = linear(48, 40, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert _dot_lhs_shapes(layer, jnp.ones((1, 1, 48), jnp.bfloat16)) == [(2, 48)]
    assert _dot_lhs_shapes(layer, jnp.ones((3, 1, 48), jnp.bfloat16)) == [(3, 1, 48)]
