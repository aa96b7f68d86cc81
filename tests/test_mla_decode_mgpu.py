"""Mosaic GPU FP8 decode kernel (pallas_kernels/mla_decode_mgpu.py): experimental.

CPU: the V-transpose probe and the kernel lower for CUDA (Mosaic GPU layout
inference and SMEM allocation run without a GPU). GPU (``pytest -m gpu``): the
compiled kernel against ``mla_decode_reference(..., block_n=128)``.

The interpreter cannot run this kernel (it does not alias ``RefUnion`` views,
which the V transpose relies on), so its numbers are checked on the GPU only.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8 import quantize_per_token
from pallas_kernels.mla_decode import mla_decode_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
def _load_probe():
    spec = importlib.util.spec_from_file_location("probe_mgpu_transpose", ROOT / "scripts/probe_mgpu_transpose.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_transpose_probe_lowers_for_cuda():
    probe = _load_probe()
    p = jnp.zeros((64, 128), jnp.float8_e4m3fn)
    vp = jnp.zeros((64, 2, 128), jnp.uint8)
    jax.jit(lambda a, b: probe.build()(a, b)).trace(p, vp).lower(lowering_platforms=("cuda",))


def _inputs(seed, *, batch, heads, pages_per_row, seq_lens, s_q=1):
    """Random FP8 cache with outlier tokens, scrambled pages."""
    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_row + 2
    x = rng.standard_normal((num_pages, 64, 512)).astype(np.float32)
    x[rng.random((num_pages, 64)) < 0.02] *= 300.0  # outlier tokens: scales 300x apart
    latent, scale = quantize_per_token(jnp.asarray(x))
    rope = jnp.asarray(rng.standard_normal((num_pages, 64, 64)), jnp.bfloat16)
    block_table = jnp.asarray(rng.permutation(num_pages)[:batch * pages_per_row].reshape(batch, pages_per_row),
                              jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, s_q, heads, 512)) * 0.3, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((batch, s_q, heads, 64)) * 0.3, jnp.bfloat16)
    return q, q_rope, latent, scale, rope, block_table, jnp.asarray(seq_lens, jnp.int32)


def _call_kernel(q, q_rope, latent, scale, rope, block_table, seq_lens, softmax_scale, *, layer_pages=0,
                 interpret=False):
    """The kernel on the API's shapes: rows padded to 64, the cache flattened.

    ``layer_pages`` > 0 puts a layer of NaN pages in front of the cache and reads
    the second layer through ``layer_offset``, as a multi-layer cache does.
    """
    from pallas_kernels.mla_decode_mgpu import BLOCK_M, mla_decode_mgpu
    batch, s_q, heads, rank = q.shape
    rows = s_q * heads
    padded = -(-rows // BLOCK_M) * BLOCK_M
    to_rows = lambda a: jnp.pad(a.reshape(batch, rows, a.shape[-1]), [(0, 0), (0, padded - rows), (0, 0)])
    n = latent.shape[0] * latent.shape[1]
    cache = [latent.reshape(n, rank), scale.reshape(n), rope.reshape(n, 64)]
    if layer_pages:
        cache = [jnp.concatenate([jnp.full((layer_pages * 64, *a.shape[1:]), jnp.nan, a.dtype), a]) for a in cache]
    out, lse = mla_decode_mgpu(to_rows(q), to_rows(q_rope), tuple(cache), block_table, seq_lens,
                               jnp.full((1,), layer_pages * 64, jnp.int32), softmax_scale=softmax_scale,
                               page_size=64, s_q=s_q, num_heads=heads, interpret=interpret)
    return out[:, :rows].reshape(q.shape), lse[:, :rows].reshape(batch, s_q, heads)


@pytest.mark.parametrize("s_q", [1, 2])
def test_kernel_lowers_for_cuda(s_q):
    args = _inputs(0, batch=2, heads=64, pages_per_row=3, seq_lens=[100, 0], s_q=s_q)
    jax.jit(lambda *a: _call_kernel(*a, 0.1)).trace(*args).lower(lowering_platforms=("cuda",))


CASES = pytest.mark.parametrize("heads,s_q,seq_lens,layer_pages", [
    (64, 1, [100, 300, 0], 0),    # ragged, a partial page, seq_len 0
    (128, 1, [129, 64, 1], 3),    # a 1-token last step; a second layer (NaN first layer) via layer_offset
    (16, 2, [200, 2, 77], 0),     # s_q = 2 (causal rule), H padded to 64 rows
])


def _check(heads, s_q, seq_lens, layer_pages, *, interpret):
    """Kernel vs ``mla_decode_reference(block_n=128)``; returns (max error / max |ref|, max lse error, lse scale)."""
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(heads + s_q, batch=3, heads=heads, pages_per_row=5,
                                                                seq_lens=seq_lens, s_q=s_q)
    softmax_scale = 576 ** -0.5
    out, lse = _call_kernel(q, q_rope, latent, scale, rope, block_table, lens, softmax_scale,
                            layer_pages=layer_pages, interpret=interpret)
    # The reference rounds Q and P' to e4m3 as the kernel does (P' factor per
    # 128-token step), with exact products, on the same pages without a layer offset.
    ref, ref_lse = mla_decode_reference(q, q_rope, latent, scale, rope, block_table, lens,
                                        softmax_scale=softmax_scale, block_n=128)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    seen = np.asarray(lens) > 0
    assert np.all(out[~seen] == 0)
    assert np.all(np.isneginf(lse[~seen]))
    err = np.max(np.abs(out[seen] - ref[seen])) / np.max(np.abs(ref[seen]))
    return err, float(np.max(np.abs(lse[seen] - ref_lse[seen]))), float(np.max(np.abs(ref_lse[seen])))


@CASES
def test_kernel_interpreted_matches_reference(heads, s_q, seq_lens, layer_pages):
    """On CPU: paging through the token-pair views, step order, masking, s_q, layer offset.

    Not covered here: the V transpose and the P' packing (RefUnion views the
    interpreter does not alias); the GPU test below covers them.
    """
    err, lse_err, _ = _check(heads, s_q, seq_lens, layer_pages, interpret=True)
    # Same roundings in fp32 on both sides: what differs is summation order, which
    # can move a P' value across an e4m3 rounding boundary (one ulp, 2**-3
    # relative, on one weight of >= 100), plus the bf16 output (2**-9): 4e-3.
    assert err < 4e-3, err
    assert lse_err < 1e-4, lse_err  # fp32 log-sum-exp of O(10) values, different order


@pytest.mark.gpu
@CASES
def test_kernel_matches_reference(heads, s_q, seq_lens, layer_pages):
    err, lse_err, lse_scale = _check(heads, s_q, seq_lens, layer_pages, interpret=False)
    # As in the interpreter, plus Hopper's FP8 MMA accumulating Q.K in ~14 bits
    # (test_mla_decode_gpu.py): scores move by ~2**-9 of their magnitude, which
    # shifts P' roundings more often: 2e-2 of the largest output.
    assert err < 2e-2, err
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)
