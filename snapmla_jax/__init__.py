"""snapmla-jax: SnapMLA FP8 decoding for Multi-head Latent Attention in JAX/Pallas.

Public API: LatentCache, dequantize, write_kv, mla_decode,
quant_error_report, the model (MLAConfig, MLAModel, load_hf_checkpoint,
save_checkpoint, load_checkpoint; expert_sharding for their ``sharding=``, shard_model;
quantize_weights for block-FP8 weights (DECODE_MIN_FP8_ELEMENTS: the size from which they pay
in decode), param_bytes for the weights' footprint)
and generation: ``generate`` (the module ``snapmla_jax.generate``, callable as its
function: ``generate(model, prompts, max_new_tokens=...)``), ``stream`` and
``generate_with_stats``. ``__version__`` is the installed distribution's version.
"""

from importlib import metadata as _metadata

from snapmla_jax.cache import LatentCache, dequantize
from snapmla_jax.quant_report import quant_error_report
from snapmla_jax.write import write_kv
from snapmla_jax.decode import mla_decode
from snapmla_jax.models import (DECODE_MIN_FP8_ELEMENTS, MLAConfig, MLAModel, expert_sharding, load_checkpoint,
                                load_hf_checkpoint, param_bytes, quantize_weights, save_checkpoint, shard_model)

import warnings

# `python -m snapmla_jax.generate` runs a module this package has already
# imported (it is the package's `generate`); that is intended, so runpy's warning
# about it is silenced, for this module only.
warnings.filterwarnings("ignore", message=r"'snapmla_jax\.generate' found in sys\.modules", category=RuntimeWarning)
# Importing from the submodule binds the package attribute `generate` to the module itself
# (callable as its generate function), which must not be rebound to the function here.
from snapmla_jax.generate import generate_with_stats, stream  # noqa: E402

try:
    __version__ = _metadata.version("snapmla-jax")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LatentCache", "dequantize", "quant_error_report", "write_kv", "mla_decode", "MLAConfig", "MLAModel",
           "expert_sharding", "load_checkpoint", "load_hf_checkpoint", "save_checkpoint", "shard_model",
           "quantize_weights", "DECODE_MIN_FP8_ELEMENTS", "param_bytes", "generate", "stream", "generate_with_stats"]
