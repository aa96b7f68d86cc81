"""Block-FP8 weights: quantize_blocks against a float64 reference, the product with them,
FP8 kernels in the model (quantize_weights, the Hugging Face loader's fp8_weights=True, orbax,
the convert CLI)."""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_tiny import HF_MOE_CONFIG, write_tiny_hf_checkpoint
from snapmla_jax.convert import main as convert_main
from snapmla_jax import fp8_weights
from snapmla_jax.fp8_weights import (FP8_E4M3_MAX, BlockFP8Weight, QuantizedTokens, dequantize_weight, fp8_matmul,
                                     kernel_quantization, quantize_blocks)
from snapmla_jax.models import (MLAConfig, MLAModel, load_checkpoint, load_hf_checkpoint, quantize_weights,
                                save_checkpoint)
from snapmla_jax.models.hf_loader import SafetensorsFile
from snapmla_jax.models.attention import per_head_fp8_product
from snapmla_jax.models import layers as layers_module
from snapmla_jax.models.layers import fp8_eligible_weights, fp8_layout, is_absorbed_weight, weight_elements
from snapmla_jax.models.transformer import param_bytes
from snapmla_jax.models.moe import default_sorted_min_tokens, set_sorted_min_tokens

# e4m3 keeps 3 fraction bits: round-to-nearest moves a normal value by at most 2**-4 of itself.
# Below the smallest normal (2**-6) the spacing is 2**-9, so a subnormal moves by at most 2**-10
# (in units of the block's scale). w / scale is formed in float32 (2**-24 relative) first.
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL_ABS = 2.0 ** -10
BLOCK = (16, 16)
CFG = MLAConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=24,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
                norm_topk_prob=True, routed_scaling_factor=2.5)
TOKENS = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) * 5 % 64)


def reference_dequantize(w: BlockFP8Weight) -> np.ndarray:
    """values * scale per block in float64, edge blocks cropped; [..., out, in] stacks alike."""
    values = np.asarray(w.values).astype(np.float64)
    scales = np.asarray(w.scales, np.float64)
    full = np.repeat(np.repeat(scales, w.block[0], axis=-2), w.block[1], axis=-1)
    return values * full[..., :values.shape[-2], :values.shape[-1]]


def block_scale_of_each_element(w: BlockFP8Weight) -> np.ndarray:
    full = np.repeat(np.repeat(np.asarray(w.scales, np.float64), w.block[0], axis=0), w.block[1], axis=1)
    return full[:w.shape[0], :w.shape[1]]


def weight_with_zero_and_outlier_blocks(shape, block, seed=0) -> np.ndarray:
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w[:block[0], :block[1]] = 0.0                      # a block of zeros
    w[block[0]:2 * block[0], :block[1]] *= 1e4         # a block far above the rest
    w[:block[0], block[1]:2 * block[1]] *= 1e-4        # and one far below
    w[-1, -1] = 3e3                                    # an outlier inside the ragged corner block
    return w


@pytest.mark.parametrize("shape, block", [((200, 300), (128, 128)), ((40, 24), (16, 16)), ((256, 128), (128, 128))])
def test_quantize_blocks_is_within_the_e4m3_bound_of_a_float64_reference(shape, block):
    w = weight_with_zero_and_outlier_blocks(shape, block)
    q = quantize_blocks(jnp.asarray(w), block)
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == shape
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    err = np.abs(reference_dequantize(q) - w.astype(np.float64))
    bound = (E4M3_REL + 2.0 ** -20) * np.abs(w) + E4M3_SUBNORMAL_ABS * block_scale_of_each_element(q)
    assert np.all(err <= bound), float(np.max(err - bound))


def test_each_nonzero_block_maps_its_amax_onto_448_and_a_zero_block_stays_zero():
    w = weight_with_zero_and_outlier_blocks((40, 24), BLOCK)
    q = quantize_blocks(jnp.asarray(w), BLOCK)
    values = np.asarray(q.values).astype(np.float32)
    assert np.all(np.isfinite(values))
    assert float(q.scales[0, 0]) == 0.0 and not values[:16, :16].any()
    block_amax = np.array([[np.abs(values[r:r + 16, c:c + 16]).max() for c in range(0, 24, 16)]
                           for r in range(0, 40, 16)])
    assert np.all(block_amax[np.asarray(q.scales) > 0] == FP8_E4M3_MAX)


def test_quantize_blocks_rejects_a_non_matrix_and_a_bad_block():
    with pytest.raises(ValueError, match="w: expected a float matrix"):
        quantize_blocks(jnp.ones((4,)))
    with pytest.raises(ValueError, match="w: expected a float matrix"):
        quantize_blocks(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="block"):
        quantize_blocks(jnp.ones((4, 4)), (0, 16))


# x @ W with W dequantized in float32 (values have 4 significant bits, scales 24: one rounding,
# 2**-24 relative) and accumulated over K terms in float32: |error| <= (K + 1) 2**-24 sum |x||W|.
# In bfloat16 (7 fraction bits: 2**-8 relative rounding) the weight is rounded once more and so
# is the output (2**-8 of |out| <= sum |x||W|): |error| <= (2**-7 + (K + 1) 2**-24) sum |x||W|.
@pytest.mark.parametrize("dtype, rel", [(jnp.float32, lambda k: (k + 1) * 2.0 ** -24),
                                        (jnp.bfloat16, lambda k: 2.0 ** -7 + (k + 1) * 2.0 ** -24)])
def test_fp8_matmul_matches_float64_product_with_the_dequantized_weight(dtype, rel):
    out_dim, in_dim = 72, 300
    w = quantize_blocks(jnp.asarray(weight_with_zero_and_outlier_blocks((out_dim, in_dim), (128, 128))))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, in_dim)), dtype)
    got = np.asarray(jax.jit(fp8_matmul)(x, w), np.float64)
    x64, w64 = np.asarray(x, np.float64), reference_dequantize(w)
    assert got.shape == (3, 5, out_dim)
    err = np.abs(got - x64 @ w64.T)
    assert np.all(err <= rel(in_dim) * (np.abs(x64) @ np.abs(w64).T))


def test_fp8_matmul_rejects_a_mismatched_input():
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 16\]"):
        fp8_matmul(jnp.ones((2, 8)), quantize_blocks(jnp.ones((4, 16))))


def test_quantize_weights_converts_the_projections_and_experts_and_keeps_the_rest():
    model = quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), BLOCK)
    fp8 = {p for p, weight in fp8_eligible_weights(model).items() if isinstance(weight.get_value(), BlockFP8Weight)}
    absorbed = {f"layers/{i}/self_attn/{name}" for i in range(CFG.num_hidden_layers) for name in ("w_uk", "w_uv")}
    assert fp8 == set(fp8_eligible_weights(model)) - absorbed  # w_uk / w_uv only on request
    assert {"layers/1/mlp/shared_experts/down_proj/kernel", "layers/0/self_attn/o_proj/kernel",
            "layers/1/mlp/w_gate", "layers/1/mlp/w_down"} <= fp8
    assert model.layers[0].self_attn.w_uk[...].dtype == jnp.bfloat16
    assert model.lm_head.kernel[...].dtype == jnp.bfloat16
    quantize_weights(model, BLOCK, absorbed=True)
    assert all(isinstance(w.get_value(), BlockFP8Weight) for w in fp8_eligible_weights(model).values())
    # The absorbed weights [R, H, d] become one matrix a head: w_uk [H, R, nope], w_uv [H, v, R].
    heads, rank = CFG.num_attention_heads, CFG.kv_lora_rank
    assert model.layers[0].self_attn.w_uk.get_value().values.shape == (heads, rank, CFG.qk_nope_head_dim)
    assert model.layers[0].self_attn.w_uv.get_value().values.shape == (heads, CFG.v_head_dim, rank)
    # The experts' stack [E, in, out] becomes values [E, out, in] with scales per matrix.
    w_down = model.layers[1].mlp.w_down.get_value()
    experts, inner, hidden = CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size
    assert w_down.values.shape == (experts, hidden, inner)
    assert w_down.scales.shape == (experts, -(-hidden // BLOCK[0]), -(-inner // BLOCK[1]))


def test_quantize_weights_min_elements_keeps_the_smaller_weights_in_their_dtype():
    """``min_elements``: a weight converts when its whole array (an expert stack counted whole)
    holds at least that many elements; the smaller ones keep the model's dtype and values."""
    plain = MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    sizes = {path: weight_elements(w.get_value()) for path, w in fp8_eligible_weights(plain).items()
             if not is_absorbed_weight(path)}
    stack = "layers/1/mlp/w_gate"
    matrix = sizes[stack] // CFG.n_routed_experts
    threshold = sorted(set(sizes.values()))[len(set(sizes.values())) // 2]
    assert min(sizes.values()) < threshold <= max(sizes.values())
    before = {path: np.asarray(w.get_value()) for path, w in fp8_eligible_weights(plain).items()}
    model = quantize_weights(plain, BLOCK, min_elements=threshold)
    for path, weight in fp8_eligible_weights(model).items():
        value = weight.get_value()
        if path in sizes and sizes[path] >= threshold:
            assert isinstance(value, BlockFP8Weight), path
        else:
            assert value.dtype == jnp.bfloat16, path
            np.testing.assert_array_equal(np.asarray(value), before[path], err_msg=path)
    # A stack of matrices smaller than the threshold converts when the stack reaches it.
    fresh = quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), BLOCK, min_elements=matrix + 1)
    assert isinstance(fresh.layers[1].mlp.w_gate.get_value(), BlockFP8Weight)
    # Paths named explicitly convert whatever their size.
    named = quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), BLOCK,
                             paths=["layers/0/self_attn/o_proj/kernel"], min_elements=10 ** 9)
    assert isinstance(named.layers[0].self_attn.o_proj.kernel.get_value(), BlockFP8Weight)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_elements: expected an int >= 0"):
            quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), BLOCK, min_elements=bad)


def test_absorbed_weights_quantize_per_head_and_dequantize_to_their_stored_layout():
    """Each head's w_uk / w_uv matrix gets its own blocks; ``dense_weight`` puts the dequantized
    stack back into [R, H, d]: within e4m3's rounding of the float64 original (2**-4 of a normal
    value, 2**-10 of the block's scale below), where a wrong axis order moves values by O(1)."""
    cfg = dataclasses.replace(CFG, num_attention_heads=3, kv_lora_rank=40)  # ragged blocks of R
    model = MLAModel(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32)
    attn = model.layers[0].self_attn
    attn.w_uv.set_value(attn.w_uv.get_value().at[5, 1, 3].set(300.0))  # an outlier in one head's block
    dense = {name: np.asarray(getattr(attn, name).get_value(), np.float64) for name in ("w_uk", "w_uv")}
    quantize_weights(model, BLOCK, absorbed=True)
    for name, want in dense.items():
        w = getattr(attn, name).get_value()
        assert isinstance(w, BlockFP8Weight) and w.scales.shape[0] == 3, name
        got = np.asarray(attn.dense_weight(name, jnp.float32), np.float64)
        scale = np.repeat(np.repeat(np.asarray(w.scales, np.float64), BLOCK[0], 1), BLOCK[1], 2)
        scale = np.moveaxis(scale[:, :w.shape[1], :w.shape[2]], 0, 1)  # per element, [out, H, in]
        scale = scale.transpose((0, 1, 2) if name == "w_uk" else (2, 1, 0))  # as [R, H, d]
        assert got.shape == want.shape
        assert (np.abs(got - want) <= E4M3_REL * np.abs(want) + E4M3_SUBNORMAL_ABS * scale * 1.0001).all(), name
    # The outlier's block holds it at 448 and its head's other blocks keep their own scales.
    uv = attn.w_uv.get_value()
    assert float(uv.scales[1, 0, 0]) == pytest.approx(300.0 / FP8_E4M3_MAX)
    assert float(uv.scales[0, 0, 0]) < 1.0 and float(uv.scales[2, 0, 0]) < 1.0


# Each matrix of a stack is quantized as on its own (its own amax per block).
def test_a_stack_quantizes_each_matrix_as_alone():
    rng = np.random.default_rng(4)
    stack = jnp.asarray(rng.normal(size=(3, 40, 24)) * np.array([1.0, 1e3, 1e-3])[:, None, None], jnp.float32)
    whole = quantize_blocks(stack, (16, 16))
    for e in range(3):
        alone = quantize_blocks(stack[e], (16, 16))
        np.testing.assert_array_equal(np.asarray(whole.values[e]).view(np.uint8), np.asarray(alone.values).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(whole.scales[e]), np.asarray(alone.scales))
        np.testing.assert_array_equal(np.asarray(dequantize_weight(whole, jnp.float32)[e]),
                                      np.asarray(dequantize_weight(alone, jnp.float32)))


# The routed experts through FP8 weights against float64 experts on the same dequantized weights:
# each dispatch's products accumulate at most max(hidden, inner) = 32 float32 terms (2**-24 relative
# each) through silu and a second product, so 1e-5 of the output's scale bounds float32 rounding.
@pytest.mark.parametrize("num_tokens, dispatch, backend", [(1, "gathered", "xla"), (6, "gathered", "xla"),
                                                           (3, "gathered", "interpret"), (6, "dense", "xla"),
                                                           (40, "dense", "xla"), (40, "ragged", "xla")])
def test_fp8_experts_compute_what_float64_does_with_their_dequantized_weights(num_tokens, dispatch, backend):
    from snapmla_jax.models.moe import choose_dispatch
    model = MLAModel(CFG, rngs=nnx.Rngs(5), dtype=jnp.float32)
    moe = model.layers[1].mlp
    quantize_weights(model, BLOCK)
    moe.gather_max_tokens = num_tokens if dispatch == "gathered" else 0
    moe.dense_token_range = (1, num_tokens) if dispatch == "dense" else None
    assert choose_dispatch(num_tokens, moe.dense_token_range, moe.gather_max_tokens) == dispatch
    x = jnp.asarray(np.random.default_rng(num_tokens).normal(size=(num_tokens, CFG.hidden_size)), jnp.float32)
    weights, ids = moe.gate(x)
    w_gate, w_up, w_down = (np.swapaxes(reference_dequantize(w.get_value()), -1, -2)
                            for w in (moe.w_gate, moe.w_up, moe.w_down))
    x64, want = np.asarray(x, np.float64), np.zeros((num_tokens, CFG.hidden_size))
    for t in range(num_tokens):
        for weight, e in zip(np.asarray(weights[t], np.float64), np.asarray(ids[t])):
            h = x64[t] @ w_gate[e]
            want[t] += weight * (((h / (1 + np.exp(-h))) * (x64[t] @ w_up[e])) @ w_down[e])
    want += np.asarray(moe.shared_experts(x), np.float64)
    got = np.asarray(moe(x, backend=backend), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# A layer whose expert shapes the FP8 GEMM kernel takes (inner 128 and hidden 256: whole 64-row
# tiles and 128-channel blocks, DeepSeek's 128 x 128 weight blocks).
KERNEL_CFG = dataclasses.replace(CFG, hidden_size=256, intermediate_size=128, moe_intermediate_size=128,
                                 n_routed_experts=8)


def _e4m3_rounding(v: np.ndarray) -> np.ndarray:
    """The most ``quantize_blocks(v, (1, 128))`` can move each element of v [..., K]: 2**-4 of a
    normal value, 2**-10 of its 128-channel block's scale (amax / 448) for a subnormal one."""
    blocks = np.abs(v).reshape(*v.shape[:-1], -1, 128).max(-1) / FP8_E4M3_MAX
    return E4M3_REL * np.abs(v) + E4M3_SUBNORMAL_ABS * np.repeat(blocks, 128, axis=-1)


@pytest.mark.parametrize("num_tokens, dispatch, backend, kernel_quantizes", [
    (3, "gathered", "interpret", 0), (5, "dense", "interpret", 0), (1, "dense", "interpret", 0),
    (37, "sorted", "interpret", 0), (3, "gathered", "interpret", 64), (37, "sorted", "interpret", 64),
    pytest.param(3, "gathered", "pallas", 0, marks=pytest.mark.gpu),
    pytest.param(5, "dense", "pallas", 64, marks=pytest.mark.gpu),
    pytest.param(200, "dense", "pallas", 0, marks=pytest.mark.gpu),  # two token tiles
    pytest.param(200, "sorted", "pallas", 0, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_experts_through_the_fp8_gemm_stay_within_the_activation_rounding(num_tokens, dispatch, backend,
                                                                               kernel_quantizes, dtype, monkeypatch):
    """The routed experts on the FP8 GEMM kernel (interpreted) against float64 experts on the
    dequantized weights. The kernel quantizes each product's input to e4m3 per row and 128
    channels (x for gate and up; the gate-weighted (dense) or plain (gathered, sorted) hidden row
    for down): after XLA's quantization, or in the kernel itself for products of at most
    ``kernel_quantizes`` rows (``fp8_weights.kernel_quantization``),
    so the bound carries those roundings through: |d silu| <= 1.1 |d g|, then the product with up,
    then the down projection's absolute sums; the sums add 2**-15 of the terms' size interpreted
    (float32), 2**-10 compiled (the FP8 wgmma's accumulation). A bfloat16 model rounds silu(g) * u
    to bfloat16 and, dense, its product with the gate weight again (2**-9 of the value each, before
    the hidden row's e4m3 rounding), and the layer's output, routed + shared, once more (2**-9 of
    their sizes); gathered and sorted, each assignment's down projection too (its rows come in the
    hidden's dtype, weighted and summed in float32 after)."""
    model = MLAModel(KERNEL_CFG, rngs=nnx.Rngs(3), dtype=dtype)
    moe = model.layers[1].mlp
    quantize_weights(model, (128, 128))
    moe.gather_max_tokens = num_tokens if dispatch == "gathered" else 0
    moe.dense_token_range = (1, num_tokens) if dispatch in ("dense", "sorted") else None
    moe.sorted_min_tokens = moe.fp8_sorted_min_tokens = 1 if dispatch == "sorted" else None
    assert moe.dispatch(num_tokens, backend) == dispatch
    assert moe.fp8_kernel_stacks(moe.sorted_chunk(num_tokens) if dispatch == "sorted" else num_tokens,
                                 backend) is not None
    rng = np.random.default_rng(num_tokens)
    x = rng.normal(size=(num_tokens, KERNEL_CFG.hidden_size))
    x[0, :7] *= 30.0  # outlier channels
    x = jnp.asarray(x, dtype)
    weights, ids = moe.gate(x)
    w_gate, w_up, w_down = (np.swapaxes(reference_dequantize(w.get_value()), -1, -2)
                            for w in (moe.w_gate, moe.w_up, moe.w_down))
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    x_err = _e4m3_rounding(x64)
    hidden_rel = 2 * 2.0**-9 if dtype == jnp.bfloat16 else 0.0  # silu(g) * u, then times the gate weight
    sums = 2.0**-15 if backend == "interpret" else 2.0**-10  # float32 / the FP8 wgmma's ~14 bits
    want, bound = np.zeros((num_tokens, KERNEL_CFG.hidden_size)), np.zeros((num_tokens, KERNEL_CFG.hidden_size))
    for t in range(num_tokens):
        for a, e in zip(np.asarray(weights[t], np.float64), np.asarray(ids[t])):
            g, u = x64[t] @ w_gate[e], x64[t] @ w_up[e]
            g_err = x_err[t] @ np.abs(w_gate[e]) + sums * (np.abs(x64[t]) @ np.abs(w_gate[e]))
            u_err = x_err[t] @ np.abs(w_up[e]) + sums * (np.abs(x64[t]) @ np.abs(w_up[e]))
            silu = g / (1 + np.exp(-g))
            h = silu * u
            h_err = 1.1 * g_err * (np.abs(u) + u_err) + np.abs(silu) * u_err
            h_err = h_err + hidden_rel * (np.abs(h) + h_err)
            h_err = h_err + _e4m3_rounding(np.abs(h) + h_err)  # the hidden row's own quantization
            down = h @ w_down[e]
            down_err = h_err @ np.abs(w_down[e]) + sums * (np.abs(h) @ np.abs(w_down[e]))
            if dtype == jnp.bfloat16 and dispatch != "dense":
                down_err = down_err + 2.0**-9 * (np.abs(down) + down_err)
            want[t] += a * down
            bound[t] += a * down_err
    quantized_by = []  # who quantized each routed product's input: the kernel (True) or XLA
    grouped = fp8_weights.fp8_grouped_gemm_mgpu
    monkeypatch.setattr(fp8_weights, "fp8_grouped_gemm_mgpu",
                        lambda x, xs, *a, **kw: quantized_by.append(xs is None) or grouped(x, xs, *a, **kw))
    tiled = fp8_weights.fp8_grouped_gemm_tiles_mgpu  # more than 64 rows: the tiled kernel, XLA quantizes
    monkeypatch.setattr(fp8_weights, "fp8_grouped_gemm_tiles_mgpu",
                        lambda *a, **kw: quantized_by.append(False) or tiled(*a, **kw))
    quantized_shapes = []  # what the Mosaic quantizer took for the routed products
    quantizer = fp8_weights.quantize_activations_mgpu
    monkeypatch.setattr(fp8_weights, "quantize_activations_mgpu",
                        lambda x, *a, **kw: quantized_shapes.append(x.shape) or quantizer(x, *a, **kw))
    with kernel_quantization(kernel_quantizes):
        shared = np.asarray(moe.shared_experts(x, backend=backend).astype(jnp.float32), np.float64)
        quantized_shapes.clear()
        got = np.asarray(moe(x, backend=backend).astype(jnp.float32), np.float64) - shared
    assert quantized_by and set(quantized_by) == {kernel_quantizes > 0}
    if dispatch == "sorted" and not kernel_quantizes:
        # The tokens quantized once, for the routed chunks and the block-FP8 shared experts alike;
        # then only hidden rows: the chunks' and the shared experts' one group.
        hidden_size, inner = KERNEL_CFG.hidden_size, KERNEL_CFG.moe_intermediate_size
        chunks = [shape for shape in quantized_shapes if len(shape) == 3 and shape[0] > 1]
        assert quantized_shapes[0] == (num_tokens, hidden_size), quantized_shapes
        assert chunks and all(shape[-1] == inner for shape in chunks), quantized_shapes
        assert all(shape[-1] != hidden_size for shape in quantized_shapes[1:]), quantized_shapes
    if dtype == jnp.bfloat16:  # the routed output, then routed + shared, each rounded to bfloat16
        bound = bound + 2.0**-9 * (2 * (np.abs(want) + bound) + np.abs(shared))
    err = np.abs(got - want)
    assert (err <= bound + 1e-6 * np.abs(want).max()).all(), float((err / bound).max())
    # The worst case above adds every rounding with one sign; e4m3's roundings (RMS ~2**-4 / 3 of a
    # value) add in quadrature: two of them in series stay far below 0.1 of the output's L2 norm,
    # where a wrong expert, scale or token gives an O(1) error.
    assert np.linalg.norm(err) <= 0.1 * np.linalg.norm(want)
    unquantized = (np.asarray(moe(x, backend="xla").astype(jnp.float32), np.float64)
                   - np.asarray(moe.shared_experts(x, backend="xla").astype(jnp.float32), np.float64))
    assert not np.array_equal(got, unquantized)  # the kernel ran: the activations' rounding shows


@pytest.mark.parametrize("num_tokens", [37, 80])  # the shared experts on the kernel of few tokens; the tiled one
def test_shared_experts_given_the_routed_tokens_quantized_compute_the_same_bits(num_tokens, monkeypatch):
    """A fully block-FP8 layer in the sorted dispatch hands its quantized tokens to the shared
    experts (their gate and up quantize x to the same bytes themselves): the layer's output is
    bit for bit the one where the shared experts take x."""
    model = MLAModel(KERNEL_CFG, rngs=nnx.Rngs(5), dtype=jnp.bfloat16)
    moe = model.layers[1].mlp
    quantize_weights(model, (128, 128))
    moe.dense_token_range, moe.sorted_min_tokens, moe.fp8_sorted_min_tokens = (1, num_tokens), 1, 1
    assert moe.dispatch(num_tokens, "interpret") == "sorted"
    rng = np.random.default_rng(num_tokens)
    x = rng.normal(size=(num_tokens, KERNEL_CFG.hidden_size))
    x[2, :9] *= 50.0  # outlier channels
    x = jnp.asarray(x, jnp.bfloat16)
    given = []
    mlp_call = type(moe.shared_experts).__call__
    monkeypatch.setattr(type(moe.shared_experts), "__call__",
                        lambda self, x, *a, **kw: given.append(isinstance(x, QuantizedTokens)) or mlp_call(self, x, *a, **kw))
    # One program a call, as a model's step runs the layer (traced anew each time: the patches
    # act at trace time).
    interpreted = lambda: np.asarray(jax.jit(lambda x: moe(x, backend="interpret"))(x), np.float32)
    got = interpreted()
    assert given == [True]
    monkeypatch.setattr(type(moe.shared_experts), "takes_quantized", lambda *a: False)
    want = interpreted()
    assert given[1:] == [False]
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.asarray(moe(x, backend="xla"), np.float32))  # the kernels ran


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("groups, rows", [(3, 16), (2, 72)])  # the kernel of few tokens; the tiled kernel
def test_tokens_quantized_once_then_gathered_give_the_grouped_products_the_same_bits(dtype, groups, rows):
    """``quantize_tokens`` then a gather of its rows (the sorted dispatch's order) against the
    gathered rows quantized by the product itself: each row is quantized alone, so the interpreted
    kernels' results agree bit for bit, rows of index T (an empty slot) included; XLA's path (the
    rows dequantized) agrees with the product of the dequantized rows."""
    rng = np.random.default_rng(groups * rows)
    num_tokens, hidden, out = 23, 256, 128
    x = rng.normal(size=(num_tokens, hidden))
    x[3, :5] *= 40.0  # outlier channels
    x = jnp.asarray(x, dtype)
    stack = quantize_blocks(jnp.asarray(rng.normal(size=(4, out, hidden)) / 16, jnp.float32), (128, 128))
    index = jnp.asarray(rng.integers(0, num_tokens + 1, (groups, rows)), jnp.int32)  # num_tokens: zeros
    matrices = jnp.asarray(rng.integers(0, 4, groups), jnp.int32)
    tokens = fp8_weights.quantize_tokens(x, backend="interpret")
    assert tokens.shape == x.shape and tokens.dtype == x.dtype and tokens.scales.shape == (hidden // 128, num_tokens)
    want_x8, want_scales = fp8_weights.quantize_activations(x)  # XLA's quantization, bit for bit interpreted
    np.testing.assert_array_equal(np.asarray(tokens.values, np.float32), np.asarray(want_x8, np.float32))
    np.testing.assert_array_equal(np.asarray(tokens.scales), np.asarray(want_scales))
    gather = lambda rows_of: rows_of.at[index].get(mode="fill", fill_value=0)
    gathered = tokens.rows_at(index)
    # The rows and their scales, [G, K / 128, rows], where numpy's gather puts them (zeros past T).
    padded = lambda a: np.concatenate([np.asarray(a, np.float32), np.zeros((1, *a.shape[1:]), np.float32)])
    np.testing.assert_array_equal(np.asarray(gathered.values, np.float32), padded(want_x8)[np.asarray(index)])
    np.testing.assert_array_equal(np.asarray(gathered.scales),
                                  np.swapaxes(padded(np.asarray(want_scales).T)[np.asarray(index)], 1, 2))
    for backend in ("interpret", "xla"):
        got = fp8_weights.fp8_grouped_matmul(gathered, stack, matrices=matrices, out_dtype=dtype, backend=backend)
        rows_in = gather(x) if backend == "interpret" else gathered.dequantized()
        want = fp8_weights.fp8_grouped_matmul(rows_in, stack, matrices=matrices, out_dtype=dtype, backend=backend)
        assert got.shape == (groups, rows, out) and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    empty = np.asarray(index) == num_tokens
    assert empty.any() and not np.asarray(got, np.float32)[empty].any()


def test_quantize_tokens_rejects_what_the_quantizer_does_not_take():
    for x, text in [(jnp.ones((2, 3, 128)), "expected \\[M, K\\]"), (jnp.ones((2, 100)), "multiple of 128"),
                    (jnp.ones((2, 128), jnp.int32), "int32"), (jnp.ones((0, 128)), "M > 0")]:
        with pytest.raises(ValueError, match=f"^x: .*{text}"):
            fp8_weights.quantize_tokens(x, backend="interpret")


def test_the_dense_dispatch_reads_no_gate_or_up_matrix_of_an_expert_no_token_chose():
    """On the FP8 GEMM the dense dispatch's gate and up launch skips the experts that no token
    chose: with their e4m3 gate and up matrices made NaN the layer's output stays finite and equal
    to the output with them intact (their products, even times a gate weight of 0, would give
    NaN). The down projection's summed launch reads every expert (models/moe.py says why)."""
    model = MLAModel(KERNEL_CFG, rngs=nnx.Rngs(4), dtype=jnp.float32)
    moe = model.layers[1].mlp
    quantize_weights(model, (128, 128))
    moe.gather_max_tokens, moe.dense_token_range, moe.sorted_min_tokens = 0, (1, 8), None
    x = jnp.asarray(np.random.default_rng(5).normal(size=(3, KERNEL_CFG.hidden_size)), jnp.float32)
    assert moe.dispatch(3, "interpret") == "dense"
    _, ids = moe.gate(x)
    unchosen = np.setdiff1d(np.arange(KERNEL_CFG.n_routed_experts), np.asarray(ids))
    assert unchosen.size >= 2  # 3 tokens x top-2 of 8 experts
    want = np.asarray(moe(x, backend="interpret"))
    for name in ("w_gate", "w_up"):
        w = getattr(moe, name).get_value()
        nan = jnp.full(w.values.shape[1:], jnp.nan, jnp.float8_e4m3fn)
        getattr(moe, name).set_value(fp8_weights.BlockFP8Weight(w.values.at[unchosen].set(nan), w.scales, w.block))
    got = np.asarray(moe(x, backend="interpret"))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    assert np.isnan(np.asarray(moe(x, backend="xla"))).all()  # XLA's dequantized path reads every expert


@pytest.mark.parametrize("lead, backend", [((1,), "interpret"), ((2, 3), "interpret"),
                                           pytest.param((5,), "pallas", marks=pytest.mark.gpu)])
def test_fp8_mlp_runs_gate_and_up_in_one_launch_within_the_activation_rounding(lead, backend):
    """An MLP whose gate and up kernels are block-FP8 multiplies x by both in one FP8 GEMM launch
    (x quantized once): against float64 on the dequantized weights, the bound of x's e4m3
    rounding carried through silu and up (as the experts' test), then the down product's own."""
    model = quantize_weights(MLAModel(KERNEL_CFG, rngs=nnx.Rngs(2), dtype=jnp.float32), (128, 128))
    mlp = model.layers[0].mlp  # the dense layer
    assert mlp._fp8_gate_up(jnp.ones((*lead, KERNEL_CFG.hidden_size)), backend) is not None
    rng = np.random.default_rng(sum(lead))
    x = rng.normal(size=(*lead, KERNEL_CFG.hidden_size))
    x[..., :5] *= 20.0
    x = jnp.asarray(x, jnp.float32)
    w_gate, w_up, w_down = (np.swapaxes(reference_dequantize(linear.kernel.get_value()), -1, -2)
                            for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    x64 = np.asarray(x, np.float64).reshape(-1, KERNEL_CFG.hidden_size)
    x_err = _e4m3_rounding(x64)
    # Sums: float32 interpreted (2^-15 of the terms' size), the FP8 wgmma's ~14-bit accumulation
    # compiled (2^-10, the compiled GEMM tests' bound).
    sums = 2.0**-15 if backend == "interpret" else 2.0**-10
    g, u = x64 @ w_gate, x64 @ w_up
    g_err = x_err @ np.abs(w_gate) + sums * (np.abs(x64) @ np.abs(w_gate))
    u_err = x_err @ np.abs(w_up) + sums * (np.abs(x64) @ np.abs(w_up))
    silu = g / (1 + np.exp(-g))
    h = silu * u
    h_err = 1.1 * g_err * (np.abs(u) + u_err) + np.abs(silu) * u_err
    # down: fp8_matmul on the CPU backend "auto" ("xla": h unquantized), float32 sums.
    want = h @ w_down
    bound = (h_err + 2.0**-23 * (np.abs(h) + h_err)) @ np.abs(w_down) + sums * (np.abs(h) @ np.abs(w_down))
    got = np.asarray(mlp(x, backend=backend), np.float64).reshape(want.shape)
    err = np.abs(got - want)
    if backend == "pallas":  # the down product through the kernel as well: h's own e4m3 rounding
        bound = bound + _e4m3_rounding(np.abs(h) + h_err) @ np.abs(w_down)
    assert (err <= bound + 1e-6 * np.abs(want).max()).all(), float((err / bound).max())
    assert np.linalg.norm(err) <= 0.1 * np.linalg.norm(want)  # RMS e4m3 rounding, as the experts' test
    if backend == "interpret":  # the launch ran: x's rounding shows against the CPU's unquantized path
        assert not np.array_equal(got, np.asarray(mlp(x, backend="xla"), np.float64).reshape(want.shape))


ABSORBED_CFG = dataclasses.replace(CFG, num_attention_heads=3, kv_lora_rank=256, qk_nope_head_dim=128,
                                   v_head_dim=128)


@pytest.mark.parametrize("lead, backend", [((1, 1), "interpret"), ((2, 3), "interpret"), ((67, 1), "interpret"),
                                           pytest.param((5, 1), "pallas", marks=pytest.mark.gpu),
                                           pytest.param((64, 2), "pallas", marks=pytest.mark.gpu)])
def test_absorbed_fp8_products_run_one_gemm_a_head_within_the_activation_rounding(lead, backend, monkeypatch):
    """q_nope @ W_UK^T and latent_out @ W_UV with block-FP8 w_uk / w_uv: one grouped FP8 GEMM
    launch, a group a head (the kernel of few tokens up to 64 rows, the tiled one above), against
    float64 on the dequantized weights. The kernel rounds x to e4m3 per row and 128 channels
    (2**-4 of a normal value, 2**-10 of the block's scale below) and sums in float32 interpreted
    (2**-15 of the terms' size), with the FP8 wgmma's ~14 bits compiled (2**-10)."""
    model = quantize_weights(MLAModel(ABSORBED_CFG, rngs=nnx.Rngs(4), dtype=jnp.float32), (128, 128), absorbed=True)
    attn = model.layers[0].self_attn
    heads = ABSORBED_CFG.num_attention_heads
    rng = np.random.default_rng(sum(lead))
    launches = []
    grouped = fp8_weights.fp8_grouped_gemm_mgpu
    tiled = fp8_weights.fp8_grouped_gemm_tiles_mgpu
    monkeypatch.setattr(fp8_weights, "fp8_grouped_gemm_mgpu", lambda *a, **kw: launches.append(1) or grouped(*a, **kw))
    monkeypatch.setattr(fp8_weights, "fp8_grouped_gemm_tiles_mgpu",
                        lambda *a, **kw: launches.append(2) or tiled(*a, **kw))
    sums = 2.0**-15 if backend == "interpret" else 2.0**-10
    for name in ("w_uk", "w_uv"):
        w = getattr(attn, name).get_value()
        x = rng.normal(size=(*lead, heads, w.shape[-1]))
        x[..., 1, :3] *= 40.0  # outlier channels in one head
        x[0, 0, 0] = 0.0       # a zero row
        dense = np.asarray(attn.dense_weight(name, jnp.float32), np.float64)  # [R, H, d]
        per_head = np.moveaxis(dense, 1, 0)  # [H, R, d]
        matrices = per_head.transpose(0, 2, 1) if name == "w_uk" else per_head  # [H, in, out]
        want = np.einsum("...hi,hio->...ho", x, matrices)
        bound = (np.einsum("...hi,hio->...ho", _e4m3_rounding(x), np.abs(matrices))
                 + sums * np.einsum("...hi,hio->...ho", np.abs(x), np.abs(matrices)))
        got = np.asarray(per_head_fp8_product(jnp.asarray(x, jnp.float32), w, backend), np.float64)
        assert got.shape == want.shape
        err = np.abs(got - want)
        assert (err <= bound + 1e-6 * np.abs(want).max()).all(), (name, float((err / bound).max()))
        assert np.linalg.norm(err) <= 0.1 * np.linalg.norm(want)  # RMS e4m3 rounding, as the experts' test
        np.testing.assert_array_equal(got[0, 0, 0], 0.0)
    tokens = lead[0] * lead[1]
    assert launches == [2 if tokens > 64 else 1] * 2  # one launch a product, of the kernel for its rows


def test_fp8_experts_run_dense_once_the_assignments_reach_the_experts():
    """On the FP8 GEMM a gathered call reads a matrix an assignment: from T * k >= E on, dense
    (each matrix once) runs instead, and sorted (of dense or ragged) from ``fp8_sorted_min_tokens`` on
    (bf16 stacks: ``sorted_min_tokens``); bf16 experts and the "xla" backend keep the settings' choice."""
    model = MLAModel(KERNEL_CFG, rngs=nnx.Rngs(0), dtype=jnp.float32)
    moe = model.layers[1].mlp
    moe.gather_max_tokens, moe.dense_token_range = 8, (1, 512)
    assert [moe.dispatch(t, "interpret") for t in (3, 4)] == ["gathered", "gathered"]  # bf16
    quantize_weights(model, (128, 128))
    # 8 experts, 2 a token: 3 tokens are 6 assignments, 4 tokens 8.
    assert [moe.dispatch(t, "interpret") for t in (3, 4, 9)] == ["gathered", "dense", "dense"]
    # From fp8_sorted_min_tokens on (56 by default for these small experts) sorted replaces dense;
    # sorted_min_tokens (the bf16 stacks', 160) does not decide for FP8 ones.
    assert (moe.fp8_sorted_min_tokens, moe.sorted_min_tokens) == (56, 160)
    assert [moe.dispatch(t, "interpret") for t in (55, 56)] == ["dense", "sorted"]
    moe.fp8_sorted_min_tokens = 16
    assert [moe.dispatch(t, "interpret") for t in (15, 16)] == ["dense", "sorted"]
    assert moe.dispatch(4, "xla") == "gathered" and moe.dispatch(16, "xla") == "dense"  # no FP8 GEMM there
    # Above the dense range (a prompt's prefill) sorted replaces ragged, whose stacks XLA dequantizes.
    assert moe.dispatch(513, "interpret") == "sorted" and moe.dispatch(513, "xla") == "ragged"
    moe.fp8_sorted_min_tokens = None
    assert moe.dispatch(513, "interpret") == "ragged"
    # set_sorted_min_tokens sets both: the same threshold whatever the stacks hold.
    assert set_sorted_min_tokens(model, 100) >= 1 and (moe.fp8_sorted_min_tokens, moe.sorted_min_tokens) == (100, 100)
    assert [moe.dispatch(t, "interpret") for t in (99, 100)] == ["dense", "sorted"]


def test_fp8_layers_default_to_their_own_sorted_threshold():
    """Large experts (>= LARGE_EXPERT_PARAMS) sort from 16 tokens in bf16 but from 160 in FP8."""
    large = dataclasses.replace(KERNEL_CFG, hidden_size=4096, moe_intermediate_size=2048)
    small = KERNEL_CFG
    assert [default_sorted_min_tokens(c) for c in (small, large)] == [160, 16]
    assert [default_sorted_min_tokens(c, fp8=True) for c in (small, large)] == [56, 160]


@pytest.mark.parametrize("backend", ["interpret", "auto"])
def test_one_row_through_an_fp8_linear_is_xlas_product_with_the_dequantized_weight(backend, monkeypatch):
    """One row (``fp8_weights.XLA_MAX_ROWS``) runs XLA's product with the weight dequantized in it
    on every backend: no activation rounding, so against float64 on the dequantized weight only
    float32 rounding remains (the weight's product with its scale, then a sum of ``in`` terms:
    ``in`` x 2^-24 of the terms' size). With XLA_MAX_ROWS 0 the row goes through the FP8 GEMM
    (interpreted), whose e4m3 rounding of x shows."""
    monkeypatch.setattr(fp8_weights, "resolve_backend", lambda _: "interpret" if backend == "interpret" else "xla")
    model = quantize_weights(MLAModel(KERNEL_CFG, rngs=nnx.Rngs(0), dtype=jnp.float32), (128, 128))
    linear = model.layers[0].mlp.down_proj  # [256, 128]: whole tiles of the kernel
    w = np.asarray(reference_dequantize(linear.kernel.get_value()), np.float64)  # [out, in]
    x = np.random.default_rng(2).normal(size=(1, 1, w.shape[1]))
    x[..., :3] *= 30.0
    want = x @ w.T
    bound = (w.shape[1] + 1) * 2.0**-24 * (np.abs(x) @ np.abs(w.T))
    got = np.asarray(linear(jnp.asarray(x, jnp.float32)), np.float64)
    assert got.shape == want.shape
    assert (np.abs(got - want) <= bound).all(), float((np.abs(got - want) / bound).max())
    if backend == "interpret":
        with fp8_weights.xla_rows(0):
            kernel = np.asarray(linear(jnp.asarray(x, jnp.float32)), np.float64)
        assert (np.abs(kernel - want) > bound).any()  # x rounded to e4m3: the kernel ran


def test_the_projections_run_the_backend_their_caller_names(monkeypatch):
    """A decode step's backend reaches every block-FP8 product: with "xla" no FP8 GEMM launches
    even where "auto" would run the kernels (patched here to mean "interpret"); with "interpret"
    the attention's projections and the dense MLP launch them."""
    import snapmla_jax.backend as backend_module
    real = backend_module.resolve_backend
    monkeypatch.setattr(backend_module, "resolve_backend", lambda b: real("interpret" if b == "auto" else b))
    for module in (fp8_weights, layers_module):
        monkeypatch.setattr(module, "resolve_backend", backend_module.resolve_backend)
    launches = []
    for name in ("fp8_gemm_mgpu", "fp8_grouped_gemm_mgpu", "fp8_gemm_tiles_mgpu", "fp8_grouped_gemm_tiles_mgpu"):
        kernel = getattr(fp8_weights, name)
        monkeypatch.setattr(fp8_weights, name, lambda *a, _k=kernel, **kw: launches.append(1) or _k(*a, **kw))
    model = quantize_weights(MLAModel(KERNEL_CFG, rngs=nnx.Rngs(0), dtype=jnp.float32), (128, 128))
    layer = model.layers[0]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, KERNEL_CFG.hidden_size)), jnp.float32)
    positions = jnp.zeros((1, 2), jnp.int32)
    for backend, expected in (("xla", False), ("interpret", True)):
        launches.clear()
        layer.self_attn.queries(x, positions, backend)
        layer.self_attn.latents(x, positions, backend)
        layer.self_attn.o_proj(x[..., :layer.self_attn.o_proj.in_features], backend)
        layer.mlp(x, backend)
        assert bool(launches) == expected, (backend, len(launches))


def test_fp8_kernels_hold_fewer_bytes():
    model = MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    weights = fp8_eligible_weights(model)
    dense_bytes = sum(weight.get_value().nbytes for weight in weights.values())
    before = param_bytes(model)
    quantize_weights(model, BLOCK, absorbed=True)
    fp8_bytes = sum(weight.get_value().nbytes for weight in weights.values())
    assert param_bytes(model) == before - dense_bytes + fp8_bytes
    # 1 byte an element instead of 2, plus 4 bytes a 16 x 16 block.
    elements = dense_bytes // 2
    assert fp8_bytes <= elements + 4 * elements // 256 + 4 * 64


@pytest.fixture(scope="module")
def hf_fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "fp8"
    write_tiny_hf_checkpoint(path, hf_config=HF_MOE_CONFIG, fp8_block=BLOCK)
    return path


@pytest.fixture(scope="module")
def hf_models(hf_fp8_dir):
    return {fp8: load_hf_checkpoint(hf_fp8_dir, jnp.bfloat16, progress=False, fp8_weights=fp8)
            for fp8 in (False, True)}


def test_hf_loader_keeps_fp8_kernels_with_their_stored_values_and_scales(hf_fp8_dir, hf_models):
    stored = SafetensorsFile(str(hf_fp8_dir / "model.safetensors"))
    model = hf_models[True]
    expert_names = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    for path, weight in fp8_eligible_weights(model).items():
        w = weight.get_value()
        if path.endswith(("w_uk", "w_uv")):  # kv_b_proj: dequantized unless fp8_absorbed
            assert w.dtype == jnp.bfloat16, path
            continue
        assert isinstance(w, BlockFP8Weight) and w.block == BLOCK, path
        *layer, leaf = path.split("/")
        if leaf in expert_names:  # a stack of experts.{e}.*_proj, row e each
            names = [f"model.{'.'.join(layer)}.experts.{e}.{expert_names[leaf]}.weight" for e in range(w.shape[0])]
        else:
            names = ["model." + path.removesuffix("/kernel").replace("/", ".") + ".weight"]
        values, scales = np.asarray(w.values).reshape(-1, *w.shape[-2:]), np.asarray(w.scales)
        for row, name in enumerate(names):
            np.testing.assert_array_equal(values[row].view(np.uint8), stored.read(name).view(np.uint8))
            np.testing.assert_array_equal(scales.reshape(-1, *scales.shape[-2:])[row], stored.read(name + "_scale_inv"))
    assert model.lm_head.kernel[...].dtype == jnp.bfloat16              # stored unquantized


def test_hf_loader_keeps_kv_b_proj_fp8_split_per_head_where_its_blocks_align(tmp_path):
    """8-row blocks fall within a head's 8 key rows or 8 value rows of kv_b_proj [H * 16, R]
    (DeepSeek-V3: 128 / 128 / 128): w_uk and w_uv hold its stored e4m3 bytes and scales, one
    matrix a head, and the model computes what the dequantized model does (the weights are the
    same numbers; bf16 products may land on a neighbouring value, 2**-6 of the largest logit as
    in the test below)."""
    path = tmp_path / "aligned"
    write_tiny_hf_checkpoint(path, seed=8, hf_config=HF_MOE_CONFIG, fp8_block=(8, 8))
    fp8 = load_hf_checkpoint(path, jnp.bfloat16, progress=False, fp8_weights=True, fp8_absorbed=True)
    plain = load_hf_checkpoint(path, jnp.bfloat16, progress=False)
    stored = SafetensorsFile(str(path / "model.safetensors"))
    heads, nope = HF_MOE_CONFIG["num_attention_heads"], HF_MOE_CONFIG["qk_nope_head_dim"]
    for layer in range(HF_MOE_CONFIG["num_hidden_layers"]):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        values = stored.read(name).view(np.uint8).reshape(heads, -1, HF_MOE_CONFIG["kv_lora_rank"])
        scales = stored.read(name + "_scale_inv").reshape(heads, 2, -1)  # a head: its key block, its value block
        attn = fp8.layers[layer].self_attn
        w_uk, w_uv = attn.w_uk.get_value(), attn.w_uv.get_value()
        np.testing.assert_array_equal(np.asarray(w_uk.values).view(np.uint8), values[:, :nope].transpose(0, 2, 1))
        np.testing.assert_array_equal(np.asarray(w_uv.values).view(np.uint8), values[:, nope:])
        np.testing.assert_array_equal(np.asarray(w_uk.scales), scales[:, :1].transpose(0, 2, 1))
        np.testing.assert_array_equal(np.asarray(w_uv.scales), scales[:, 1:])
        for leaf in ("w_uk", "w_uv"):  # the plain loader's dequantization, in the stored layout
            np.testing.assert_array_equal(np.asarray(attn.dense_weight(leaf, jnp.bfloat16)),
                                          np.asarray(getattr(plain.layers[layer].self_attn, leaf).get_value()))
    want, got = np.asarray(plain(TOKENS), np.float64), np.asarray(fp8(TOKENS), np.float64)
    assert np.max(np.abs(got - want)) <= 2.0 ** -6 * np.max(np.abs(want))
    from snapmla_jax.generate import generate
    prompts = [[3, 14, 15, 9], [2, 6], [7]]
    assert (generate(fp8, prompts, max_new_tokens=4, backend="xla")
            == generate(plain, prompts, max_new_tokens=4, backend="xla"))


def test_hf_fp8_weights_dequantize_to_the_plain_loaders_kernels_exactly(hf_models):
    # Both dequantize the same stored values: values * scale in float32, one rounding to bf16.
    plain = fp8_eligible_weights(hf_models[False])
    for path, weight in fp8_eligible_weights(hf_models[True]).items():
        w = weight.get_value()
        if isinstance(w, BlockFP8Weight):
            np.testing.assert_array_equal(np.asarray(dequantize_weight(w, jnp.bfloat16)),
                                          fp8_layout(path, np.asarray(plain[path].get_value())), err_msg=path)


def test_hf_fp8_weights_model_computes_what_the_dequantized_model_does(hf_models):
    # The weights are bit-identical (test above), so only the products' summation order may
    # differ: each is a float32 sum of at most 48 terms rounded once to bf16, so a product may
    # land on the neighbouring bf16 value (2**-7 relative at most) and carry that through the
    # two layers; 2**-6 of the largest logit bounds it with room. Greedy tokens must agree.
    plain, fp8 = hf_models[False], hf_models[True]
    want, got = np.asarray(plain(TOKENS), np.float64), np.asarray(fp8(TOKENS), np.float64)
    assert np.max(np.abs(got - want)) <= 2.0 ** -6 * np.max(np.abs(want))
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    from snapmla_jax.generate import generate
    prompts = [[3, 14, 15, 9], [2, 6]]
    assert (generate(fp8, prompts, max_new_tokens=4, backend="xla")
            == generate(plain, prompts, max_new_tokens=4, backend="xla"))


def test_orbax_round_trip_keeps_fp8_values_scales_and_logits(tmp_path):
    model = quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(3), dtype=jnp.bfloat16), BLOCK, absorbed=True)  # w_uk / w_uv too
    save_checkpoint(model, tmp_path / "ckpt")
    record = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert record["fp8_weights"] == {"block": list(BLOCK), "kernels": sorted(fp8_eligible_weights(model))}
    assert record["arrays"]["layers/0/self_attn/o_proj/kernel/values"][1] == "float8_e4m3fn"
    assert record["arrays"]["layers/1/mlp/w_up/values"][1] == "float8_e4m3fn"
    restored = load_checkpoint(tmp_path / "ckpt")
    for path, weight in fp8_eligible_weights(model).items():
        want, got = weight.get_value(), fp8_eligible_weights(restored)[path].get_value()
        assert isinstance(got, BlockFP8Weight) and got.block == want.block
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    np.testing.assert_array_equal(np.asarray(restored(TOKENS)), np.asarray(model(TOKENS)))


def test_convert_cli_fp8_weights_writes_an_fp8_checkpoint(hf_fp8_dir, hf_models, tmp_path):
    assert convert_main(["--hf-dir", str(hf_fp8_dir), "--out", str(tmp_path / "ours"), "--quiet",
                         "--fp8-weights"]) == 0
    restored = load_checkpoint(tmp_path / "ours")
    assert isinstance(restored.layers[0].mlp.down_proj.kernel.get_value(), BlockFP8Weight)
    np.testing.assert_array_equal(np.asarray(restored(TOKENS)), np.asarray(hf_models[True](TOKENS)))


def _bits(model) -> dict:
    """The arrays of ``model``'s state (an FP8 weight's values and scales apart) by path: dtype
    and bytes, so that FP8 values and floats compare exactly."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return {jax.tree_util.keystr(path): (str(leaf.dtype), np.asarray(leaf).tobytes()) for path, leaf in leaves}


def _quantized_matrix_by_matrix(path, weight, block) -> BlockFP8Weight:
    """``quantize_blocks`` (compiled, as the loader runs it) of each [out, in] matrix of the weight
    at ``path`` (``fp8_layout``) on its own, stacked: what the loader computes for a weight it
    reads a matrix at a time. (Quantizing a stack at once gives the same values up to the last
    bit of a float32 division, which XLA on a CPU computes differently in vectorized loops.)"""
    layout = fp8_layout(path, np.asarray(weight))
    matrices = layout.reshape(-1, *layout.shape[-2:])
    quantize = jax.jit(quantize_blocks, static_argnums=1)
    parts = [quantize(jnp.asarray(m), block) for m in matrices]
    lead = layout.shape[:-2]
    return BlockFP8Weight(jnp.stack([p.values for p in parts]).reshape(*lead, *parts[0].values.shape),
                          jnp.stack([p.scales for p in parts]).reshape(*lead, *parts[0].scales.shape), block)


def _check_quantized_as_read(loaded, unquantized, block, absorbed: bool = False) -> None:
    """Each FP8-eligible weight of ``loaded`` (w_uk / w_uv with ``absorbed``) is the one of
    ``unquantized`` (the same checkpoint loaded without quantizing) when that is FP8 already, else
    its matrices quantized one by one; every other array is the same."""
    eligible = {path: weight for path, weight in fp8_eligible_weights(unquantized).items()
                if absorbed or not is_absorbed_weight(path)}
    for path, weight in fp8_eligible_weights(loaded).items():
        if path not in eligible:
            continue
        got, source = weight.get_value(), eligible[path].get_value()
        want = source if isinstance(source, BlockFP8Weight) else _quantized_matrix_by_matrix(path, source, block)
        assert isinstance(got, BlockFP8Weight) and got.block == want.block, path
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8),
                                      err_msg=path)
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales), err_msg=path)
    prefixes = tuple("".join(f"[{k}]" if k.isdigit() else f"['{k}']" for k in path.split("/")) for path in eligible)
    rest = lambda model: {path: bits for path, bits in _bits(model).items() if not path.startswith(prefixes)}
    assert rest(loaded) == rest(unquantized)


def test_hf_loader_quantizes_what_the_checkpoint_stores_unquantized(tmp_path):
    # The attention projections stored FP8 (kept as stored), the MLP and the experts in float32
    # (quantized as read, in the checkpoint's blocks).
    path = tmp_path / "mixed"
    write_tiny_hf_checkpoint(path, seed=5, hf_config=HF_MOE_CONFIG, fp8_block=BLOCK, fp8_only="self_attn")
    stored = SafetensorsFile(str(path / "model.safetensors"))
    assert stored.dtype("model.layers.1.mlp.experts.0.up_proj.weight") == np.float32
    loaded = load_hf_checkpoint(path, jnp.bfloat16, progress=False, fp8_weights=True, quantize_fp8_weights=True)
    kept = load_hf_checkpoint(path, jnp.bfloat16, progress=False, fp8_weights=True)
    assert isinstance(kept.layers[0].self_attn.o_proj.kernel.get_value(), BlockFP8Weight)
    assert not isinstance(kept.layers[1].mlp.w_up.get_value(), BlockFP8Weight)
    _check_quantized_as_read(loaded, kept, BLOCK)
    # quantize_weights after loading quantizes each expert stack at once: the same weights up to a
    # float32 division's last bit, so a bf16 product may land on the neighbouring value (2**-7
    # relative) and carry that through the two layers, as in the dequantized-model test above.
    want = np.asarray(quantize_weights(kept, BLOCK)(TOKENS), np.float64)
    assert np.max(np.abs(np.asarray(loaded(TOKENS), np.float64) - want)) <= 2.0 ** -6 * np.max(np.abs(want))


@pytest.mark.parametrize("absorbed", [False, True])
def test_hf_loader_quantizes_a_bf16_release_in_its_default_blocks(tmp_path, absorbed):
    path = tmp_path / "plain"
    write_tiny_hf_checkpoint(path, seed=6, hf_config=HF_MOE_CONFIG)
    loaded = load_hf_checkpoint(path, jnp.bfloat16, progress=False, fp8_weights=True, quantize_fp8_weights=True,
                                fp8_absorbed=absorbed)
    plain = load_hf_checkpoint(path, jnp.bfloat16, progress=False)
    _check_quantized_as_read(loaded, plain, (128, 128), absorbed)  # kv_b_proj a head at a time
    assert isinstance(loaded.layers[0].self_attn.w_uk.get_value(), BlockFP8Weight) == absorbed
    assert param_bytes(loaded) < param_bytes(plain)


def test_hf_loader_quantizes_only_with_fp8_weights(hf_fp8_dir):
    with pytest.raises(ValueError, match="quantize_fp8_weights: .*fp8_weights=True"):
        load_hf_checkpoint(hf_fp8_dir, jnp.bfloat16, progress=False, quantize_fp8_weights=True)
    with pytest.raises(ValueError, match="fp8_absorbed: .*fp8_weights=True"):
        load_hf_checkpoint(hf_fp8_dir, jnp.bfloat16, progress=False, fp8_absorbed=True)


def test_hf_loader_fp8_min_elements_loads_the_smaller_weights_as_the_plain_loader(hf_fp8_dir, hf_models):
    """``fp8_min_elements``: the stored-FP8 weights of fewer elements come out as the plain
    loader's (dequantized to the dtype, bit for bit), the others as ``fp8_weights`` keeps them."""
    plain, kept = (fp8_eligible_weights(hf_models[fp8]) for fp8 in (False, True))
    sizes = {path: weight_elements(w.get_value()) for path, w in kept.items()
             if isinstance(w.get_value(), BlockFP8Weight)}
    threshold = sorted(set(sizes.values()))[len(set(sizes.values())) // 2]
    loaded = fp8_eligible_weights(load_hf_checkpoint(hf_fp8_dir, jnp.bfloat16, progress=False, fp8_weights=True,
                                                     fp8_min_elements=threshold))
    small = {path for path, n in sizes.items() if n < threshold}
    assert small and small != set(sizes)
    for path, weight in loaded.items():
        got = weight.get_value()
        want = (plain if path in small or path not in sizes else kept)[path].get_value()
        assert isinstance(got, BlockFP8Weight) == isinstance(want, BlockFP8Weight), path
        leaves = (got.values, got.scales) if isinstance(got, BlockFP8Weight) else (got,)
        wants = (want.values, want.scales) if isinstance(want, BlockFP8Weight) else (want,)
        for a, b in zip(leaves, wants):
            assert a.dtype == b.dtype, path
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=path)
    for bad, message in ((-1, "expected an int >= 0"), (2, "pass fp8_weights=True")):
        with pytest.raises(ValueError, match=f"fp8_min_elements: .*{re.escape(message)}"):
            load_hf_checkpoint(hf_fp8_dir, jnp.bfloat16, progress=False, fp8_weights=bad < 0, fp8_min_elements=bad)


def test_convert_cli_fp8_min_elements_keeps_the_smaller_weights_in_dtype(tmp_path, capsys):
    write_tiny_hf_checkpoint(tmp_path / "hf", seed=7, hf_config=HF_MOE_CONFIG)
    want = load_hf_checkpoint(tmp_path / "hf", jnp.bfloat16, progress=False, fp8_weights=True,
                              quantize_fp8_weights=True, fp8_min_elements=1024)
    converted = sorted(path for path, w in fp8_eligible_weights(want).items()
                       if isinstance(w.get_value(), BlockFP8Weight))
    assert 0 < len(converted) < len([path for path in fp8_eligible_weights(want) if not is_absorbed_weight(path)])
    assert convert_main(["--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ours"), "--quiet",
                         "--fp8-weights", "--fp8-min-elements", "1024"]) == 0
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["fp8_weights"]["kernels"] == converted
    assert _bits(load_checkpoint(tmp_path / "ours")) == _bits(want)
    capsys.readouterr()
    for flags, needle in ((["--fp8-min-elements", "1024"], "add --fp8-weights"),
                          (["--fp8-weights", "--fp8-min-elements", "-3"], "expected an int >= 0")):
        assert convert_main(["--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "bad"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--fp8-min-elements: " in err and needle in err, err


def test_convert_cli_fp8_weights_quantizes_a_bf16_release(tmp_path):
    write_tiny_hf_checkpoint(tmp_path / "hf", seed=7, hf_config=HF_MOE_CONFIG)
    assert convert_main(["--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ours"), "--quiet",
                         "--fp8-weights"]) == 0
    restored = load_checkpoint(tmp_path / "ours")
    want = load_hf_checkpoint(tmp_path / "hf", jnp.bfloat16, progress=False, fp8_weights=True,
                              quantize_fp8_weights=True)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["fp8_weights"]["kernels"] == sorted(
        path for path in fp8_eligible_weights(want) if not is_absorbed_weight(path))
    assert _bits(restored) == _bits(want)


SHARDED_FP8 = """
import sys, jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, sys.argv[2])  # tests/
from test_fp8_weights import BLOCK, CFG, TOKENS
from snapmla_jax.models import (MLAModel, expert_sharding, load_checkpoint, quantize_weights, save_checkpoint,
                                shard_model)
model = quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32), BLOCK)
placed = shard_model(model, expert_sharding())
w = placed.layers[0].self_attn.o_proj.kernel.get_value()
assert w.values.sharding.is_fully_replicated and w.scales.sharding.is_fully_replicated
w_gate = placed.layers[1].mlp.w_gate.get_value()
assert not w_gate.values.sharding.is_fully_replicated and not w_gate.scales.sharding.is_fully_replicated
want = np.asarray(model(TOKENS))
np.testing.assert_allclose(np.asarray(placed(TOKENS)), want, rtol=1e-5, atol=1e-5)
save_checkpoint(placed, sys.argv[1])
restored = load_checkpoint(sys.argv[1], sharding=expert_sharding())
np.testing.assert_array_equal(np.asarray(restored(TOKENS)), np.asarray(placed(TOKENS)))
print("ok")
"""


def test_fp8_model_splits_its_experts_over_two_devices_and_saves_from_there(tmp_path):
    from cpu_devices import run_with_cpu_devices
    result = run_with_cpu_devices(2, ["-c", SHARDED_FP8, tmp_path / "ckpt", pathlib.Path(__file__).parent])
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
