"""The decode benchmark's table and ceilings (the timings need a GPU; its markdown and the
ceiling programs' math do not)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.bench import decode, flashmla, timing

ENV = {"device": "test device", "jax": "0", "python": "3", "date": "2026-11-23"}
CEILINGS = {"copy_gbps": 1000.0, "bf16_tflops": 500.0, "fp8_tflops": 900.0}
COMMAND = "python -m snapmla_jax.bench decode --preset vs-flashmla --out /tmp/x"


def _row(batch, measured=None):
    row = {"batch": batch, "context": 1024, "heads": 128, "s_q": 1, "fp8_ms": 0.5, "bf16_ms": 0.75,
           "xla_bf16_ms": 2.0, "fp8_over_bf16": 1.5, "fp8_over_xla": 4.0}
    if measured:
        row["measured_utc"] = measured
    return row


def test_decode_table_says_when_each_row_was_measured():
    rows = [_row(8, "2026-11-23 16:49"), _row(32, "2026-11-23 17:30"), _row(64)]
    lines = decode.to_markdown(ENV, CEILINGS, rows, "no", COMMAND, merged=True).splitlines()
    header = next(line for line in lines if line.startswith("| B |"))
    assert header.rstrip(" |").endswith("measured (UTC)")
    body = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and line[2].isdigit()}
    assert body["8"].rstrip(" |").endswith("2026-11-23 16:49")
    assert body["32"].rstrip(" |").endswith("2026-11-23 17:30")
    assert body["64"].rstrip(" |").endswith("-")  # rows from before the column existed
    assert "1.50x" in body["8"]
    assert any("code of their time" in line for line in lines)
    assert f"Regenerate: `{COMMAND}`." in lines


def test_a_merged_page_names_the_command_that_measures_all_its_rows():
    """--merge keeps rows of earlier runs: the page's command lists every row's shape and none of
    the options that chose this run's shapes."""
    argv = ["--shapes", "64x16384x16x2", "--methods", "fp8", "bf16", "--merge", "--quick", "--preset=small",
            "--batches", "3", "--name", "vs", "--out", "/tmp/x"]
    assert decode.full_page_argv(argv, [(1, 4096, 16, 1), (64, 16384, 16, 2)]) == [
        "--shapes", "1x4096x16x1", "64x16384x16x2", "--methods", "fp8", "bf16", "--name", "vs", "--out", "/tmp/x"]
    assert decode.full_page_argv(["--preset", "small", "--merge"], [(2, 8, 16, 1)]) == ["--shapes", "2x8x16x1"]


def test_decode_table_without_merged_rows_has_no_merge_note():
    text = decode.to_markdown(ENV, CEILINGS, [_row(8, "2026-11-23 16:49")], "no", COMMAND)
    assert "earlier invocations" not in text


def test_benchmarks_exit_2_with_one_line_without_a_gpu(capsys):
    """On a CPU the GPU benchmarks print one line naming themselves and exit with status 2."""
    if not timing.missing_gpu("probe"):
        pytest.skip("a GPU is present")
    assert decode.main(["--quick"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["probe: needs a CUDA GPU", "decode benchmark: needs a CUDA GPU"]


def test_chain_layers_reads_past_the_l2_and_stays_addressable():
    """Small problems chain enough layers to read CHAIN_BYTES of fp8 cache (above
    MIN_CHAIN_CALLS, the least multiple of it that does); large ones one layer; no chain
    exceeds the kernels' int32 offsets or MAX_CHAIN, and every chain makes at least
    MIN_CHAIN_CALLS calls."""
    from snapmla_jax.cache import kernel_addressable
    group = decode.MIN_CHAIN_CALLS
    assert decode.chain_layers(32, 16384) == 1  # 524k tokens x 644 B > 256 MiB
    assert decode.chain_layers(1, 1024) == decode.MAX_CHAIN
    assert decode.chain_calls(1) == decode.chain_calls(3) == group and decode.chain_calls(24) == 24
    for batch, context in ((1, 4096), (8, 4096), (1, 65536), (8, 16384), (32, 4096), (1, 32768)):
        layers = decode.chain_layers(batch, context)
        tokens = batch * context
        assert layers * tokens * decode.FP8_BYTES_PER_TOKEN >= decode.CHAIN_BYTES
        fewer = layers - group if layers > group else layers - 1
        assert fewer * tokens * decode.FP8_BYTES_PER_TOKEN < decode.CHAIN_BYTES
        assert layers <= group or layers % group == 0
        assert kernel_addressable(layers * tokens)
        assert decode.chain_calls(layers) >= group


@pytest.mark.parametrize("layers", [3, 16])
def test_decode_chain_is_the_layers_called_in_turn(layers):
    """decode_chain(layers) over a layered cache = chain_calls(layers) mla_decode calls, call i
    over layer i mod layers and fed the previous output (3 layers: 8 calls unrolled, coming back
    to layer 0; 16: two loop iterations of 8); the layers of make_caches hold the same contents.
    The XLA path: the chain is the same whatever runs each call."""
    from snapmla_jax.decode import mla_decode

    backend = "xla"
    batch, context, heads, s_q = 3, 128, 16, 1
    fp8, bf16, block_table = decode.make_caches(batch, context, seed=1, layers=layers)
    assert fp8.num_layers == bf16.num_layers == layers
    np.testing.assert_array_equal(np.asarray(bf16.latent[2], np.float32), np.asarray(bf16.latent[0], np.float32))
    q, q_rope, seq_lens, scale = decode.make_queries(batch, context, heads, s_q)
    seq_lens = seq_lens.at[1].set(70)  # a partial page too
    # Different layer contents, so that a chain reading the wrong layer would differ.
    weights = jnp.linspace(0.5, 2.0, layers, dtype=jnp.float32).astype(jnp.bfloat16)
    bf16 = bf16.__class__(latent=bf16.latent * weights[:, None, None, None], scale=None, rope=bf16.rope)
    chained = decode.decode_chain(scale, layers, backend)(q, q_rope, bf16, block_table, seq_lens)
    expected = q
    for call in range(decode.chain_calls(layers)):
        expected = mla_decode(expected, q_rope, bf16, block_table, seq_lens, softmax_scale=scale,
                              layer=call % layers, backend=backend)
    assert chained.shape == q.shape and chained.dtype == q.dtype
    # Same ops on the same inputs in the same order: equal up to XLA's fusion choices
    # (a bf16 ulp, 2**-8 relative, a call, over up to 16 calls that each mix their query).
    np.testing.assert_allclose(np.asarray(chained, np.float32), np.asarray(expected, np.float32),
                               rtol=2 ** -5, atol=1e-5)
    single = decode.decode_chain(scale, 1, backend)(q, q_rope, bf16.layer_arrays(1), block_table, seq_lens)
    expected = q
    for _ in range(decode.chain_calls(1)):
        expected = mla_decode(expected, q_rope, bf16, block_table, seq_lens, softmax_scale=scale, layer=1,
                              backend=backend)
    np.testing.assert_allclose(np.asarray(single, np.float32), np.asarray(expected, np.float32),
                               rtol=2 ** -5, atol=1e-5)
    with pytest.raises(ValueError, match="layers: expected at most 8 or a multiple of it, got 12"):
        decode.decode_chain(scale, 12, backend)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_ceiling_gemm_layouts_all_compute_the_same_product(dtype):
    programs = timing.gemm_programs(dtype, 64)
    assert set(programs) == set(timing.GEMM_LAYOUTS)
    a, b = (np.asarray(x, np.float64) for x in programs["b_kn"][1])
    want = a @ b
    for name, (fn, args) in programs.items():
        got = np.asarray(fn(*args), np.float64)
        # e4m3/bf16 operands are exact in the f32 accumulator; only the bf16 result is rounded
        # (2**-9 relative to each element's magnitude, which is at most the row norms' product).
        assert np.abs(got - want).max() <= 2**-8 * np.abs(a).sum(1).max() * np.abs(b).max(), name


def test_gemm_ceiling_is_the_fastest_layout(monkeypatch):
    times = iter([2.0, 0.5])  # ms, in GEMM_LAYOUTS order
    monkeypatch.setattr(timing, "time_ms", lambda *args, **kwargs: next(times))
    assert timing.measure_gemm_tflops(jnp.bfloat16, 64) == pytest.approx(2 * 64**3 / 0.5e-3 / 1e12)


def test_method_work_counts_the_cache_and_the_products():
    # B=64 x 16k x 128, s_q=1: 64*16384 tokens x 644 B + bf16 queries/outputs; FP8 FLOPs
    # 2*64*128*16384*(512+512), bf16 2*64*128*16384*64.
    nbytes, f8, f16 = decode.method_work("fp8", 64, 16384, 128, 1)
    assert nbytes == 64 * 16384 * 644 + 64 * 128 * 1088 * 2
    assert (f8, f16) == (2 * 64 * 128 * 16384 * 1024, 2 * 64 * 128 * 16384 * 64)
    assert decode.method_work("bf16", 64, 16384, 128, 1) == (64 * 16384 * 1152 + 64 * 128 * 1088 * 2, 0, f8 + f16)
    fast = timing.Ceilings(copy_gbps=3000.0, bf16_tflops=700.0, fp8_tflops=1400.0)
    slow = dataclasses.replace(fast, fp8_tflops=900.0)
    # A faster FP8 ceiling shortens the FP8 kernel's roofline (compute-bound here), not the bf16 path's.
    assert decode.roofline_ms(nbytes, f8, f16, fast) < decode.roofline_ms(nbytes, f8, f16, slow)
    bf16_work = decode.method_work("bf16", 64, 16384, 128, 1)
    assert decode.roofline_ms(*bf16_work, fast) == decode.roofline_ms(*bf16_work, slow)


def test_kept_rows_keep_the_ceilings_of_the_run_that_timed_them():
    """--merge: a kept row's % roof and ceilings stay its own run's; a row saved before rows
    carried ceilings gets its file's; the table labels each row with its run's ceilings."""
    older = {"copy_gbps": 2900.0, "bf16_tflops": 730.0, "fp8_tflops": 1401.0}
    newer = {"copy_gbps": 2930.0, "bf16_tflops": 734.0, "fp8_tflops": 1487.0}
    own = dict(_row(32, "2026-11-26 17:54"), fp8_roofline=0.61, ceilings=older, device="GPU A")
    legacy = dict(_row(64, "2026-11-25 10:00"), fp8_roofline=0.57)
    kept_own = decode.with_run_ceilings(own, newer, "GPU B")
    kept_legacy = decode.with_run_ceilings(legacy, newer, "GPU B")
    assert kept_own["ceilings"] == older and kept_own["device"] == "GPU A" and kept_own["fp8_roofline"] == 0.61
    assert kept_legacy["ceilings"] == newer and kept_legacy["device"] == "GPU B"
    assert "ceilings" not in legacy  # the input row is not modified
    fresh = decode.with_run_ceilings(dict(_row(128, "2026-11-26 20:00"), fp8_roofline=0.6), newer, "GPU B")
    runs = decode.ceiling_runs([kept_own, kept_legacy, fresh])
    assert [(name, len(members)) for name, _, members in runs] == [("c1", 1), ("c2", 2)]
    lines = decode.to_markdown(ENV, newer, [kept_own, kept_legacy, fresh], "no", COMMAND, merged=True).splitlines()
    body = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and line[2].isdigit()}
    assert "| 61% |" in body["32"] and body["32"].split("|")[-3].strip() == "c1"
    assert body["64"].split("|")[-3].strip() == "c2" and body["128"].split("|")[-3].strip() == "c2"
    legend = [line for line in lines if line.startswith("- c")]
    assert legend[0].startswith("- c1: GPU A, copy 2900 GB/s") and "FP8 GEMM 1401 TFLOP/s" in legend[0]
    assert "rows measured 2026-11-25 10:00 to 2026-11-26 20:00 UTC" in legend[1]


def test_round_robin_times_every_run_in_turn_and_reports_failures(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "sample_ms", lambda fn, arg_sets, *, iters, inner=10, first=0:
                        [fn(*arg_sets[0])] * iters)

    def fast(x):
        calls.append("fast")
        return x

    def slow(x):
        calls.append("slow")
        return x * 3

    def broken(x):
        raise RuntimeError("does not compile\nsecond line")

    result = timing.time_round_robin({"fast": (fast, [(1.0,)]), "slow": (slow, [(1.0,)]),
                                      "broken": (broken, [(1.0,)])}, rounds=3, warmup=1, iters=5)
    assert result["fast"] == 1.0 and result["slow"] == 3.0
    assert isinstance(result["broken"], RuntimeError)
    # One warm-up call each, then three rounds of one sample of each (the broken one left out).
    assert calls[:2] == ["fast", "slow"]
    assert all(sorted(calls[2 + 2 * r:4 + 2 * r]) == ["fast", "slow"] for r in range(3)) and len(calls) == 8


def test_round_robin_varies_which_run_a_sample_follows(monkeypatch):
    """The GPU's clock after a sample depends on what it ran: over the rounds each run's samples
    follow different runs, not always the same one (as a fixed rotation would have them)."""
    order = []
    monkeypatch.setattr(timing, "sample_ms", lambda fn, arg_sets, *, iters, inner=10, first=0:
                        [fn(*arg_sets[0])] * iters)

    def run(name):
        return lambda x: order.append(name) or 1.0

    names = ["a", "b", "c", "d"]
    timing.time_round_robin({n: (run(n), [(0,)]) for n in names}, warmup=1, iters=12)
    timed = order[len(names):]
    assert len(timed) == 12 * len(names)
    rounds = [timed[i:i + len(names)] for i in range(0, len(timed), len(names))]
    assert all(sorted(r) == names for r in rounds)  # default: one sample of each a round
    before = {n: {timed[i - 1] for i in range(1, len(timed)) if timed[i] == n} for n in names}
    # (A rotation gives each run two predecessors: the one before it in the order, and at the
    # start of a round the last of the round before.)
    assert all(prev - {n} == set(names) - {n} for n, prev in before.items()), before


def test_round_robin_samples_last_at_least_min_sample_ms(monkeypatch):
    inners = {}

    def fake_sample_ms(fn, arg_sets, *, iters, inner=10, first=0):
        per_call = fn(*arg_sets[0])
        inners.setdefault(per_call, []).append(inner)
        return [per_call] * iters

    monkeypatch.setattr(timing, "sample_ms", fake_sample_ms)
    result = timing.time_round_robin({"short": (lambda x: 0.25, [(0,)]), "long": (lambda x: 5.0, [(0,)])},
                                     rounds=2, warmup=1, iters=4, inner=10, min_sample_ms=30.0)
    assert result == {"short": 0.25, "long": 5.0}
    # After a probe sample of 10 calls: 30 ms / 0.25 ms = 120 calls a sample; the 5 ms calls keep 10.
    assert inners[0.25] == [10, 120, 120] and inners[5.0] == [10, 10, 10]


def _stand_in_rows(monkeypatch, chain):
    """``decode.measure_config`` over B = 2 x 128 x 16 heads with ``chain`` standing in for
    ``decode_chain`` and a sampler that reports what each stand-in returns: (measure(**kwargs)
    -> row, the ceilings the rows use)."""
    monkeypatch.setattr(decode, "decode_chain", chain)
    monkeypatch.setattr(timing, "sample_ms", lambda fn, arg_sets, *, iters, inner=10, first=0:
                        [fn(*arg_sets[0])] * iters)
    caches = decode.make_caches(2, 128)
    ceilings = timing.Ceilings(**CEILINGS)
    measure = lambda **kwargs: decode.measure_config(2, 128, 16, 1, caches, ceilings, 4, "does not fit", 1 << 34,
                                                     rounds=2, **kwargs)
    return measure, ceilings


def test_a_row_times_its_methods_side_by_side(monkeypatch):
    # Stand-in programs per (backend, cache): each returns its own time, which the mocked
    # sampler reports; the XLA one fails to compile.
    ms = {("pallas", "fp8"): 0.5, ("pallas", "bf16"): 0.8}

    def chain(scale, layers, backend):
        def fn(q, q_rope, cache, block_table, seq_lens):
            if backend == "xla":
                raise ValueError("no XLA here\nmore")
            # A chain's time: its calls' (``chain_calls``), which the row divides back out.
            return ms[(backend, "fp8" if cache.scale is not None else "bf16")] * decode.chain_calls(layers)
        return fn

    measure, ceilings = _stand_in_rows(monkeypatch, chain)
    row = measure()
    assert "fp8_q2_ms" not in row  # an option: timed when asked for
    assert (row["fp8_ms"], row["bf16_ms"]) == (0.5, 0.8)
    assert row["fp8_over_bf16"] == pytest.approx(1.6) and "fp8_over_xla" not in row
    assert row["xla_bf16_ms"] is None and row["xla_bf16_note"] == "ValueError: no XLA here"
    assert row["stock_mqa_ms"] is None and row["stock_mqa_note"] == "does not run: does not fit"
    nbytes, f8, f16 = decode.method_work("fp8", 2, 128, 16, 1)
    assert row["fp8_roofline"] == pytest.approx(decode.roofline_ms(nbytes, f8, f16, ceilings) / 0.5)


def test_the_two_term_query_is_timed_beside_fp8_when_asked_for(monkeypatch):
    def chain(scale, layers, backend, query_terms=1):
        def fn(q, q_rope, cache, block_table, seq_lens):
            return {1: 0.5, 2: 0.55}[query_terms] * decode.chain_calls(layers)
        return fn

    measure, ceilings = _stand_in_rows(monkeypatch, chain)
    row = measure(methods=("fp8", "fp8_q2"))
    assert (row["fp8_ms"], row["fp8_q2_ms"]) == (0.5, 0.55)
    assert row["fp8_q2_over_fp8"] == pytest.approx(1.1)
    # Its roofline counts the second Q.K product's FP8 work on the same bytes.
    nbytes, f8, f16 = decode.method_work("fp8_q2", 2, 128, 16, 1)
    assert (nbytes, f16) == decode.method_work("fp8", 2, 128, 16, 1)[::2]
    assert f8 == decode.method_work("fp8", 2, 128, 16, 1)[1] + 2 * 2 * 16 * 128 * 512
    assert row["fp8_q2_roofline"] == pytest.approx(decode.roofline_ms(nbytes, f8, f16, ceilings) / 0.55)
    text = decode.to_markdown(ENV, CEILINGS, [row], "no", COMMAND)
    assert "| FP8 2-term query ms |" in text and "query_terms=2" in text


def test_flashmla_columns_appear_only_where_it_was_timed():
    without = decode.to_markdown(ENV, CEILINGS, [_row(8)], "no", COMMAND)
    assert "FlashMLA" not in without
    timed = dict(_row(8), flashmla_ms=0.6, flashmla_over_fp8=1.2, flashmla_over_bf16=0.75,
                 flashmla_agreement={"rel_to_max": 0.004, "cos_diff": 1e-6})
    text = decode.to_markdown(ENV, CEILINGS, [timed], "no", COMMAND, flashmla_name="extension x.so")
    header = next(line for line in text.splitlines() if line.startswith("| B |"))
    assert "| FlashMLA ms |" in header and "| FlashMLA/FP8 |" in header
    assert "1.20x" in text and "extension x.so" in text and "<= 0.004" in text


def test_flashmla_is_absent_without_the_package_and_a_bad_path_names_the_flag(tmp_path):
    assert flashmla.load("none") is None
    assert flashmla.load("auto") is None  # no flash_mla package (nor a GPU) on the test machine
    with pytest.raises(ValueError, match="^--flashmla: .*nope"):
        flashmla.load(str(tmp_path / "nope.so"))


def test_smoothness_finds_a_cliff_past_a_wave():
    rows = [{"batch": b, "context": 16384, "heads": 128, "s_q": 1, "fp8_ms": ms, "flashmla_ms": 0.01 * b}
            for b, ms in ((1, 0.05), (66, 0.48), (72, 0.87), (256, 1.8))]
    by_method = {g["method"]: g for g in decode.smoothness(rows)}
    line_72 = 0.05 + (1.8 - 0.05) * 71 / 255
    assert by_method["fp8"]["worst_batch"] == 72
    assert by_method["fp8"]["worst_ratio"] == pytest.approx(0.87 / line_72)
    assert by_method["flashmla"]["worst_ratio"] == pytest.approx(1.0)
    assert "bf16" not in by_method  # not timed
    assert decode.smoothness(rows[:2]) == []  # two batch sizes draw no line to leave


@pytest.mark.parametrize("text", ["64x16384x128", "64x16384x128x0", "ax1x1x1", ""])
def test_a_bad_shape_is_refused_with_the_form_expected(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="BxCTXxHxSQ"):
        decode.parse_shape(text)
    assert decode.parse_shape("64x16384x128x2") == (64, 16384, 128, 2)


def test_the_page_says_which_shapes_were_not_run_and_why():
    skipped = (("B=256 x 16384", "int32 offsets"), ("B=128 x 32768", "int32 offsets"), ("B=512 x 1024", "memory"))
    lines = decode.to_markdown(ENV, CEILINGS, [_row(8)], "no", COMMAND, skipped=skipped).splitlines()
    assert "Not run (int32 offsets): B=256 x 16384, B=128 x 32768." in lines
    assert "Not run (memory): B=512 x 1024." in lines
    assert not any("Not run" in line for line in decode.to_markdown(ENV, CEILINGS, [_row(8)], "no", COMMAND).splitlines())
