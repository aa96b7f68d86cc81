"""scripts/measure_ceilings.py on the CPU: without a GPU it exits 2 and writes nothing; its cuBLAS
side reports None where torch has no CUDA device (the rates themselves need the GPU)."""

from script_loader import load_script

measure_ceilings = load_script("measure_ceilings")


def test_without_a_gpu_it_exits_2(tmp_path, capsys):
    assert measure_ceilings.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "measure_ceilings: needs a CUDA GPU"
    assert not (tmp_path / "ceilings.json").exists()


def test_cublas_rates_are_none_without_cuda():
    assert measure_ceilings.cublas_rates(64) is None


def test_xla_rates_cover_every_operand_layout():
    # On the CPU the rate means nothing; the keys and positivity are what the GPU run reports.
    import jax.numpy as jnp
    rates = measure_ceilings.xla_rates(jnp.float32, 64)
    assert set(rates) == set(measure_ceilings.timing.GEMM_LAYOUTS) and all(r > 0 for r in rates.values())
