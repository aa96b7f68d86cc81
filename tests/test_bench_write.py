"""The write benchmark's plumbing, run on the CPU with tiny sizes (timings there mean nothing)."""

import json

from snapmla_jax.bench import write


def test_write_bench_writes_its_tables(tmp_path):
    assert write.main(["--tokens", "128", "--iters", "1", "--repeat", "2", "--backends", "xla",
                       "--copy-mib", "8",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "write.json").read_text())["rows"]
    assert {(r["cache"], r["backend"]) for r in rows} == {("fp8", "xla"), ("bf16", "xla")}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    assert "loops the write 2 times" in (tmp_path / "write.md").read_text()
