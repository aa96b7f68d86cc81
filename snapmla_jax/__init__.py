"""snapmla-jax: SnapMLA FP8 decoding for Multi-head Latent Attention in JAX/Pallas.

Public API: LatentCache, dequantize, write_kv, mla_decode,
quant_error_report, the model (MLAConfig, MLAModel, load_hf_checkpoint,
save_checkpoint, load_checkpoint; expert_sharding for their ``sharding=``, shard_model)
and generate.
"""

from snapmla_jax.cache import LatentCache, dequantize
from snapmla_jax.quant_report import quant_error_report
from snapmla_jax.write import write_kv
from snapmla_jax.decode import mla_decode
from snapmla_jax.models import (MLAConfig, MLAModel, expert_sharding, load_checkpoint, load_hf_checkpoint, save_checkpoint,
                    shard_model)

import warnings

# `python -m snapmla_jax.generate` runs a module this package has already
# imported (for the generate function); that is intended, so runpy's warning
# about it is silenced, for this module only.
warnings.filterwarnings("ignore", message=r"'snapmla_jax\.generate' found in sys\.modules", category=RuntimeWarning)
from snapmla_jax.generate import generate  # noqa: E402

__all__ = ["LatentCache", "dequantize", "quant_error_report", "write_kv", "mla_decode", "MLAConfig", "MLAModel",
           "expert_sharding", "load_checkpoint", "load_hf_checkpoint", "save_checkpoint", "shard_model", "generate"]
