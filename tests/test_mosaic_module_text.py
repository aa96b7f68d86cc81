"""scripts/mosaic_module_text.py: the kernels' lowered Mosaic modules, compared across code versions on CPU."""

import jax
from script_loader import load_script

import snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 as bf16_kernel


def test_same_code_same_text_and_a_change_is_told(tmp_path, monkeypatch, capsys):
    script = load_script("mosaic_module_text")
    args = ["--kernels", "bf16", "--plans", "uniform"]
    assert script.main(["--out", str(tmp_path / "first"), *args]) == 0
    assert script.main(["--out", str(tmp_path / "again"), "--compare", str(tmp_path / "first"), *args]) == 0
    assert "bf16_uniform.mlir: the same" in capsys.readouterr().out
    # Another register split for the twin's consumers: another module, and the script says so.
    monkeypatch.setattr(bf16_kernel, "PRODUCER_REGISTERS", 40)
    monkeypatch.setattr(bf16_kernel, "CONSUMER_REGISTERS", 232)
    jax.clear_caches()  # the kernel's jit cache keys on its arguments, not on module constants
    assert script.main(["--out", str(tmp_path / "changed"), "--compare", str(tmp_path / "first"), *args]) == 1
    assert "bf16_uniform.mlir: differs" in capsys.readouterr().out
    monkeypatch.undo()
    jax.clear_caches()  # later tests trace the shipped kernel again
    assert script.main(["--out", str(tmp_path / "missing"), "--compare", str(tmp_path / "nowhere"), *args]) == 1
    assert "not in" in capsys.readouterr().out
