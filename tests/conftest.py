"""Shared pytest setup.

Tests run on the CPU by default (kernels in Pallas interpret mode). Tests marked
`gpu` need a CUDA device and are selected with `pytest -m gpu`; on a machine
without one they are skipped rather than failing.
"""

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_enable_x64", False)


def pytest_addoption(parser):
    parser.addoption("--one-case-each", action="store_true",
                     help="run only the first parametrized case of each test function (CI's run on the "
                          "newest jax, which checks that the code still runs there; the full matrix runs "
                          "on the jax of README's test command)")


def pytest_configure(config):
    """One persistent compilation cache (``jax_compilation_cache_dir``) for the test run: a fresh
    directory, removed at the end, shared by the xdist workers and every Python process a test
    starts (they inherit the environment, which jax reads when imported), so a program compiled in
    one process is loaded, not compiled again, in the others. Every compilation is kept, however
    quick (the tiny models' many small programs are most of what they cost). A cache directory
    already in the environment is used as it is."""
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # an xdist worker (its controller made the cache) or the environment's own cache
    config.compilation_cache_dir = tempfile.mkdtemp(prefix="snapmla-jax-compilation-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config.compilation_cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)  # this process
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    if getattr(config, "compilation_cache_dir", None):
        shutil.rmtree(config.compilation_cache_dir, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if config.getoption("one_case_each"):
        functions, kept, dropped = set(), [], []
        for item in items:
            function = (item.path, item.originalname)
            (dropped if function in functions else kept).append(item)
            functions.add(function)
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
