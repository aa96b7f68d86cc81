"""The ragged-batch decode benchmark's CPU-side parts (snapmla_jax/bench/ragged.py): its
scenarios, caches and table. The timings themselves need a GPU."""

import numpy as np
import pytest

from snapmla_jax.bench import ragged
from snapmla_jax.bench.decode import method_work


def test_scenarios_have_their_documented_shapes():
    lens = {name: ragged.scenario_lens(name) for name in ragged.SCENARIOS}
    assert lens["one_long"].shape == (32,) and sorted(set(lens["one_long"])) == [2048, 65536]
    assert lens["mixed"].shape == (64,) and 512 <= lens["mixed"].min() and lens["mixed"].max() <= 32768
    assert (lens["finished"] == 0).sum() == 16 and set(lens["finished"]) == {0, 16384}
    assert (lens["uniform128"] == 16384).all() and lens["uniform128"].shape == (128,)
    assert all(v.dtype == np.int32 for v in lens.values())
    with pytest.raises(ValueError, match="scenario"):
        ragged.scenario_lens("nope")


def test_ragged_caches_give_each_row_its_own_pages_in_order():
    lens = np.asarray([130, 0, 64, 1], np.int32)
    fp8, bf16, table = ragged.make_ragged_caches(lens, layers=2)
    table = np.asarray(table)
    assert fp8.num_layers == 2 and fp8.num_pages == bf16.num_pages == 3 + 0 + 1 + 1
    assert table.shape == (4, 3)
    assert list(table[0]) == [0, 1, 2] and list(table[2, :1]) == [3] and list(table[3, :1]) == [4]
    assert (table < fp8.num_pages).all()  # past a row's pages: page 0, in range


def test_ragged_work_sums_the_rows():
    lens = np.asarray([100, 0, 300])
    got = ragged.ragged_work("fp8", lens, 128, 2)
    want = [sum(method_work("fp8", 1, int(n), 128, 2)[i] for n in lens) for i in range(3)]
    assert list(got) == want


def test_markdown_lists_rows_and_ratios():
    env = dict(device="H100", jax="0.11.2", python="3.12", date="2026-11-26")
    ceil = dict(copy_gbps=2900.0, bf16_tflops=700.0, fp8_tflops=1400.0)
    row = dict(scenario="one_long", batch=32, tokens=129024, max_len=65536, heads=128, s_q=1, layers=4,
               num_splits=2, fp8_ms=0.05, fp8_uniform_ms=0.5, bf16_ms=0.08, balanced_over_uniform=10.0,
               fp8_over_bf16=1.6, fp8_roofline=0.4, measured_utc="2026-11-26 22:00")
    text = ragged.to_markdown(env, ceil, [row, dict(row, fp8_uniform_ms=None, balanced_over_uniform=None)])
    assert "| one_long | 32 | 129024 | 65536 | 128 | 1 | 4 | 2 | 0.05 | 0.5 | 0.08 | 10.00x | 1.60x | 40% |" in text
    assert "| 0.05 | - | 0.08 | - |" in text
    assert "- one_long: B = 32" in text and "uniform128" not in text  # only the scenarios measured
