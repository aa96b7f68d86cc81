"""snapmla_jax/capacity.py: the memory plan's weight bytes against a real model's, its rows by
hand, and the command line."""

import math

import jax.numpy as jnp
import pytest
from flax import nnx

from snapmla_jax import capacity
from snapmla_jax.models import MLAConfig, MLAModel, quantize_weights
from snapmla_jax.models.transformer import param_bytes

CFG = MLAConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, n_routed_experts=4,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=40, first_k_dense_replace=1,
                weight_block_size=(16, 16))


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_weight_bytes_are_the_models_own(fp8_weights):
    model = MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    if fp8_weights:
        quantize_weights(model, CFG.weight_block_size)
    got = capacity.weight_bytes(CFG, fp8_weights=fp8_weights)
    moe = model.layers[1].mlp
    experts = sum(leaf.nbytes for w in (moe.w_gate, moe.w_up, moe.w_down)
                  for leaf in ((w.get_value().values, w.get_value().scales) if fp8_weights else (w.get_value(),)))
    assert got.experts == experts and got.replicated + got.experts == param_bytes(model)
    assert got.per_device(4) == got.replicated + math.ceil(experts / 4)


def test_weight_bytes_with_min_elements_are_those_of_the_model_it_quantizes():
    """``fp8_min_elements``: the bytes of ``quantize_weights(min_elements=...)``'s model: the
    smaller matrices in bf16 add to the replicated bytes, the expert stacks (counted whole) stay FP8."""
    # 48 x 96 elements: the dense MLP's matrices and up are quantized, the o projection's (32 x 48)
    # and the shared expert's (48 x 40) are not; the expert stacks (4 x 48 x 40) are, counted whole.
    threshold = 48 * 96
    model = quantize_weights(MLAModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), CFG.weight_block_size,
                             min_elements=threshold)
    got = capacity.weight_bytes(CFG, fp8_weights=True, fp8_min_elements=threshold)
    every = capacity.weight_bytes(CFG, fp8_weights=True)
    assert got.replicated + got.experts == param_bytes(model)
    assert got.experts == every.experts and got.replicated > every.replicated


def test_rows_per_device_by_hand():
    weights = capacity.WeightBytes(replicated=2 * capacity.GIB, experts=8 * capacity.GIB)
    # 20 GiB - 2 reserved - (2 + 8 / 4) weights = 14 GiB; a row of 1000 tokens is 16 pages of 64
    # (1024 tokens) x 2 layers x 644 bytes.
    rows = capacity.rows_per_device(CFG, weights, devices=4, device_gib=20, reserve_gib=2, context=1000,
                                    kv_cache="fp8")
    assert rows == (14 * capacity.GIB) // (1024 * 2 * 644)
    assert capacity.rows_per_device(CFG, weights, devices=1, device_gib=10, reserve_gib=2, context=1000,
                                    kv_cache="bf16") == 0


def test_capacity_table_holds_more_fp8_rows():
    _, rows = capacity.capacity_table(CFG, devices=2, device_gib=1, reserve_gib=0.25, contexts=[4096, 100_000],
                                      fp8_weights=True)
    for row in rows:
        assert row["batch_fp8"] % 2 == 0 and row["batch_bf16"] % 2 == 0   # rows a device, times 2
        # 1152 / 644 bytes a token, less the rounding down of each device's rows.
        assert row["batch_bf16"] <= row["batch_fp8"] <= 1152 / 644 * row["batch_bf16"] + 2


def test_cli_prints_the_plan(capsys):
    assert capacity.main(["--model", "v2-lite", "--devices", "2", "--contexts", "16384"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("v2-lite on 2 device(s) of 79.6 GiB") and "| 16384 |" in out
    assert capacity.main(["--model", "v2-lite", "--fp8-weights", "--fp8-min-elements", "16777216"]) == 0
    assert "weights block-FP8 from 16777216 elements: 15.8 GiB a device" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "0"], "--devices"),
    (["--model", "v2-lite", "--devices", "3"], "--devices: expected a divisor of v2-lite's 64"),
    (["--contexts", "0"], "--contexts"),
    (["--reserve-gib", "100"], "--reserve-gib"),
    (["--model", "v9"], "--model"),
    (["--fp8-min-elements", "16"], "--fp8-min-elements: chooses among the weights --fp8-weights"),
    (["--fp8-weights", "--fp8-min-elements", "-1"], "--fp8-min-elements: expected an int >= 0"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    assert capacity.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
