"""scripts/bench_moe.py on the CPU: its two programs compute the same layer, its floor counts
the right weights, and without a GPU it exits 2 (the timings need one)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from script_loader import load_script

bench_moe = load_script("bench_moe")
TINY = bench_moe.MoEShape(hidden=32, inner=16, experts=8, top_k=2, shared=1)


# The grouped experts take bf16 stacks whose hidden and inner sizes are multiples of 128.
GROUPED = bench_moe.MoEShape(hidden=128, inner=128, experts=8, top_k=2, shared=1)


@pytest.mark.parametrize("shape, dtype, tokens, names, bound", [
    # float32: the jnp dispatches (the grouped one runs its jnp gathers: no kernel takes float32
    # stacks); sums of <= 32 products in another order, ~1e-7 relative.
    (TINY, jnp.float32, 5, {"ragged", "dense", "gathered", "grouped"}, 1e-5),
    (TINY, jnp.float32, bench_moe.GATHER_BENCH_MAX + 1, {"ragged", "dense"}, 1e-5),
    # bf16 at sizes the grouped experts take: each dispatch rounds its products to bf16 at other
    # points (2**-9 relative each, a few in a row): 1e-2.
    (GROUPED, jnp.bfloat16, 3, {"ragged", "dense", "gathered", "grouped", "sorted"}, 1e-2),
    (GROUPED, jnp.bfloat16, bench_moe.GATHER_BENCH_MAX + 1, {"ragged", "dense", "sorted"}, 1e-2),
])
def test_the_dispatch_programs_compute_the_same_layer(shape, dtype, tokens, names, bound):
    layer = bench_moe.random_layer(shape, dtype=dtype)
    x = jax.random.normal(jax.random.key(1), (tokens, shape.hidden), jnp.float32).astype(dtype)
    programs = bench_moe.compiled_dispatches(layer, x)
    assert set(programs) == names
    # One program per dispatch (the GPU run that first used this compiled the ragged one
    # twice: a jit cache hit), and the layer's own dispatch left as it was.
    texts = {name: fn.as_text() for name, (fn, _) in programs.items()}
    type_name = "f32" if dtype == jnp.float32 else "bf16"
    every_expert = f"{type_name}[{shape.experts},{tokens},{shape.inner}]"  # dense: every expert x every token
    assert every_expert in texts["dense"] and every_expert not in texts["ragged"]
    if "gathered" in texts:
        # grouped: the same dispatch through the grouped experts where they take the stacks, else
        # through the jnp gathers of "gathered"
        kernel = dtype == jnp.bfloat16
        assert ("snapmla_grouped_gemm" in texts["grouped"]) == kernel
        assert "snapmla_grouped_gemm" not in texts["gathered"]
        if not kernel:  # XLA's gathers copy each assignment's expert matrices (float32: visible as such)
            chosen_copies = f"f32[{tokens * shape.top_k},{shape.hidden},{shape.inner}]"
            assert chosen_copies in texts["gathered"] and chosen_copies not in texts["ragged"]
    if "sorted" in texts:  # the assignments in chunks of the grouped GEMM, no every-expert product
        assert "snapmla_grouped_gemm" in texts["sorted"] and every_expert not in texts["sorted"]
    assert (layer.dense_token_range, layer.gather_max_tokens, layer.sorted_min_tokens) == (
        bench_moe.models.moe.DENSE_TOKEN_RANGE, bench_moe.models.moe.GATHER_MAX_TOKENS,
        bench_moe.models.moe.SORTED_MIN_TOKENS)
    outs = {name: np.asarray(jnp.asarray(fn(*args), jnp.float32), np.float64) for name, (fn, args) in programs.items()}
    for name in names - {"ragged"}:
        assert np.abs(outs[name] - outs["ragged"]).max() <= bound * np.abs(outs["ragged"]).max(), name
    assert np.abs(outs["ragged"]).max() > 0


def test_floor_counts_router_shared_and_the_experts_each_dispatch_reads():
    layer = bench_moe.random_layer(TINY, dtype=jnp.bfloat16)
    per_expert = 3 * TINY.hidden * TINY.inner * 2  # gate, up, down in bf16
    always = TINY.hidden * TINY.experts * 2 + TINY.shared * per_expert  # router + one shared expert
    one_token = bench_moe.floor_bytes(layer, jnp.ones((1, TINY.hidden), jnp.bfloat16))
    assert one_token == {"ragged": always + TINY.top_k * per_expert, "dense": always + TINY.experts * per_expert,
                         "chosen_experts": TINY.top_k}
    no_shared = bench_moe.random_layer(dataclasses.replace(TINY, shared=0), dtype=jnp.bfloat16)
    assert bench_moe.floor_bytes(no_shared, jnp.ones((1, TINY.hidden), jnp.bfloat16))["dense"] == \
        TINY.hidden * TINY.experts * 2 + TINY.experts * per_expert


def test_without_a_gpu_it_exits_2(tmp_path):
    assert bench_moe.main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "bench_moe.json").exists()


def test_a_measured_row_and_its_table(monkeypatch):
    # The timing itself is the GPU's; here a stand-in clock checks the row and table around it.
    monkeypatch.setattr(bench_moe.timing, "time_ms", lambda fn, arg_sets, **kwargs: 2.0)
    layer = bench_moe.random_layer(TINY, dtype=jnp.float32)
    row = bench_moe.measure("tiny", 4, layer, copy_gbps=100.0, iters=1)
    floors = bench_moe.floor_bytes(layer, jax.random.normal(jax.random.key(4), (4, TINY.hidden), jnp.bfloat16))
    assert row["ragged_floor_ms"] == pytest.approx(floors["ragged"] / 100e9 * 1e3)
    assert row["dense_of_floor"] == pytest.approx(row["dense_floor_ms"] / 2.0) and row["dense_speedup"] == 1.0
    assert row["gathered_floor_ms"] == row["ragged_floor_ms"] and row["gathered_speedup"] == 1.0
    assert row["grouped_floor_ms"] == row["ragged_floor_ms"] and row["grouped_speedup"] == 1.0
    # float32: the dispatches agree to rounding
    assert row["dense_vs_ragged_rel_l2"] <= 1e-5 and row["gathered_vs_ragged_rel_l2"] <= 1e-5
    assert row["grouped_vs_ragged_rel_l2"] <= 1e-5
    env = {"device": "cpu", "jax": "0", "date": "2026-11-25", "copy_gbps": 100.0}
    assert "| tiny | 4 |" in bench_moe.table(env, [row])
    # Above GATHER_BENCH_MAX the row has no gathered column values; the table shows "-".
    big = bench_moe.measure("tiny", bench_moe.GATHER_BENCH_MAX + 1, layer, copy_gbps=100.0, iters=1)
    assert "gathered_ms" not in big and "grouped_ms" not in big
    line = next(l for l in bench_moe.table(env, [row, big]).splitlines() if l.startswith("| tiny | 17 |"))
    assert line.split("|")[6].strip() == "-"  # the gathered ms column
    # Past DENSE_BENCH_MAX_ELEMENTS (prefill sizes) no dense program either: "-" in its columns.
    monkeypatch.setattr(bench_moe, "DENSE_BENCH_MAX_ELEMENTS", bench_moe.GATHER_BENCH_MAX * TINY.experts * TINY.hidden)
    prefill = bench_moe.measure("tiny", bench_moe.GATHER_BENCH_MAX + 1, layer, copy_gbps=100.0, iters=1)
    assert "dense_ms" not in prefill and "ragged_ms" in prefill
    line = next(l for l in bench_moe.table(env, [prefill]).splitlines() if l.startswith("| tiny | 17 |"))
    assert line.split("|")[5].strip() == "-" and line.split("|")[9].strip() == "-"  # dense ms, dense speed-up
    # Past RAGGED_BENCH_MAX_ELEMENTS neither ragged nor anything measured against it: the other
    # dispatches alone.
    monkeypatch.setattr(bench_moe, "RAGGED_BENCH_MAX_ELEMENTS", 4 * TINY.top_k * TINY.experts * TINY.hidden)
    alone = bench_moe.measure("tiny", 5, layer, copy_gbps=100.0, iters=1)
    assert "ragged_ms" not in alone and not any(k.endswith(("_speedup", "_rel_l2")) for k in alone)
    assert alone["dense_ms"] == alone["gathered_ms"] == 2.0
    line = next(l for l in bench_moe.table(env, [alone]).splitlines() if l.startswith("| tiny | 5 |"))
    assert line.split("|")[4].strip() == "-" and line.split("|")[-2].strip() == "-"  # ragged ms, rel. L2
