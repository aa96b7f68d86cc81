"""tools/time_mgpu_variants.py on the CPU: its variants name the kernels' constants, those that
take another code path still lower for CUDA, and without a GPU it exits 2 and writes nothing."""

import jax
import pytest

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 as bf16_kernel
import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_kernel
from script_loader import load_script

tool = load_script("time_mgpu_variants", "tools")
KERNELS = {"mgpu": (mgpu_kernel, tool.VARIANTS), "small": (small_kernel, tool.SMALL_VARIANTS),
           "bf16": (bf16_kernel, tool.BF16_VARIANTS)}
# Variants whose code paths no other test lowers (the flags' own tests in test_mla_decode_mgpu.py
# lower the rest).
# The producer's flip is "no_producer" or "with_producer" by the jax version (tool.PRODUCER_FLIP).
LOWERED = [("mgpu", name) for name in ("promotion_256", *tool.PRODUCER_FLIP, "issue_by_one_thread",
                                       "registers_40_232", "producer_by_warps", "p_clamped")] + \
          [("small", name) for name in ("promotion_512", "issuer_0", "issue_by_one_thread")]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_each_variant_sets_existing_constants_and_the_baseline_is_shipped(kernel):
    module, variants = KERNELS[kernel]
    settings = tool.variant_settings(module, variants)
    assert set(settings) == set(variants) and variants["baseline"] == {}
    for (owner, constant), value in settings["baseline"].items():
        assert getattr(owner, constant) == value, constant
    for name, values in variants.items():
        for constant, value in values.items():
            owner = mgpu_kernel if constant in tool.SHARED else module
            assert settings[name][(owner, constant)] == value, (name, constant)
            assert value != getattr(owner, constant), (name, constant)  # each variant changes something


def test_a_constant_the_module_lacks_is_refused():
    with pytest.raises(AttributeError):
        tool.variant_settings(mgpu_kernel, {"baseline": {}, "typo": {"NO_SUCH_FLAG": 1}})


@pytest.mark.parametrize("kernel,variant", LOWERED)
def test_variant_lowers_for_cuda(monkeypatch, kernel, variant):
    module, variants = KERNELS[kernel]
    for (owner, constant), value in tool.variant_settings(module, variants)[variant].items():
        monkeypatch.setattr(owner, constant, value)
    jax.clear_caches()  # the kernel's jit cache would hand back the shipped kernel
    load_script("mosaic_module_text").lowered_module(kernel, "uniform")
    monkeypatch.undo()
    jax.clear_caches()  # later tests lower the shipped kernel, not a cached variant


def test_without_a_gpu_it_exits_2_and_writes_nothing(tmp_path, capsys):
    assert tool.main(["--out", str(tmp_path / "out")]) == 2
    assert "time_mgpu_variants" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
