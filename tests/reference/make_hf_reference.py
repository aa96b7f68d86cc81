"""Build tiny DeepSeek-V2/V3 checkpoints with Hugging Face transformers and
write their reference logits, for the model parity tests.

Runs in the reference venv (Python 3.11, torch CPU, transformers, safetensors),
never in the project's: ``.venv-ref/bin/python tests/reference/make_hf_reference.py OUT_DIR``.

For each variant it writes ``OUT_DIR/<variant>/``: a Hugging Face checkpoint
(config.json + safetensors, sharded with an index), ``input_ids.npy`` [B, S]
int32 and ``logits.npy`` [B, S, vocab] float64: the HF model's eager forward
run in float64 on exactly the stored weights.

Variants:
  v2_lite  DeepseekV2, no q_lora (plain q_proj), greedy softmax routing, YaRN
           with mscale != mscale_all_dim (both the cos/sin factor and the
           softmax scale differ from 1), dense first layer.
  v2       DeepseekV2 with q_lora, group-limited greedy routing, plain RoPE,
           tied embeddings.
  v3       DeepseekV3, sigmoid + correction-bias group routing (noaux_tc),
           YaRN, interleaved RoPE, dense first layer, 3 layers.
  v3_fp8   DeepseekV3 whose linear weights are stored as DeepSeek releases
           them: float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128
           block (dims chosen so blocks are cropped at the edges), plus a
           multi-token-prediction layer the converter must skip, weights and
           their scales placed in different shards. Reference logits use the
           dequantized weights. Non-interleaved RoPE.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

BATCH, SEQ = 2, 12
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
BLOCK = 128      # DeepSeek's weight quantization block (128 x 128)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
              max_position_embeddings=256, rms_norm_eps=1e-6)


def variants() -> dict:
    yarn = lambda mscale, mscale_all_dim: {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 64, "beta_fast": 32,
                                           "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    return {
        "v2_lite": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
            COMMON, num_hidden_layers=2, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False,
            routed_scaling_factor=1.0, rope_parameters=yarn(1.0, 0.7))),
        "v2": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
            COMMON, num_hidden_layers=2, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3,
            n_shared_experts=1, first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4,
            topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.0, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
            COMMON, num_hidden_layers=3, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, rope_interleave=True, rope_parameters=yarn(1.0, 1.0))),
        "v3_fp8": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
            COMMON, hidden_size=160, intermediate_size=272, q_lora_rank=144, moe_intermediate_size=48,
            num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_interleave=False, rope_parameters=yarn(1.0, 1.0))),
    }


def randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights with O(1) activations: matrices ~ N(0, 1/fan_in), norms around 1,
    router weights wide enough that top-k choices are far from ties (a tie
    broken differently by float rounding would change the experts)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / math.sqrt(param.shape[-1]))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))


def is_fp8_weight(name: str) -> bool:
    """DeepSeek stores every linear weight inside the decoder layers in FP8,
    except the router; embeddings, norms and lm_head stay in high precision."""
    return (name.startswith("model.layers.") and name.endswith("proj.weight")) or \
        (".mlp.experts." in name and name.endswith(".weight"))


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/128), ceil(in/128)])."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // BLOCK), -(-in_dim // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32)
    padded[:out_dim, :in_dim] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quant = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quant.view(rows * BLOCK, cols * BLOCK)[:out_dim, :in_dim].contiguous(), scale


def dequantize_block_fp8(quant: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_dim, in_dim = quant.shape
    full = scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out_dim, :in_dim]
    return quant.double() * full


def release_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights named as DeepSeek's releases name them: transformers
    fuses each MoE layer's experts into ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I]; releases store one tensor per expert."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach().clone().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inner = name.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inner].contiguous()
                out[f"{base}{e}.up_proj.weight"] = value[e, inner:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[name] = value
    return out


def set_release_weight_(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Inverse of ``release_layout`` for one tensor: write it into the model's (fused) parameter."""
    with torch.no_grad():
        if ".mlp.experts." not in name:
            model.get_parameter(name).copy_(value)
            return
        base, expert, proj, _ = name.rsplit(".", 3)
        expert = int(expert)
        if proj == "down_proj":
            model.get_parameter(f"{base}.down_proj")[expert].copy_(value)
        else:
            fused = model.get_parameter(f"{base}.gate_up_proj")[expert]
            inner = fused.shape[0] // 2
            fused[:inner].copy_(value) if proj == "gate_proj" else fused[inner:].copy_(value)


def write_fp8_checkpoint(model: torch.nn.Module, out: str) -> None:
    """Save ``model`` FP8-quantized into two shards + index, add an MTP layer,
    and load the dequantized weights back into ``model`` (the reference)."""
    tensors, dequantized = {}, {}
    for name, value in release_layout(model).items():
        if is_fp8_weight(name):
            quant, scale = quantize_block_fp8(value)
            tensors[name], tensors[name + "_scale_inv"] = quant, scale
            dequantized[name] = dequantize_block_fp8(quant, scale).float()
        else:
            tensors[name] = value
    mtp = f"model.layers.{model.config.num_hidden_layers}"
    hidden = model.config.hidden_size
    quant, scale = quantize_block_fp8(torch.randn(hidden, 2 * hidden))
    tensors.update({f"{mtp}.eh_proj.weight": quant, f"{mtp}.eh_proj.weight_scale_inv": scale,
                    f"{mtp}.enorm.weight": torch.ones(hidden), f"{mtp}.hnorm.weight": torch.ones(hidden)})
    # Alternate tensors between shards, so that a weight and its scale
    # (adjacent in sorted order) land in different files.
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {n: tensors[n] for n in names[i::2]} for i in range(2)}
    weight_map = {}
    for file, part in shards.items():
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=1)
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    config["num_nextn_predict_layers"] = 1
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    # DeepSeek's released config.json spells RoPE the older way: `rope_scaling`
    # with a top-level `rope_theta`. Writing it so exercises that reader.
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name, value in dequantized.items():
        set_release_weight_(model, name, value)


def build(variant: str, out_root: str, seed: int) -> None:
    config_cls, model_cls, kwargs = variants()[variant]
    out = os.path.join(out_root, variant)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    # The plain loops: the fused kernels have no float64 versions.
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    randomize_(model, gen)
    if variant.endswith("_fp8"):
        write_fp8_checkpoint(model, out)
    else:
        # A small shard size forces a sharded checkpoint with an index json.
        model.save_pretrained(out, max_shard_size="100KB")
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        logits = model.double()(input_ids=input_ids).logits
    np.save(os.path.join(out, "input_ids.npy"), input_ids.numpy().astype(np.int32))
    np.save(os.path.join(out, "logits.npy"), logits.numpy())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_hf_reference.py OUT_DIR", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for seed, variant in enumerate(variants()):
        build(variant, argv[0], seed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
