"""scripts/bench_fp8_absorbed.py on the CPU: its programs compute the same products within the
activation rounding, its table reads, and without a GPU it exits 2."""

import jax
import numpy as np
import pytest
from script_loader import load_script

bench = load_script("bench_fp8_absorbed")


def test_the_programs_compute_the_same_products_over_the_chain():
    runs = bench.programs(heads=3, rank=256, nope=128, v=128, tokens=5, copies=2, backend="interpret")
    assert set(runs) == set(bench.PROGRAMS)
    outs = {name: [np.asarray(o, np.float64) for o in fn(*args[0])] for name, (fn, args) in runs.items()}
    for i in range(2):  # q_latent, then the value product
        size = np.abs(outs["bf16"][i]).max()
        # bf16 products against block-FP8 weights and e4m3 activations (2^-4 relative each, averaged
        # over 128-256 channels and two copies): well under 5% of the largest output; a transposed
        # weight, a lost copy or a head paired with another's matrix is off by the output's size.
        for name in ("fp8", "fp8_qk", "fp8_xla"):
            assert np.abs(outs[name][i] - outs["bf16"][i]).max() <= 0.05 * size, (name, i)
        assert size > 0
    assert "fp8_qk" not in bench.programs(2, 256, 128, 128, tokens=65, copies=2, backend="xla")


def test_a_chain_reads_past_the_l2():
    assert bench.copies_for(16, 512, 128, 128) == 64  # 2 MiB of e4m3 a V2-Lite layer: 128 MiB in 64
    assert bench.copies_for(128, 512, 128, 128) == 8
    assert bench.copies_for(4096, 512, 128, 128) == 2


def test_the_table_gives_ratios_and_the_copy_fraction():
    env = {"device": "H100", "jax": "0.11.2", "date": "2026-12-05", "copy_gbps": 3000.0}
    row = {"shape": "v3", "heads": 128, "tokens": 16, "bf16_us": 12.0, "fp8_us": 8.0, "fp8_xla_us": 30.0,
           "bf16_gbps": 2796.0, "fp8_gbps": 2097.0}
    text = bench.table(env, [row, dict(row, fp8_qk_us=6.0)])
    assert "| v3 | 128 | 16 | 12.0 | 8.0 | - | 30.0 | 1.50x | - | 93% | 70% |" in text
    assert "| v3 | 128 | 16 | 12.0 | 8.0 | 6.0 | 30.0 | 1.50x | 2.00x | 93% | 70% |" in text


@pytest.mark.parametrize("flags, message", [(["--shapes", "v9"], "invalid choice"),
                                            (["--tokens", "0"], "--tokens: expected ints >= 1")])
def test_bad_flags_are_refused_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", "/tmp/unused", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal without a GPU")
def test_without_a_gpu_it_exits_2(tmp_path):
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())
