"""The write benchmark's plumbing, run on the CPU with tiny sizes (timings there mean nothing)."""

import json

import pytest

from snapmla_jax import cli
from snapmla_jax.bench import write


def test_write_bench_writes_its_tables(tmp_path):
    assert write.main(["--tokens", "128", "--iters", "1", "--repeat", "2", "--backends", "xla",
                       "--copy-mib", "8",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "write.json").read_text())["rows"]
    assert {(r["cache"], r["backend"], r["config"]) for r in rows} == {("fp8", "xla", ""), ("bf16", "xla", "")}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    assert "loops the write 2 times" in (tmp_path / "write.md").read_text()


def test_write_bench_times_the_mosaic_kernel_per_block_size_beside_xla(tmp_path):
    # Token counts short of a page and of a block; the interpreter stands in for the GPU.
    assert write.main(["--tokens", "1", "40", "--iters", "1", "--repeat", "1", "--backends", "interpret", "xla",
                       "--block-tokens", "32", "64", "--copy-mib", "8", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "write.json").read_text())["rows"]
    assert {(r["tokens"], r["backend"], r["config"]) for r in rows if r["cache"] == "fp8"} == {
        (t, b, c) for t in (1, 40)
        for b, c in (("interpret", "block_tokens=32"), ("interpret", "block_tokens=64"), ("xla", ""))}
    page = (tmp_path / "write.md").read_text()
    assert "`python -m snapmla_jax.bench write --tokens 1 40 " in page


@pytest.mark.parametrize("flags, message", [
    (["--backends", "pallas"], "pallas: compiled for a CUDA GPU"),
    (["--block-tokens", "48"], "--block-tokens: block_tokens: expected a positive multiple of 32"),
    (["--tokens", "0"], "--tokens: expected positive ints"),
])
def test_write_bench_refuses_bad_flags(tmp_path, flags, message):
    with pytest.raises(cli.UsageError, match=message):
        write.main([*flags, "--out", str(tmp_path)])
