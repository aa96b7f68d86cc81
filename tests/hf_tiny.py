"""A tiny dense DeepSeek-V2 checkpoint in Hugging Face's layout, written from an MLAModel with
numpy alone (no torch): what the convert CLI's tests feed it. The torch-made checkpoints of
tests/reference check the numbers against transformers; this one the CLI's handling of paths."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from snapmla_jax.models import MLAConfig, MLAModel

HF_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 64,
             "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
             "v_head_dim": 8, "q_lora_rank": None, "max_position_embeddings": 128}


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
        if leaf == "w_uk":
            joined = np.concatenate([value.transpose(1, 2, 0), state[(*module, "w_uv")].transpose(1, 2, 0)], axis=1)
            tensors[f"{name}.kv_b_proj.weight"] = joined.reshape(-1, cfg.kv_lora_rank)
        else:
            tensors[f"{name}.weight"] = value.T if leaf == "kernel" else value
    # safetensors writes an array's buffer as it lies: C order first.
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def write_tiny_hf_checkpoint(path: pathlib.Path, seed: int = 0) -> MLAModel:
    """config.json + model.safetensors of a random 1-layer model under ``path`` (created);
    returns that model (float32)."""
    model = MLAModel(MLAConfig.from_hf(HF_CONFIG), rngs=nnx.Rngs(seed), dtype=jnp.float32)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(hf_tensors(model), str(path / "model.safetensors"))
    return model
