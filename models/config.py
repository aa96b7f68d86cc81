"""``MLAConfig``: the hyperparameters of a DeepSeek-family MLA model.

One frozen dataclass covers DeepSeek-V2, V2-Lite and V3 (and V3's relatives
R1, V3.1 and Kimi-K2, which reuse V3's architecture). ``MLAConfig.from_hf``
reads a Hugging Face ``config.json``; ``to_dict``/``from_dict`` are the
storage format kept beside orbax checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# Hugging Face architectures this model reproduces, and the config model_type
# each family uses (Kimi-K2 ships DeepseekV3ForCausalLM under its own name).
SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")
REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Hyperparameters of an MLA decoder (names follow DeepSeek's config.json).

    Attention: ``q_lora_rank=None`` means a plain ``q_proj`` (V2-Lite); the KV
    side always goes through the ``kv_lora_rank`` latent that the cache holds.
    RoPE: ``rope_type`` "default" or "yarn" (with ``rope_factor``,
    ``rope_original_max_position``, ``rope_beta_fast/slow``, ``rope_mscale``,
    ``rope_mscale_all_dim``); ``rope_interleave`` rotates adjacent pairs
    (DeepSeek's layout) instead of the two halves.
    MoE: ``n_routed_experts=None`` gives a dense model; layer ``i`` is MoE when
    ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_truncate: bool = True
    rope_interleave: bool = True
    n_routed_experts: int | None = None
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    weight_block_size: tuple[int, int] = (128, 128)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _check_positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "yarn" and not self.rope_factor > 0:
            raise ValueError(f"rope_factor: expected a positive YaRN factor, got {self.rope_factor!r}")
        if self.rope_type == "yarn":
            _check_positive_int("rope_original_max_position", self.rope_original_max_position)
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method: expected one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if len(self.weight_block_size) != 2 or min(self.weight_block_size) <= 0:
            raise ValueError(f"weight_block_size: expected two positive ints, got {self.weight_block_size!r}")
        if self.n_routed_experts is not None:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layer_freq",
                     "n_group", "topk_group"):
            _check_positive_int(name, getattr(self, name))
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok: expected <= n_routed_experts={self.n_routed_experts}, "
                             f"got {self.num_experts_per_tok}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group: expected a divisor of n_routed_experts={self.n_routed_experts}, got {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: expected <= n_group={self.n_group}, got {self.topk_group}")
        # Group-limited routing must leave at least top_k experts to choose from.
        if self.topk_method != "greedy" and self.topk_group * self.experts_per_group < self.num_experts_per_tok:
            raise ValueError(f"topk_group: {self.topk_group} groups of {self.experts_per_group} experts cannot "
                             f"hold num_experts_per_tok={self.num_experts_per_tok}")
        if self.topk_method == "noaux_tc" and self.experts_per_group < 2:
            raise ValueError(f"n_group: noaux_tc scores a group by its two best experts, so groups need >= 2 "
                             f"experts; got {self.experts_per_group}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts: expected >= 0, got {self.n_shared_experts}")

    # ---- derived quantities ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) uses the MoE feed-forward."""
        return (self.n_routed_experts is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def rope_cos_sin_factor(self) -> float:
        """YaRN factor on cos/sin (so on q_pe and k_pe both); 1.0 without YaRN.

        Follows Hugging Face's rule: an explicit ``attention_factor`` wins, else
        ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both are set
        (1.0 for every released DeepSeek config, where they are equal), else
        ``mscale(f)``.
        """
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor is not None:
            return float(self.rope_attention_factor)
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale(f, mscale_all_dim)**2`` under YaRN (DeepSeek's rule)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_type == "yarn" and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return scale

    # ---- storage ----
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict; ``MLAConfig.from_dict`` inverts it."""
        out = dataclasses.asdict(self)
        out["weight_block_size"] = list(self.weight_block_size)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MLAConfig":
        """Inverse of ``to_dict``; ValueError naming unknown or missing fields."""
        if not isinstance(data, dict):
            raise ValueError(f"data: expected a dict of MLAConfig fields, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"data: unknown MLAConfig fields {unknown}")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"data: missing MLAConfig fields {missing}")
        data = dict(data)
        if "weight_block_size" in data:
            data["weight_block_size"] = tuple(data["weight_block_size"])
        return cls(**data)

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> "MLAConfig":
        """Read a Hugging Face DeepSeek-V2/V2-Lite/V3 config.

        Args:
          path_or_dict: a checkpoint directory (holding config.json), the path
            of a config.json, or the parsed dict.

        Both RoPE spellings are read: ``rope_scaling`` plus a top-level
        ``rope_theta`` (DeepSeek's released configs) and ``rope_parameters``
        (newer transformers). Raises ValueError naming the field for an
        unsupported architecture, model_type, activation, bias, RoPE type,
        routing method, scoring function or quantization scheme.
        """
        hf = read_hf_config(path_or_dict)
        return cls(**_fields_from_hf(hf))


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def read_hf_config(path_or_dict) -> dict[str, Any]:
    """A Hugging Face config as a dict, from a dict, a config.json path or a checkpoint directory."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"path_or_dict: no Hugging Face config.json at {path}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"path_or_dict: {path} is not valid JSON ({err})") from err


def _require_value(hf: dict, key: str, allowed: tuple, default=None) -> Any:
    value = hf.get(key, default)
    if value not in allowed:
        raise ValueError(f"{key}: unsupported value {value!r}; this model supports {list(allowed)}")
    return value


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    architectures = hf.get("architectures") or []
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ValueError(f"architectures: unsupported {unsupported}; expected one of {list(SUPPORTED_ARCHITECTURES)}")
    model_type = _require_value(hf, "model_type", SUPPORTED_MODEL_TYPES)
    is_v2 = model_type == "deepseek_v2"
    missing = [key for key in REQUIRED_HF_FIELDS if key not in hf]
    if missing:
        raise ValueError(f"config.json: missing required fields {missing}")
    _require_value(hf, "hidden_act", ("silu",), "silu")
    _require_value(hf, "attention_bias", (False,), False)
    _require_value(hf, "mlp_bias", (False,), False)
    num_heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads") not in (None, num_heads):
        raise ValueError(f"num_key_value_heads: MLA shares one latent across heads and expects it to equal "
                         f"num_attention_heads={num_heads}, got {hf['num_key_value_heads']}")

    fields: dict[str, Any] = {key: hf[key] for key in REQUIRED_HF_FIELDS}
    fields["q_lora_rank"] = hf.get("q_lora_rank")
    fields["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
    fields["max_position_embeddings"] = int(hf.get("max_position_embeddings", 4096))
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    # V2 has no switch: its RoPE is always the interleaved (complex-pair) form.
    fields["rope_interleave"] = True if is_v2 else bool(hf.get("rope_interleave", True))
    fields.update(_rope_fields(hf))
    fields.update(_moe_fields(hf, is_v2))
    fields.update(_quantization_fields(hf))
    return fields


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.type: unsupported RoPE type {rope_type!r}; expected one of {list(ROPE_TYPES)}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"rope_type": rope_type, "rope_theta": float(theta)}
    if rope_type == "yarn":
        if params.get("factor") is None:
            raise ValueError("rope_scaling.factor: a YaRN config needs its factor")
        optional = lambda key: None if params.get(key) is None else float(params[key])
        out.update(
            rope_factor=float(params["factor"]),
            rope_original_max_position=int(params.get("original_max_position_embeddings")
                                           or hf.get("max_position_embeddings", 4096)),
            rope_beta_fast=float(params.get("beta_fast") or 32.0),
            rope_beta_slow=float(params.get("beta_slow") or 1.0),
            rope_mscale=optional("mscale"),
            rope_mscale_all_dim=optional("mscale_all_dim"),
            rope_attention_factor=optional("attention_factor"),
            rope_truncate=bool(params.get("truncate", True)),
        )
    return out


def _moe_fields(hf: dict[str, Any], is_v2: bool) -> dict[str, Any]:
    if hf.get("n_routed_experts") is None:
        return {}
    topk_method = _require_value(hf, "topk_method", TOPK_METHODS, "greedy" if is_v2 else "noaux_tc")
    scoring = _require_value(hf, "scoring_func", SCORING_FUNCS, "softmax" if is_v2 else "sigmoid")
    norm = bool(hf.get("norm_topk_prob", not is_v2))
    scaling = float(hf.get("routed_scaling_factor", 1.0))
    # DeepSeek-V2's code applies routed_scaling_factor only when it does NOT
    # renormalize; V3 does both. Every V2 release has norm_topk_prob=False, so
    # rather than carry two rules, refuse the one combination where they differ.
    if is_v2 and norm and scaling != 1.0:
        raise ValueError("norm_topk_prob: DeepSeek-V2 with norm_topk_prob=true and routed_scaling_factor != 1 "
                         "is not supported (V2 would skip the scaling factor)")
    return dict(
        n_routed_experts=int(hf["n_routed_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(hf.get("moe_layer_freq") or 1),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        topk_method=topk_method,
        scoring_func=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )


def _quantization_fields(hf: dict[str, Any]) -> dict[str, Any]:
    quant = hf.get("quantization_config")
    if not quant:
        return {}
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: unsupported {method!r}; only DeepSeek's block 'fp8' is read")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: unsupported {fmt!r}; expected 'e4m3'")
    block = quant.get("weight_block_size", [128, 128])
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size: expected [rows, cols], got {block!r}")
    return {"weight_block_size": (int(block[0]), int(block[1]))}
