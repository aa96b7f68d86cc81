"""The BF16 grouped GEMM (pallas_kernels/grouped_gemm_mgpu.py) against float64, interpreted on the
CPU and compiled under ``pytest -m gpu``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.backend import lower_for_cuda
from snapmla_jax.pallas_kernels.grouped_gemm_mgpu import (GroupedGemmConfig, grouped_gemm_mgpu,
                                                          grouped_gemm_reference, kernel_takes, pipeline_depth)


def _bf16_normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def _float64(x, w, matrices=None):
    """y[g] = x[g or 0] @ w[matrices[g]] in float64 on the bf16 values."""
    x64, w64 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w))
    chosen = w64 if matrices is None else w64[np.asarray(matrices)]
    return np.einsum("gmk,gkn->gmn", np.broadcast_to(x64, (chosen.shape[0], *x64.shape[1:])), chosen)


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


# The products are of bf16 values, exact in float32, summed in float32 over K <= 512 terms in an
# order that differs from float64's: each sum's error is ~K x 2^-24 of the sum of the terms'
# magnitudes (~1e-5 of the result at K = 512 with random signs), far below 1e-4. An outlier token
# (64x) and ragged group / matrix choices make a wrong row or column show at once.
REL_BOUND = 1e-4


@pytest.mark.parametrize("m,shared,matrices", [
    (16, True, (3, 0, 3, 1, 4)),   # gathered dispatch: all groups share the tokens, matrices by id, repeated
    (32, False, (2, 2, 0)),        # each group its own tokens
    (16, False, None),             # one group a matrix (G = E)
    (48, False, (4, -1, 0, -1)),   # sorted dispatch: chunks of tokens, negative ids skipped
])
def test_interpreted_gemm_matches_float64(m, shared, matrices):
    rng = np.random.default_rng(m + len(matrices or ()))
    experts, k, n = 5, 256, 128
    w = _bf16_normal(rng, (experts, k, n), 0.05)
    groups = experts if matrices is None else len(matrices)
    x = np.asarray(rng.standard_normal((1 if shared else groups, m, k)), np.float32)
    x[0, 1] *= 64.0  # an outlier token
    x = jnp.asarray(x, jnp.bfloat16)
    chosen = None if matrices is None else jnp.asarray(matrices, jnp.int32)
    got = grouped_gemm_mgpu(x, w, chosen, interpret=True)
    assert got.shape == (groups, m, n) and got.dtype == jnp.float32
    kept = slice(None) if matrices is None else np.asarray(matrices) >= 0  # skipped groups: rows unwritten
    want = _float64(x, w, matrices)[kept]
    assert _rel(np.asarray(got)[kept], want) < REL_BOUND
    reference = np.asarray(grouped_gemm_reference(x, w, chosen))
    assert _rel(reference[kept], want) < REL_BOUND
    if matrices is not None:
        assert not reference[~kept].any()  # the reference's skipped groups are zeros


def test_two_stacks_share_a_launch_and_the_splits_add_up():
    """Gate and up as a tuple of stacks, K = 512 cut into 4 splits (float32 partials XLA adds)."""
    rng = np.random.default_rng(7)
    w_gate, w_up = (_bf16_normal(rng, (4, 512, 64), 0.05) for _ in range(2))
    x = _bf16_normal(rng, (1, 16, 512))
    chosen = jnp.asarray([1, 3, 1], jnp.int32)
    gate, up = grouped_gemm_mgpu(x, (w_gate, w_up), chosen, config=GroupedGemmConfig(splits=4), interpret=True)
    assert _rel(gate, _float64(x, w_gate, chosen)) < REL_BOUND
    assert _rel(up, _float64(x, w_up, chosen)) < REL_BOUND


def test_launch_grid_keeps_cuda_z_within_its_cap_and_the_kernel_reads_either_order(monkeypatch):
    """V3's down projection on the sorted dispatch's 8192-token blocks (768 chunks of <= 128 tokens,
    7168 / 64 weight tiles) puts 86016 CTAs in CUDA's z in the order (g, n, s, m), past the 65535 a
    launch takes: the weight tiles go to x there, and nowhere else (the measured order stays).
    The kernel indexes the grid by name: with the cap lowered so that a small launch takes the other
    order, two stacks over groups of their own tokens (one skipped) still match float64."""
    from snapmla_jax.pallas_kernels import fp8_gemm_mgpu
    assert fp8_gemm_mgpu.launch_grid(768, 112, 1, 1) == ((768, 1, 1, 112), ("g", "s", "m", "n"))
    assert fp8_gemm_mgpu.launch_grid(2 * 768, 32, 1, 1) == ((1536, 32, 1, 1), ("g", "n", "s", "m"))
    with pytest.raises(ValueError, match="groups: 70000 groups x 1 splits"):
        fp8_gemm_mgpu.launch_grid(70000, 2, 1, 1)
    monkeypatch.setattr(fp8_gemm_mgpu, "GRID_YZ_MAX", 7)
    assert fp8_gemm_mgpu.launch_grid(3 * 2, 2, 1, 1)[1] == ("g", "s", "m", "n")  # 12 > 7
    rng = np.random.default_rng(11)
    w_gate, w_up = (_bf16_normal(rng, (4, 256, 128), 0.05) for _ in range(2))
    x = np.asarray(rng.standard_normal((3, 32, 256)), np.float32)
    x[1, 5] *= 64.0  # an outlier token
    x = jnp.asarray(x, jnp.bfloat16)
    chosen = jnp.asarray([3, -1, 0], jnp.int32)
    from snapmla_jax.pallas_kernels import grouped_gemm_mgpu as module
    orders = []
    monkeypatch.setattr(module, "launch_grid", lambda *a: orders.append(fp8_gemm_mgpu.launch_grid(*a)) or orders[-1])
    # One split (six groups in z); num_sms=7, a static argument no other test passes: traced anew under the cap.
    gate, up = grouped_gemm_mgpu(x, (w_gate, w_up), chosen, config=GroupedGemmConfig(splits=1), num_sms=7,
                                 interpret=True)
    assert [names for _, names in orders] == [("g", "s", "m", "n")]
    kept = np.asarray(chosen) >= 0
    for got, w in ((gate, w_gate), (up, w_up)):
        assert _rel(np.asarray(got)[kept], _float64(x, w, np.maximum(np.asarray(chosen), 0))[kept]) < REL_BOUND


@pytest.mark.gpu
def test_compiled_launch_past_cuda_z_cap_at_v3_down_projection_shapes():
    """The launch an H200 refused before ``launch_grid``: V3's down projection (256 experts of
    2048 x 7168) over 768 chunks of 128 tokens (the sorted dispatch at 8192 tokens), most chunks
    skipped; the kept ones against float64 (bound as above: K = 2048 terms)."""
    experts, k, n, groups = 256, 2048, 7168, 768
    w = jax.random.normal(jax.random.key(0), (experts, k, n), jnp.bfloat16) * jnp.bfloat16(0.02)
    x = jax.random.normal(jax.random.key(1), (groups, 128, k), jnp.bfloat16)
    kept = {0: 5, 400: 77, 767: 255}
    matrices = np.full(groups, -1, np.int32)
    for group, matrix in kept.items():
        matrices[group] = matrix
    got = grouped_gemm_mgpu(x, w, jnp.asarray(matrices))
    for group, matrix in kept.items():
        want = _float64(x[group][None], w[matrix][None])[0]
        assert _rel(np.asarray(got[group]), want) < REL_BOUND


def test_pipeline_depth_gives_way_to_shared_memory():
    assert pipeline_depth(GroupedGemmConfig(depth=4), 16) == 4
    # 128-token tiles: a slot is (64 + 128) x 128 x 2 bytes = 48 KiB beside a 32 KiB output tile.
    assert pipeline_depth(GroupedGemmConfig(depth=8), 128) == 4


def test_shapes_the_kernel_does_not_take_raise_value_error():
    rng = np.random.default_rng(0)
    w = _bf16_normal(rng, (2, 192, 64))
    assert not kernel_takes(16, 64, 192) and kernel_takes(16, 64, 256) and not kernel_takes(16, 96, 256)
    with pytest.raises(ValueError, match="K of 128"):
        grouped_gemm_mgpu(_bf16_normal(rng, (1, 16, 192)), w, interpret=True)
    with pytest.raises(ValueError, match="M a multiple of 16"):
        grouped_gemm_mgpu(_bf16_normal(rng, (1, 8, 256)), _bf16_normal(rng, (2, 256, 64)), interpret=True)
    with pytest.raises(ValueError, match="bf16 stacks"):
        grouped_gemm_mgpu(_bf16_normal(rng, (1, 16, 256)), jnp.zeros((2, 256, 64), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="groups of tokens"):
        grouped_gemm_mgpu(_bf16_normal(rng, (3, 16, 256)), _bf16_normal(rng, (2, 256, 64)), interpret=True)


def test_lowers_for_cuda_at_expert_shapes():
    """Mosaic GPU lowers both launches of the experts (gate + up, down) at V2-Lite's and V3's
    expert shapes without a GPU."""
    for experts, hidden, inner in [(64, 2048, 1408), (256, 7168, 2048)]:
        ids = jnp.zeros((8,), jnp.int32)
        gate_up = (jax.ShapeDtypeStruct((experts, hidden, inner), jnp.bfloat16),) * 2
        lower_for_cuda(lambda x, w, i: grouped_gemm_mgpu(x, w, i), jax.ShapeDtypeStruct((1, 16, hidden), jnp.bfloat16),
                       gate_up, ids)
        lower_for_cuda(lambda x, w, i: grouped_gemm_mgpu(x, w, i), jax.ShapeDtypeStruct((8, 16, inner), jnp.bfloat16),
                       jax.ShapeDtypeStruct((experts, inner, hidden), jnp.bfloat16), ids)


@pytest.mark.gpu
@pytest.mark.parametrize("m,shared", [(16, True), (64, False), (256, True)])
def test_compiled_gemm_matches_float64(m, shared):
    """Compiled on a Hopper GPU at V2-Lite's gate shape (K = 2048: float32 order ~1e-5 of the
    result), token tiles whole (16, 64) and of 128 (256 tokens)."""
    rng = np.random.default_rng(m)
    w = _bf16_normal(rng, (8, 2048, 1408), 0.02)
    chosen = jnp.asarray([5, 0, 5, 7], jnp.int32)
    x = _bf16_normal(rng, (1 if shared else 4, m, 2048))
    assert _rel(grouped_gemm_mgpu(x, w, chosen), _float64(x, w, chosen)) < REL_BOUND
