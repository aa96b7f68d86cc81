"""scripts/bench_fp8_gemm.py on the CPU: its programs compute the same product within the
activation rounding, its table reads, and without a GPU it exits 2."""

import jax
import numpy as np
import pytest
from script_loader import load_script

bench = load_script("bench_fp8_gemm")


def test_the_programs_compute_the_same_product_over_the_chain():
    runs = bench.programs(128, 256, 16, copies=2)
    assert set(runs) == set(bench.PROGRAMS)
    assert "fp8_qk" not in bench.programs(128, 256, 128, copies=1)  # past 64 tokens the tiled kernel: no variant
    outs = {name: np.asarray(fn(*args[0]), np.float64) for name, (fn, args) in runs.items()}
    size = np.abs(outs["bf16"]).max()
    # bf16 products of bf16 operands against block-FP8 weights (2^-4 relative a weight, averaged
    # over 256 channels and two copies): well under 5% of the largest output; a lost copy or a
    # transposed weight would be off by the output's own size.
    for name in ("fp8", "fp8_qk", "fp8_xla", "fp8_tensor"):
        assert np.abs(outs[name] - outs["bf16"]).max() <= 0.05 * size, name
    assert size > 0


def test_the_table_gives_ratios_and_the_copy_fraction():
    env = {"device": "H100", "jax": "0.11.2", "date": "2026-11-28", "copy_gbps": 3000.0}
    row = {"out": 18432, "in": 7168, "tokens": 16, "bf16_us": 100.0, "fp8_us": 50.0, "fp8_xla_us": 250.0,
           "fp8_tensor_us": 40.0, "fp8_gbps": 2640.0}
    text = bench.table(env, [row, dict(row, fp8_qk_us=40.0)])
    # 2 x 16 x 18432 x 7168 FLOP in 50 us: 85 TFLOP/s; without an fp8_qk time its cells are "-".
    assert "| 18432 x 7168 | 16 | 100.0 | 50.0 | - | 250.0 | 40.0 | 2.00x | - | 2640 | 88% | 85 | 80% | 0.40x |" in text
    assert "| 18432 x 7168 | 16 | 100.0 | 50.0 | 40.0 | 250.0 | 40.0 | 2.00x | 2.50x | 2640 |" in text


def test_a_chain_runs_over_enough_copies_to_come_from_hbm_below_the_compute_bound_sizes():
    assert bench.copies_for(18432, 7168, 16) == 4  # 126 MiB a copy: 384 MiB in four
    assert bench.copies_for(2048, 2048, 64) == 96
    assert bench.copies_for(18432, 7168, bench.COMPUTE_TOKENS) == 1
    assert bench.copies_for(576, 2048, 16, 160 << 20) == 143  # --chain-mib 160: 1.125 MiB a copy


@pytest.mark.parametrize("flags, message", [(["--shapes", "12x"], "expected OUTxIN"),
                                            (["--tokens", "0"], "--tokens: expected ints >= 1"),
                                            (["--chain-mib", "0"], "--chain-mib: expected an int >= 1")])
def test_bad_flags_are_refused_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", "/tmp/unused", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_it_exits_2(tmp_path):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert bench.main(["--out", str(tmp_path)]) == 2
