"""scripts/profile_decode_launches.py, scripts/tune_combine_splits.py and scripts/sweep_splits.py:
their case parsing, a clean exit without a GPU, and the profiler helpers (timing.kernel_times_us,
timeline_us, kernel_us_by_call)."""

import argparse

import pytest
from script_loader import load_script


def _script(name: str = "profile_decode_launches"):
    return load_script(name)


def test_cases_parse_and_bad_ones_name_the_form():
    script = _script()
    assert script.parse_case("8x4096x128x2") == (8, 4096, 128, 2)
    for bad in ("8x4096x128", "8x4k x128x2", "axbxcxd"):
        with pytest.raises(argparse.ArgumentTypeError, match="B x ctx x H x s_q"):
            script.parse_case(bad)


def test_without_a_gpu_it_exits_2(tmp_path):
    # CI has no GPU: the script says so and writes nothing.
    assert _script().main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "launches.json").exists()


def test_kernel_times_read_a_trace():
    # The profiler's trace is written and read back; a CPU run has no GPU plane, so no kernels.
    import jax
    import jax.numpy as jnp

    from snapmla_jax.bench import timing

    assert timing.kernel_times_us(jax.jit(lambda x: x + 1), (jnp.ones(3),), calls=2) == {}
    assert timing.gpu_events(jax.jit(lambda x: x + 1), (jnp.ones(3),), calls=2) == []


def test_timeline_counts_overlaps_once_and_gaps_as_idle():
    from snapmla_jax.bench.timing import GpuEvent, kernel_totals_us, timeline_us

    # Two calls: a 10 us kernel, then 2 us later a 4 us merge overlapping a 3 us copy on
    # another line (busy 5 us together), then a 6 us gap before the next call.
    events = [GpuEvent("s", "kernel", 0, 10_000), GpuEvent("s", "merge", 12_000, 4_000),
              GpuEvent("c", "copy", 13_000, 3_000), GpuEvent("s", "kernel", 22_000, 10_000),
              GpuEvent("s", "merge", 34_000, 4_000)]
    assert timeline_us(events, 2) == {"span": 19.0, "busy": 14.0, "idle": 5.0}
    assert kernel_totals_us(events, 2) == {"kernel": 10.0, "merge": 4.0, "copy": 1.5}
    assert timeline_us([], 3) == {"span": 0.0, "busy": 0.0, "idle": 0.0}


def test_merge_tuning_cases_parse_and_exit_without_a_gpu(tmp_path):
    script = _script("tune_combine_splits")
    assert script.parse_case("1x66x128") == (1, 66, 128, False)
    assert script.parse_case("64x8x128I") == (64, 8, 128, True)
    for bad in ("1x66", "64x2x32T"):
        with pytest.raises(argparse.ArgumentTypeError, match="B x splits x rows"):
            script.parse_case(bad)
    assert script.main(["--out", str(tmp_path)]) == 2


def test_merge_tuning_names_a_bad_case(capsys):
    script = _script("tune_combine_splits")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--out", "/nonexistent", "--cases", "1x66"])
    assert exit_info.value.code == 2 and "--cases" in capsys.readouterr().err


def test_kernel_durations_follow_the_call_order():
    from snapmla_jax.bench.timing import GpuEvent, kernel_us_by_call
    order = ["a", "b", "b", "a"]
    events = [GpuEvent("s", "prep", 0, 1000)]
    for k, us in enumerate([10.0, 20.0, 21.0, 11.0]):
        start = 5000 * (k + 1)
        events.append(GpuEvent("stream", "snapmla_decode_fp8_mgpu_mosaic_gpu_kernel", start, int(us * 1000)))
        events.append(GpuEvent("other", "snapmla_combine_items", start + 3000, 500))
    events.append(GpuEvent("aggregate", "snapmla_decode_fp8_mgpu_mosaic_gpu_kernel", 10000, 20000))  # a repeat
    assert kernel_us_by_call(events, order, "decode_fp8_mgpu") == {"a": [10.0, 11.0], "b": [20.0, 21.0]}
    with pytest.raises(ValueError, match="one launch of 'decode_bf16' a call"):
        kernel_us_by_call(events, order, "decode_bf16")


def test_interleaved_kernel_times_say_when_no_gpu_ran():
    import jax
    import jax.numpy as jnp

    from snapmla_jax.bench import timing

    fn = jax.jit(lambda x: x + 1)
    with pytest.raises(ValueError, match="is there a GPU"):
        timing.interleaved_kernel_us({"one": (fn, (jnp.ones(3),)), "two": (fn, (jnp.ones(3),))},
                                     kernel="snapmla", rounds=2)


def test_sweep_splits_parses_its_cases_and_exits_2_without_a_gpu(tmp_path, capsys):
    script = _script("sweep_splits")
    assert script.parse_case("1x4096x16x1:8,16") == ((1, 4096, 16, 1), [8, 16])
    assert script.parse_case("67x16384x128x1:split,wave,4") == ((67, 16384, 128, 1), ["split", "wave", 4])
    # A plan named where the call's plan is uniform (<= UNIFORM_PLAN_MAX_TOKENS of capacity): one line, 2.
    assert script.main(["--out", str(tmp_path), "--cases", "1x4096x16x1:wave"]) == 2
    assert "--cases: 1x4096x16x1 takes a uniform plan" in capsys.readouterr().err
    for bad in ("1x4096x16x1", "1x4096x16:8", "1x4096x16x1:0,8", "1x4k x16x1:8", "1x4096x16x1:waves"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxCONTEXTxHxS_Q:SPLITS"):
            script.parse_case(bad)
    with pytest.raises(SystemExit) as exit_info:  # argparse: one line naming --cases, status 2
        script.main(["--out", str(tmp_path), "--cases", "1x4096x16x1"])
    assert exit_info.value.code == 2 and "--cases" in capsys.readouterr().err
    assert script.main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "split_sweep.json").exists()
