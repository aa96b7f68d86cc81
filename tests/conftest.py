"""Shared pytest setup.

Tests run on the CPU by default (kernels in Pallas interpret mode). Tests marked
`gpu` need a CUDA device and are selected with `pytest -m gpu`; on a machine
without one they are skipped rather than failing.
"""

import jax
import pytest

jax.config.update("jax_enable_x64", False)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
