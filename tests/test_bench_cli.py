"""``python -m snapmla_jax.bench``'s command line on a machine without a GPU: --help, bad input
(one line, exit 2, nothing written), and where results go (never the published tables unless
--publish)."""

import json
import shutil

import pytest

from cli_checks import assert_usage_error, tree_snapshot
from snapmla_jax import cli, fp8_weights
from snapmla_jax.bench.__main__ import SUITES, main


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory holding a copy of the published e2e tables, as a source checkout
    does, and a cache directory for the default output."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    for name in ("e2e.json", "e2e.md"):
        shutil.copy(cli.PUBLISHED_BENCH_DIR / name, tmp_path / "docs" / "benchmarks" / name)
    (tmp_path / "file.txt").write_text("a file")
    return tmp_path


def test_help_exits_0_and_lists_every_suite(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUITES) and "--publish" in out


@pytest.mark.parametrize("suite", list(SUITES))
def test_each_suites_help_exits_0_and_documents_out_and_publish(capsys, suite):
    assert main([suite, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--out" in out and "--publish" in out and "docs/benchmarks/" in out


@pytest.mark.parametrize("argv, needle", [
    ([], "snapmla_jax.bench: error: expected a suite, one of decode, ragged, write, e2e"),
    (["bogus"], "snapmla_jax.bench: error: bogus: expected a suite"),
    (["write"], "snapmla_jax.bench write: error: --backends: pallas: compiled for a CUDA GPU, and none is present"),
    (["write", "--backends", "cuda"], "--backends: expected one of"),
    (["write", "--backends", "xla", "--tokens", "0"], "--tokens: expected positive ints, got [0]"),
    (["write", "--backends", "xla", "--iters", "0"], "--iters: expected an int >= 1, got 0"),
    (["write", "--backends", "xla", "--out", "file.txt"], "--out: file.txt is a file"),
    (["write", "--backends", "xla", "--out", "file.txt/sub"], "--out: file.txt is a file"),
    (["write", "--backends", "xla", "--out", "x", "--publish"], "--publish: "),
    (["decode"], "decode benchmark: needs a CUDA GPU"),
    (["decode", "--bogus"], "unrecognized arguments: --bogus"),
    (["decode", "--out", "file.txt"], "--out: file.txt is a file"),
    (["decode", "--shapes", "64x16384x128"], "--shapes: expected BxCTXxHxSQ of positive ints"),
    (["decode", "--methods", "cuda"], "--methods: expected one of"),
    (["decode", "--preset", "nope"], "--preset: expected one of"),
    (["decode", "--flashmla", "nope.so"], "--flashmla: expected 'auto', 'none' or a FlashMLA extension .so"),
    (["decode", "--name", "../decode"], "--name: expected a file name"),
    (["ragged"], "ragged decode benchmark: needs a CUDA GPU"),
    (["ragged", "--heads", "0"], "--heads: expected ints >= 1, got 0"),
    (["ragged", "--scenarios", "nope"], "--scenarios: expected one of"),
    (["e2e"], "the V2-Lite-sized model needs a CUDA GPU (use --tiny elsewhere)"),
    (["e2e", "--tiny", "--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (["e2e", "--tiny", "--batches", "0"], "--batches: expected ints >= 1"),
    (["e2e", "--tiny", "--backend", "pallas"], "--backend: \"pallas\" compiles for a CUDA GPU"),
    (["e2e", "--tiny", "--backend", "cuda"], "--backend: expected one of"),
    (["e2e", "--tiny", "--gather-moe", "-1"], "--gather-moe: expected an int >= 0"),
    (["e2e", "--tiny", "--kernel-quantization", "16"], "--kernel-quantization: expected an int >= 0, with --fp8-weights"),
    (["e2e", "--tiny", "--fp8-absorbed"], "--fp8-absorbed: makes w_uk / w_uv FP8 beside the FP8 weights"),
    (["e2e", "--tiny", "--weights", "bf16", "--fp8-weights"], "--weights: names every model of the run"),
    (["e2e", "--tiny", "--weights", "fp8", "fp8"], "--weights: expected distinct kinds, got fp8 fp8"),
    (["e2e", "--tiny", "--weights", "bf16", "--kernel-quantization", "1"], "--kernel-quantization: expected an int"),
    (["e2e", "--tiny", "--dense-moe", "5", "2"], "--dense-moe: "),
    (["e2e", "--tiny", "--budget-s", "0"], "--budget-s: expected a number of seconds > 0"),
    (["e2e", "--tiny", "--out", "file.txt"], "--out: file.txt is a file"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(work, capsys, argv, needle):
    before, published = tree_snapshot(work), tree_snapshot(cli.PUBLISHED_BENCH_DIR)
    code = main(argv)
    _, err = capsys.readouterr()
    assert_usage_error(code, err, needle)
    assert tree_snapshot(work) == before and tree_snapshot(cli.PUBLISHED_BENCH_DIR) == published


def test_e2e_tiny_writes_outside_the_source_tree_and_says_where(work, capsys):
    # The published tables in the working directory (a checkout) and in the package's own
    # repository stay as they are; the run's tables go to the cache directory it prints.
    before, published = tree_snapshot(work / "docs"), tree_snapshot(cli.PUBLISHED_BENCH_DIR)
    assert main(["e2e", "--tiny", "--batches", "2", "--contexts", "64", "--steps", "2", "--iters", "1"]) == 0
    assert tree_snapshot(work / "docs") == before and tree_snapshot(cli.PUBLISHED_BENCH_DIR) == published
    results = work / "cache" / "snapmla-jax" / "bench"
    assert cli.default_bench_dir() == results
    assert {r["status"] for r in json.loads((results / "e2e.json").read_text())["rows"]} == {"ok"}
    out = capsys.readouterr().out
    assert f"results go to {results}" in out and str(results / "e2e.md") in out


def test_e2e_tiny_times_weight_kinds_side_by_side(tmp_path):
    library_setting = fp8_weights.KERNEL_QUANTIZES_MAX_ROWS
    assert main(["e2e", "--tiny", "--weights", "bf16", "fp8", "--kv-caches", "fp8", "--kernel-quantization", "16",
                 "--batches", "2", "--contexts", "64", "--steps", "2", "--iters", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    env = saved["environment"]
    assert env["weights_compared"] == ["bf16", "fp8"] and env["kernel_quantization_rows"] == 16
    assert env["xla_product_rows"] == fp8_weights.XLA_MAX_ROWS == 1
    assert env["weights_gib_each"]["fp8"] < env["weights_gib_each"]["bf16"]
    assert sorted((r["weights"], r["kv_cache"], r["status"]) for r in saved["rows"]) == [
        ("bf16", "fp8", "ok"), ("fp8", "fp8", "ok")]
    assert all(r["ffn_ms"] > 0 and r["floor_ms"] > 0 for r in saved["rows"])
    table = (tmp_path / "e2e.md").read_text()
    assert env["activation_quantizer"] == "mosaic"
    assert "--weights bf16 fp8" in table and ("(activations quantized in the FP8 GEMM itself up to 16 rows, by one "
                                              "Mosaic GPU launch above" in table)
    assert "matrix products of up to 1 row by XLA, the weight dequantized in the product)" in table
    bf16, fp8 = sorted(saved["rows"], key=lambda r: r["weights"])
    ratio = f"{fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}"
    assert f"| 2 | 64 | FP8 | {bf16['step_ms']:.2f} | {fp8['step_ms']:.2f} | {ratio} |" in table
    assert fp8_weights.KERNEL_QUANTIZES_MAX_ROWS == library_setting  # back after the run


def test_e2e_xla_quantizes_traces_the_fp8_programs_with_xlas_quantizer(tmp_path, monkeypatch):
    from snapmla_jax.bench import e2e

    during = []  # MOSAIC_QUANTIZES while the run builds, traces and times its programs
    run = e2e.run
    monkeypatch.setattr(e2e, "run", lambda args: during.append(fp8_weights.MOSAIC_QUANTIZES) or run(args))
    assert main(["e2e", "--tiny", "--weights", "fp8", "--kv-caches", "fp8", "--xla-quantizes", "--batches", "2",
                 "--contexts", "64", "--steps", "2", "--iters", "1", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "e2e.json").read_text())["environment"]["activation_quantizer"] == "xla"
    assert "in the FP8 GEMM itself up to 1 row, by XLA above" in (tmp_path / "e2e.md").read_text()
    assert during == [False] and fp8_weights.MOSAIC_QUANTIZES  # back after the run


def test_e2e_xla_quantizes_needs_fp8_weights(capsys):
    assert main(["e2e", "--tiny", "--xla-quantizes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--xla-quantizes: with --fp8-weights" in err[0]


def test_publish_names_the_repositorys_tables():
    args = type("Args", (), {"out": None, "publish": True})()
    assert cli.bench_output_dir(args) == cli.PUBLISHED_BENCH_DIR
    assert (cli.PUBLISHED_BENCH_DIR / "e2e.md").is_file()


def test_a_table_names_its_command_without_where_it_went_and_with_the_memory_fraction(monkeypatch):
    from snapmla_jax.bench import timing

    argv = ["--out", "/tmp/x", "--weights", "bf16", "fp8-large", "--out=/tmp/y", "--publish", "--iters", 3]
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert timing.command_text("python -m snapmla_jax.bench e2e", argv) == (
        "python -m snapmla_jax.bench e2e --weights bf16 fp8-large --iters 3")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    assert timing.command_text("python scripts/bench_fp8_gemm.py", ["--chain-mib", "160", "--out", "d"]) == (
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 python scripts/bench_fp8_gemm.py --chain-mib 160")
