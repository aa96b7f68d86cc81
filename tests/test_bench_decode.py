"""The decode benchmark's table (the timings need a GPU; its markdown does not)."""

import pytest

from snapmla_jax.bench import decode

ENV = {"device": "test device", "jax": "0", "python": "3", "date": "2026-11-23"}
CEILINGS = {"copy_gbps": 1000.0, "bf16_tflops": 500.0, "fp8_tflops": 900.0}


def _row(batch, measured=None):
    row = {"batch": batch, "context": 1024, "heads": 128, "s_q": 1, "fp8_ms": 0.5, "bf16_ms": 0.75,
           "xla_bf16_ms": 2.0, "fp8_over_bf16": 1.5, "fp8_over_xla": 4.0}
    if measured:
        row["measured_utc"] = measured
    return row


def test_decode_table_says_when_each_row_was_measured():
    rows = [_row(8, "2026-11-23 16:49"), _row(32, "2026-11-23 17:30"), _row(64)]
    lines = decode.to_markdown(ENV, CEILINGS, rows, "no", merged=True).splitlines()
    header = next(line for line in lines if line.startswith("| B |"))
    assert header.rstrip(" |").endswith("measured (UTC)")
    body = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and line[2].isdigit()}
    assert body["8"].rstrip(" |").endswith("2026-11-23 16:49")
    assert body["32"].rstrip(" |").endswith("2026-11-23 17:30")
    assert body["64"].rstrip(" |").endswith("-")  # rows from before the column existed
    assert "1.50x" in body["8"]
    assert any("kernels of their time" in line for line in lines)


def test_decode_table_without_merged_rows_has_no_merge_note():
    text = decode.to_markdown(ENV, CEILINGS, [_row(8, "2026-11-23 16:49")], "no")
    assert "earlier invocations" not in text


def test_benchmarks_exit_2_with_one_line_without_a_gpu(capsys):
    """On a CPU the GPU benchmarks print one line naming themselves and exit with status 2."""
    from snapmla_jax.bench import timing
    if not timing.missing_gpu("probe"):
        pytest.skip("a GPU is present")
    assert decode.main(["--quick"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["probe: needs a CUDA GPU", "decode benchmark: needs a CUDA GPU"]
