"""A tiny DeepSeek-V2 checkpoint in Hugging Face's layout, written from an MLAModel with
numpy alone (no torch): what the convert CLI's tests and the FP8-weight tests feed it. The
torch-made checkpoints of tests/reference check the numbers against transformers; this one the
CLI's handling of paths, and (``fp8_block=``) the loading of FP8 block-quantized weights."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from snapmla_jax.fp8_weights import quantize_blocks
from snapmla_jax.models import MLAConfig, MLAModel

HF_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 64,
             "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
             "v_head_dim": 8, "q_lora_rank": None, "max_position_embeddings": 128}
# Two layers, the second a MoE with a shared expert (V2-Lite's routing).
HF_MOE_CONFIG = {**HF_CONFIG, "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                 "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
                 "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
                 "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1}
EXPERT_NAMES = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def hf_tensors(model: MLAModel) -> dict[str, np.ndarray]:
    """The model's float32 weights under Hugging Face's names and layouts (the inverse of
    models.hf_loader: kernels transposed to [out, in], W_UK and W_UV joined into kv_b_proj)."""
    cfg = model.cfg
    state = {path: np.asarray(var.get_value(), np.float32) for path, var in nnx.to_flat_state(nnx.state(model))}
    tensors = {}
    for path, value in state.items():
        *module, leaf = path
        if leaf == "w_uv":
            continue
        prefix = "" if module[0] == "lm_head" else "model."
        name = prefix + ".".join(map(str, module))
        if leaf in EXPERT_NAMES:
            for expert, w in enumerate(value):
                tensors[f"{name}.experts.{expert}.{EXPERT_NAMES[leaf]}.weight"] = w.T
        elif leaf == "w_uk":
            joined = np.concatenate([value.transpose(1, 2, 0), state[(*module, "w_uv")].transpose(1, 2, 0)], axis=1)
            tensors[f"{name}.kv_b_proj.weight"] = joined.reshape(-1, cfg.kv_lora_rank)
        else:
            tensors[f"{name}.weight"] = value.T if leaf == "kernel" else value
    # safetensors writes an array's buffer as it lies: C order first.
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def fp8_block_tensors(tensors: dict[str, np.ndarray], block: tuple[int, int],
                      only: str = "") -> dict[str, np.ndarray]:
    """``tensors`` with every projection's weight (``*_proj*.weight``: the linear layers
    DeepSeek's FP8 releases quantize) whose name holds ``only`` as float8_e4m3fn values plus a
    float32 ``.weight_scale_inv`` per block."""
    out = {}
    for name, t in tensors.items():
        module, leaf = name.rsplit(".", 2)[-2:]
        if leaf == "weight" and "_proj" in module and only in name:
            w = quantize_blocks(t, block)
            out[name], out[name + "_scale_inv"] = np.asarray(w.values), np.asarray(w.scales)
        else:
            out[name] = t
    return out


def write_tiny_hf_checkpoint(path: pathlib.Path, seed: int = 0, *, hf_config: dict = HF_CONFIG,
                             fp8_block: tuple[int, int] | None = None, fp8_only: str = "") -> MLAModel:
    """config.json + model.safetensors of a random model of ``hf_config`` (default: 1 dense
    layer) under ``path`` (created); returns that model (float32). ``fp8_block`` (rows, cols):
    store the linear weights block-quantized to FP8, as DeepSeek-V3's releases (with
    ``fp8_only``, those whose name holds it; the others in float32)."""
    model = MLAModel(MLAConfig.from_hf(hf_config), rngs=nnx.Rngs(seed), dtype=jnp.float32)
    tensors = hf_tensors(model)
    if fp8_block is not None:
        hf_config = {**hf_config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                          "activation_scheme": "dynamic",
                                                          "weight_block_size": list(fp8_block)}}
        tensors = fp8_block_tensors(tensors, fp8_block, fp8_only)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, str(path / "model.safetensors"))
    return model
