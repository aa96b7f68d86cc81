"""quant_error_report: the four schemes, on data shaped like MLA's keys."""

import numpy as np
import pytest

from snapmla_jax import quant_error_report
from snapmla_jax.quant_report import SCHEMES


def _wide_rope_keys(rng, n=512):
    """Latent ~ N(0,1) with a few outlier tokens; RoPE keys up to ~100 (as in trained MLA)."""
    latent = rng.standard_normal((n, 512))
    latent[rng.choice(n, 8, replace=False)] *= 20.0
    rope = rng.standard_normal((n, 64)) * rng.uniform(0.5, 100.0, (1, 64))
    return latent, rope


def test_rope_aware_beats_rope_in_fp8_clearly():
    rng = np.random.default_rng(1)
    report = quant_error_report(*_wide_rope_keys(rng))
    ours, fp8_rope = report["rope_aware_token"], report["per_token_576"]
    # bf16 keeps 8 significant bits against e4m3's 4: the worst-case rounding
    # error drops 2**4-2**5 times and the RMS error ~15x (measured 14.5x here);
    # demand 8x on the RoPE part and 4x on the whole key (dominated by its norm).
    assert ours.rel_error * 4 < fp8_rope.rel_error
    assert ours.rope_rel_error * 8 < fp8_rope.rope_rel_error


def test_errors_are_within_fp8_rounding_and_ordered_by_granularity():
    rng = np.random.default_rng(2)
    report = quant_error_report(*_wide_rope_keys(rng))
    for scheme in SCHEMES:
        row = report[scheme]
        # Round-to-nearest e4m3 errs by <= 2**-4 relative per normal value; a
        # norm-wise error above that means a wrong scale, not rounding.
        assert 0 < row.latent_rel_error < 2**-4 * 1.5, scheme
    # Finer scales never lose range: block-128 <= per token on the latent, up to rounding noise.
    assert report["per_token_block128"].latent_rel_error <= report["rope_aware_token"].latent_rel_error * 1.02
    assert report["rope_aware_token"].bytes_per_token == 644


def test_matches_a_direct_float64_computation_for_ours():
    import ml_dtypes
    rng = np.random.default_rng(3)
    latent, rope = _wide_rope_keys(rng, 64)
    scale = np.abs(latent).max(-1, keepdims=True) / 448.0
    lat_hat = (latent / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    rope_hat = rope.astype(ml_dtypes.bfloat16).astype(np.float64)
    err = np.concatenate([lat_hat - latent, rope_hat - rope], -1)
    expected = np.linalg.norm(err) / np.linalg.norm(np.concatenate([latent, rope], -1))
    assert quant_error_report(latent, rope)["rope_aware_token"].rel_error == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("latent_shape, rope_shape, name", [
    ((8, 500), (8, 64), "latent"),
    ((8, 512), (7, 64), "k_rope"),
])
def test_rejects_bad_shapes_by_name(latent_shape, rope_shape, name):
    with pytest.raises(ValueError, match=name):
        quant_error_report(np.ones(latent_shape), np.ones(rope_shape))
