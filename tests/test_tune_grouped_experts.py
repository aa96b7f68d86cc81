"""scripts/tune_grouped_experts.py on the CPU: every setting it sweeps lowers at the model shapes
(the sweep itself needs a GPU), its cases parse, and without a GPU it exits 2."""

import argparse
import sys

import jax
import jax.numpy as jnp
import pytest
from script_loader import load_script

import snapmla_jax.pallas_kernels.grouped_experts as kernel
from snapmla_jax.backend import lower_for_cuda

tune = load_script("tune_grouped_experts")
bench_moe = load_script("bench_moe")


def test_every_setting_lowers_at_v2_lite_and_v3_shapes(monkeypatch):
    monkeypatch.setattr(kernel, "FEW_ASSIGNMENTS", 0)  # as in the sweep: the patched setting, at any T
    for setting in tune.SETTINGS:
        for name in ("v2_lite", "v3"):
            shape = bench_moe.SHAPES[name]
            for attr, value in zip(("COLUMNS", "RUN", "NUM_WARPS", "NUM_STAGES"), setting):
                monkeypatch.setattr(kernel, attr, value)
            jax.clear_caches()
            args = (jnp.zeros((2, shape.hidden), jnp.bfloat16), jnp.ones((2, shape.top_k), jnp.float32),
                    jnp.zeros((2, shape.top_k), jnp.int32),
                    jax.ShapeDtypeStruct((shape.experts, shape.hidden, shape.inner), jnp.bfloat16),
                    jax.ShapeDtypeStruct((shape.experts, shape.hidden, shape.inner), jnp.bfloat16),
                    jax.ShapeDtypeStruct((shape.experts, shape.inner, shape.hidden), jnp.bfloat16))
            lower_for_cuda(lambda *a: kernel.grouped_experts(*a), *args)
    monkeypatch.undo()
    jax.clear_caches()


def test_cases_parse_and_bad_ones_are_refused():
    assert tune.parse_case("v3:8", bench_moe.SHAPES) == ("v3", 8)
    for bad in ("v4:1", "v3", "v3:0", "v3:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            tune.parse_case(bad, bench_moe.SHAPES)


def test_settings_parse_and_bad_ones_are_refused():
    assert tune.parse_setting("64/128/8/3") == (64, 128, 8, 3)
    for bad in ("64/128/8", "64/128/8/x", "0/128/8/3"):
        with pytest.raises(argparse.ArgumentTypeError):
            tune.parse_setting(bad)


def test_without_a_gpu_it_exits_2(tmp_path, monkeypatch):
    # As from the command line: the script loads scripts/bench_moe.py itself (this module's
    # copy must not stand in for it; its dataclasses once failed to build that way on the GPU).
    monkeypatch.delitem(sys.modules, "bench_moe")
    assert tune.main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "grouped_experts_tune.json").exists()
