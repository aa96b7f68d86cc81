"""scripts/bench_fp8_experts.py on the CPU (kernels interpreted): its programs compute the layer's
output within FP8's rounding, read the bytes their dispatch names, and the table reads."""

import jax
import jax.numpy as jnp
import numpy as np
from script_loader import load_script

bench = load_script("bench_fp8_experts")
bench_moe = load_script("bench_moe")
SMALL = bench_moe.MoEShape(hidden=256, inner=128, experts=8, top_k=2, shared=1)


def test_the_programs_agree_within_fp8_rounding_and_name_their_dispatch(monkeypatch):
    import snapmla_jax.fp8_weights as fp8_weights

    # Each FP8 launch traced: (the kernel-quantization rows it was traced under, which tells the
    # program: 0 fp8_xq, 64 fp8_qk, the default fp8 and fp8_dense; its tokens' rows; whether they
    # came unquantized, x_scales None; MOSAIC_QUANTIZES: which launch quantized the others).
    launches = []
    kernel = fp8_weights.fp8_grouped_gemm_mgpu
    monkeypatch.setattr(fp8_weights, "fp8_grouped_gemm_mgpu",
                        lambda x, xs, *a, **kw: launches.append((fp8_weights.KERNEL_QUANTIZES_MAX_ROWS, x.shape[-2],
                                                                 xs is None, fp8_weights.MOSAIC_QUANTIZES))
                        or kernel(x, xs, *a, **kw))
    default_rows = fp8_weights.KERNEL_QUANTIZES_MAX_ROWS
    layers = {"bf16": bench_moe.random_layer(SMALL)}
    layers["fp8"] = bench.quantize_weights(bench_moe.random_layer(SMALL))
    for tokens, dispatch in ((3, "gathered"), (20, "dense")):
        launches.clear()
        settings = {name: getattr(layers["fp8"], name) for name in bench.DISPATCH_SETTINGS}
        runs, floors = bench.programs(tokens, layers)
        # Every program leaves the layer's dispatch settings as it found them (the FP8 one's own
        # sorted threshold too), so that the next token count runs the defaults again.
        assert {name: getattr(layers["fp8"], name) for name in bench.DISPATCH_SETTINGS} == settings
        assert set(runs) == set(bench.PROGRAMS)
        # Every FP8 program traced launches; the kernel quantizes the tokens of exactly the products
        # of at most its program's rows: none for fp8_xq, all for fp8_qk, the 1-row ones by default.
        # XLA's launches quantize fp8_xq's tokens, the Mosaic GPU quantizer every other program's.
        assert {limit for limit, _, _, _ in launches} == {0, default_rows, bench.MAX_TOKENS}, launches
        for limit, rows, unquantized, mosaic in launches:
            assert unquantized == (rows <= limit) and mosaic == (limit != 0), (tokens, launches)
        assert any(unquantized for limit, _, unquantized, _ in launches
                   if limit == default_rows) == (dispatch == "gathered")
        assert floors["fp8"][0] == dispatch and floors["fp8_dense"][0] == "dense"
        assert floors["fp8_sorted"][0] == ("gathered" if dispatch == "gathered" else "sorted")
        # e4m3 weights and activations (RMS rounding ~2^-4 / 3 of a value each, in quadrature over
        # three products): a few percent of the output; a wrong expert or scale is O(1).
        outs = {name: np.asarray(fn(*args[0]), np.float64) for name, (fn, args) in runs.items()}
        for name in ("fp8", "fp8_xq", "fp8_qk", "fp8_dense", "fp8_sorted"):
            rel = np.linalg.norm(outs[name] - outs["bf16"]) / np.linalg.norm(outs["bf16"])
            assert rel < 0.1, (tokens, name, rel)
        # FP8 values are a byte a weight: half of bf16's bytes (plus the scales) for the experts.
        assert floors["fp8_dense"][1] < 0.6 * floors["bf16"][1] or dispatch == "gathered"


def test_the_table_gives_ratios_and_floors():
    env = {"device": "H200", "jax": "0.11.2", "date": "2026-11-28", "copy_gbps": 4000.0,
           "command": "python scripts/bench_fp8_experts.py --out DIR --shapes v2_lite --tokens 64 --iters 5"}
    row = {"shape": "v2_lite", "tokens": 64, "fp8_dispatch": "dense", "bf16_ms": 0.5, "fp8_ms": 0.25,
           "fp8_xq_ms": 0.4, "fp8_qk_ms": 0.2, "fp8_dense_ms": 0.25, "fp8_sorted_ms": 0.3,
           "fp8_sorted_dispatch": "sorted",
           "fp8_speedup": 2.0, "fp8_xq_speedup": 1.25, "fp8_qk_speedup": 2.5, "fp8_dense_speedup": 2.0,
           "fp8_sorted_speedup": 0.5 / 0.3, "bf16_of_floor": 0.8, "fp8_of_floor": 0.81, "fp8_dense_of_floor": 0.81,
           "fp8_sorted_of_floor": 0.3, "fp8_rel_l2": 0.031}
    text = bench.table(env, [row])
    assert ("| v2_lite | 64 | dense | 0.500 | 0.250 | 0.400 | 0.200 | 0.250 | 0.300 (sorted) | 2.00x | 1.25x | 2.50x | "
            "2.00x | 1.67x | 80% | 81% | 81% | 30% | 0.031 |") in text
    assert "Command: `python scripts/bench_fp8_experts.py --out DIR --shapes v2_lite --tokens 64 --iters 5`" in text


def test_without_a_gpu_it_exits_2(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "FP8 experts benchmark: needs a CUDA GPU" in capsys.readouterr().err


def test_a_profile_keeps_the_longest_launches_and_the_gaps_between_them(monkeypatch):
    """``--profile``'s record of a program: the PROFILE_TOP longest launches a call, largest first,
    and busy / idle time a call from the launches' intervals (here synthetic profiler events: 15
    kernels a call, PROFILE_CALLS calls, each launch 1 us after the last one ends)."""
    from snapmla_jax.bench import timing

    calls, kernels = bench.PROFILE_CALLS, 15
    events, clock = [], 0
    for _ in range(calls):
        for k in range(kernels):
            duration = 1000 * (k + 1)  # kernel k lasts k + 1 us
            events.append(timing.GpuEvent("stream", f"kernel_{k}", clock, duration))
            clock += duration + 1000
    monkeypatch.setattr(timing, "gpu_events", lambda fn, args, calls: events)
    profile = bench.launch_profile(None, ())
    launches = profile["launches_us"]
    assert list(launches) == [f"kernel_{k}" for k in range(kernels - 1, kernels - 1 - bench.PROFILE_TOP, -1)]
    assert launches["kernel_14"] == 15.0
    busy = sum(range(1, kernels + 1))  # us a call
    line = profile["timeline_us"]
    assert line["busy"] == busy and line["idle"] == (calls * kernels - 1) / calls
    assert line["span"] == line["busy"] + line["idle"]


def test_hlo_of_each_program_is_written_where_asked(tmp_path):
    """``--profile``'s HLO: each compiled program's optimized text under the directory given, one
    file a program, named by shape, tokens and program, so that a launch's fusion name can be found."""
    x = jnp.ones((4, 8), jnp.float32)
    runs = {name: (jax.jit(fn).lower(x).compile(), [(x,)]) for name, fn in
            (("bf16", lambda a: jnp.sin(a) * 2.0), ("fp8", lambda a: jnp.cumsum(a, axis=0)))}
    bench.write_hlo(runs, tmp_path / "hlo", "v2_lite_T4")
    written = sorted(p.name for p in (tmp_path / "hlo").iterdir())
    assert written == ["v2_lite_T4_bf16.txt", "v2_lite_T4_fp8.txt"]
    for name, (compiled, _) in runs.items():
        text = (tmp_path / "hlo" / f"v2_lite_T4_{name}.txt").read_text()
        assert text == compiled.as_text() and "ENTRY" in text
