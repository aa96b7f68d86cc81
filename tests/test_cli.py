"""snapmla_jax.cli, what every command line shares: one stderr line and exit code 2 for bad
input and out-of-memory, exit code 0 for --help, flags named as typed, and a help text for
every flag of every command."""

import argparse
import os
import subprocess
import sys

import jax
import pytest

from snapmla_jax import cli, convert, fidelity, train_demo
from snapmla_jax.bench import __main__ as bench

generate = __import__("snapmla_jax.generate", fromlist=["main"])


def _body_raising(err):
    def body(argv):
        raise err
    return body


def test_usage_error_is_one_line_and_exit_2(capsys):
    assert cli.run("prog", _body_raising(cli.UsageError("--flag: expected\n  an int, got 'x'")), []) == 2
    assert capsys.readouterr().err == "prog: error: --flag: expected an int, got 'x'\n"


def test_help_exits_0(capsys):
    parser = cli.Parser(prog="prog")
    parser.add_argument("--n", type=int, help="a count")
    assert cli.run("prog", parser.parse_args, ["--help"]) == 0
    assert "a count" in capsys.readouterr().out


def test_device_out_of_memory_is_one_line_with_the_hint(capsys):
    err = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4.00GiB\nmore detail")
    assert cli.run("prog", _body_raising(err), [], out_of_memory_hint="use fewer prompts") == 2
    assert capsys.readouterr().err == ("prog: error: out of device memory (RESOURCE_EXHAUSTED: Out of memory "
                                       "allocating 4.00GiB); use fewer prompts\n")


def test_other_exceptions_keep_their_traceback():
    with pytest.raises(ZeroDivisionError):
        cli.run("prog", _body_raising(ZeroDivisionError("a bug")), [])


@pytest.mark.parametrize("argv, message", [
    (["--n", "x"], "--n: expected an int, got 'x'"),
    (["--f", "y"], "--f: expected a number, got 'y'"),
    (["--c", "z"], "--c: expected one of 'a', 'b', got 'z'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_parser_errors_start_with_the_flag(argv, message):
    parser = cli.Parser(prog="prog")
    parser.add_argument("--n", type=int)
    parser.add_argument("--f", type=float)
    parser.add_argument("--c", choices=["a", "b"])
    with pytest.raises(cli.UsageError) as caught:
        parser.parse_args(argv)
    assert str(caught.value) == message


def test_library_errors_are_renamed_to_the_flags():
    flags = {"top_p": "--top-p"}
    assert str(cli.flag_error(ValueError("top_p: expected a float"), flags)) == "--top-p: expected a float"
    assert str(cli.flag_error(ValueError("tensor x: bad"), flags, default="--model: m")) == "--model: m: tensor x: bad"


def test_default_bench_dir_is_outside_the_source_tree(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.default_bench_dir() == tmp_path / ".cache" / "snapmla-jax" / "bench"
    assert cli.PUBLISHED_BENCH_DIR not in cli.default_bench_dir().parents


def _parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, caught as it parses ``--help``."""
    seen = {}

    def capture(self, args=None, namespace=None):
        seen[self.prog] = self
        raise SystemExit(0)

    monkeypatch.setattr(cli.Parser, "parse_args", capture)
    for main, argv in [(generate.main, []), (convert.main, []), (fidelity.main, []), (train_demo.main, []),
                       *((bench.main, [suite]) for suite in bench.SUITES)]:
        assert main(argv) == 0
    return seen


def test_every_flag_of_every_command_has_a_description(monkeypatch):
    parsers = _parsers(monkeypatch)
    assert len(parsers) == 4 + len(bench.SUITES)
    missing = [f"{prog} {action.option_strings[-1]}" for prog, parser in parsers.items() for action in parser._actions
               if action.option_strings and not (action.help or "").strip()]
    assert not missing, missing


@pytest.mark.parametrize("module, bad_argv", [
    ("snapmla_jax.generate", ["--bogus"]), ("snapmla_jax.convert", ["--hf-dir", "h", "--out", "o", "--bogus"]),
    ("snapmla_jax.fidelity", ["--bogus"]), ("snapmla_jax.train_demo", ["--out", "o", "--bogus"]),
    ("snapmla_jax.bench", ["bogus"]),
])
def test_each_program_exits_2_on_a_bad_flag_and_0_on_help(module, bad_argv, tmp_path):
    # The process's exit code, as a shell sees it.
    run = lambda *argv: subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                                       timeout=300, cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    bad = run(*bad_argv)
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr and "bogus" in bad.stderr
    ok = run("--help")
    assert ok.returncode == 0 and "usage: python -m " + module.removesuffix(".__main__") in ok.stdout
    assert list(tmp_path.iterdir()) == []
