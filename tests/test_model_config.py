"""MLAConfig: reading Hugging Face DeepSeek configs, derived scales, storage, errors."""

import json
import math

import pytest

from snapmla_jax.models.config import MLAConfig

# The fields of DeepSeek's published config.json files (values as released),
# minus keys the reader ignores (auto_map, aux_loss_alpha, torch_dtype, ...).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}


def test_deepseek_v3_config_fields_and_softmax_scale():
    cfg = MLAConfig.from_hf(DEEPSEEK_V3)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (1536, 512, 192, 128)
    assert (cfg.topk_method, cfg.scoring_func, cfg.n_group, cfg.topk_group) == ("noaux_tc", "sigmoid", 8, 4)
    assert cfg.rope_type == "yarn" and cfg.rope_factor == 40 and cfg.rope_original_max_position == 4096
    assert cfg.weight_block_size == (128, 128) and cfg.rope_interleave
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    # DeepSeek: softmax_scale = qk_head_dim**-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)**2.
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert cfg.rope_cos_sin_factor == pytest.approx(1.0)  # mscale == mscale_all_dim


def test_deepseek_v2_lite_has_plain_q_proj_and_greedy_softmax_routing():
    cfg = MLAConfig.from_hf(DEEPSEEK_V2_LITE)
    assert cfg.q_lora_rank is None
    assert (cfg.topk_method, cfg.scoring_func, cfg.norm_topk_prob) == ("greedy", "softmax", False)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.0707 * math.log(40) + 1) ** 2, rel=1e-12)


def test_rope_parameters_spelling_equals_rope_scaling_spelling():
    newer = dict(DEEPSEEK_V3)
    scaling = dict(newer.pop("rope_scaling"))
    scaling["rope_type"] = scaling.pop("type")
    newer["rope_parameters"] = {**scaling, "rope_theta": newer.pop("rope_theta")}
    assert MLAConfig.from_hf(newer) == MLAConfig.from_hf(DEEPSEEK_V3)


def test_kimi_k2_model_type_is_read_as_v3():
    kimi = dict(DEEPSEEK_V3, model_type="kimi_k2", n_routed_experts=384, n_group=1, topk_group=1)
    cfg = MLAConfig.from_hf(kimi)
    assert (cfg.n_routed_experts, cfg.topk_method) == (384, "noaux_tc")


def test_from_hf_reads_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    assert MLAConfig.from_hf(tmp_path) == MLAConfig.from_hf(DEEPSEEK_V2_LITE)


@pytest.mark.parametrize("change, named", [
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"topk_method": "random"}, "topk_method"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"n_group": 7}, "n_group"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
])
def test_unsupported_values_raise_an_error_naming_them(change, named):
    with pytest.raises(ValueError, match=named):
        MLAConfig.from_hf({**DEEPSEEK_V3, **change})


def test_missing_required_field_is_named():
    broken = dict(DEEPSEEK_V3)
    del broken["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig.from_hf(broken)


def test_to_dict_from_dict_round_trip_through_json():
    cfg = MLAConfig.from_hf(DEEPSEEK_V3)
    assert MLAConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="hidden_sise"):
        MLAConfig.from_dict({**MLAConfig.from_hf(DEEPSEEK_V3).to_dict(), "hidden_sise": 3})
