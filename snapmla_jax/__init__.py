"""snapmla-jax: SnapMLA FP8 decoding for Multi-head Latent Attention in JAX/Pallas.

Public API (see DESIGN.md): LatentCache, dequantize, write_kv, mla_decode,
quant_error_report, the model (MLAConfig, MLAModel, load_hf_checkpoint,
save_checkpoint, load_checkpoint) and generate.
"""

from snapmla_jax.cache import LatentCache, dequantize
from snapmla_jax.quant_report import quant_error_report
from snapmla_jax.write import write_kv
