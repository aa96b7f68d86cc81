"""Choosing how a kernel-level call runs.

"pallas"   : the Pallas kernel, compiled for the GPU.
"interpret": the same Pallas kernel run by Pallas' interpreter (CPU tests).
"xla"      : pure jnp with the same math: the reference path, and what runs on CPU.
"auto"     : "pallas" when JAX's default backend is a GPU, else "xla".
"""

from __future__ import annotations

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
