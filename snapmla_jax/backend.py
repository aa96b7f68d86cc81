"""Choosing how a kernel-level call runs.

"pallas"   : the Pallas kernel, compiled for the GPU.
"interpret": the same Pallas kernel run by Pallas' interpreter (CPU tests).
"xla"      : pure jnp with the same math: the reference path, and what runs on CPU.
"auto"     : "pallas" when JAX's default backend is a GPU, else "xla".
"""

from __future__ import annotations

import functools

import jax

BACKENDS = ("auto", "pallas", "interpret", "xla")


def resolve_backend(backend: str) -> str:
    """Map ``backend`` to one of "pallas", "interpret", "xla"; ValueError otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend == "pallas" and jax.default_backend() != "gpu":
        raise ValueError('backend: "pallas" compiles for a CUDA GPU and none is present; use "interpret" or "xla" on CPU')
    return backend


H100_SMS = 132  # SM count assumed when no GPU is visible (interpret mode, planning)


def sm_count() -> int:
    """The default device's SM count: a GPU's ``core_count``, else ``H100_SMS``."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return H100_SMS
    return getattr(device, "core_count", None) or H100_SMS


@functools.lru_cache(maxsize=None)
def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: the Mosaic GPU kernels' wgmma and TMA)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def mosaic_kernels_run(backend: str) -> bool:
    """Whether the Mosaic GPU kernels run with ``backend`` (resolved): "interpret" (Pallas'
    interpreter), or "pallas" on a Hopper GPU."""
    return backend == "interpret" or (backend == "pallas" and on_hopper())


# The GPU an AOT lowering without a GPU targets (``lower_for_cuda``).
ABSTRACT_GPU_KIND = "NVIDIA H100 80GB HBM3"


def lower_for_cuda(fn, *args):
    """``jax.jit(fn)`` traced on ``args`` and lowered for CUDA, on a machine without a GPU.

    Mosaic GPU kernels lower without a device; the abstract device is an H100
    (``ABSTRACT_GPU_KIND``), for what asks the GPU's kind. Used to
    check layout inference, SMEM allocation and lowering on CPU (tests, probe scripts).
    """
    device = jax.sharding.AbstractDevice(device_kind=ABSTRACT_GPU_KIND, num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def mosaic_module_texts(lowered) -> list[str]:
    """The Mosaic GPU modules in a lowering (``lower_for_cuda``'s), in program order, as MLIR text
    without debug info: what a Mosaic kernel compiles from, so two versions of its Python code can
    be compared on CPU (the same text, the same kernel on the GPU)."""
    from jax.experimental.mosaic.gpu import dialect as mosaic_gpu_dialect
    from jax.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    modules = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.name == "stablehlo.custom_call":
                        config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        if "module" in config:
                            modules.append(ir.StringAttr(config["module"]).value_bytes)
                    walk(inner)

    walk(lowered.compiler_ir("stablehlo").operation)
    context = jax_mlir.make_ir_context()
    mosaic_gpu_dialect.register_dialect(context)
    context.allow_unregistered_dialects = True
    with context:
        return [ir.Module.parse(module).operation.get_asm(enable_debug_info=False) for module in modules]
