"""The DeepSeek-family MLA model in Flax NNX, Hugging Face checkpoint
conversion and orbax checkpoints. Users import these names from snapmla_jax."""

from snapmla_jax.models.checkpoint import load_checkpoint, save_checkpoint
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.hf_loader import load_hf_checkpoint
from snapmla_jax.models.layers import DECODE_MIN_FP8_ELEMENTS, quantize_weights
from snapmla_jax.models.sharding import expert_sharding, shard_model
from snapmla_jax.models.transformer import MLAModel, param_bytes

__all__ = ["MLAConfig", "MLAModel", "load_hf_checkpoint", "save_checkpoint", "load_checkpoint", "expert_sharding",
           "shard_model", "quantize_weights", "DECODE_MIN_FP8_ELEMENTS", "param_bytes"]
