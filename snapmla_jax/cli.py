"""What the package's command lines share: one-line errors with exit code 2, ``--help``
with exit code 0, and where the benchmarks write their tables.

A command's ``main(argv)`` returns ``run(PROG, body, argv)``. ``body(argv)`` parses with
``Parser`` and raises ``UsageError("--flag: what was wrong and what was expected")`` for
bad input, before doing any work or writing any file. ``run`` prints such an error as one
line on stderr, ``PROG: error: MESSAGE``, and returns 2; it does the same for a device
that runs out of memory (XLA's RESOURCE_EXHAUSTED). Other exceptions are bugs and keep
their traceback.

Benchmarks write their tables to ``--out`` when given, with ``--publish`` to the
repository's ``docs/benchmarks/`` (the published tables), and otherwise to
``default_bench_dir()``, outside the source tree: a benchmark run never overwrites the
published tables unless asked to.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from typing import Callable, Mapping, Sequence

EXIT_USAGE = 2
# The repository's published benchmark tables (present in a source checkout, which an
# editable install runs from; a wheel install has none).
PUBLISHED_BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


class UsageError(Exception):
    """Bad input, or a need of the command the machine does not meet: printed as one line,
    exit code 2. The message starts with the flag as the user typed it (``--out: ...``)."""


_TYPE_NAMES = {"int": "an int", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line raises UsageError (one line, exit code 2,
    starting with the flag) instead of printing the usage and exiting. ``--help`` still
    prints and exits 0."""

    def error(self, message):
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        bad_type = re.fullmatch(r"(\S+): invalid (\w+) value: (.*)", message)
        if bad_type:
            flag, kind, value = bad_type.groups()
            message = f"{flag}: expected {_TYPE_NAMES.get(kind, kind)}, got {value}"
        bad_choice = re.fullmatch(r"(\S+): invalid choice: (.*) \(choose from (.*)\)", message)
        if bad_choice:
            flag, value, choices = bad_choice.groups()
            message = f"{flag}: expected one of {choices}, got {value}"
        raise UsageError(message)


def one_line(text) -> str:
    """``text`` with every run of whitespace (newlines included) turned into one space."""
    return " ".join(str(text).split())


def fail(prog: str, message) -> int:
    """Print ``PROG: error: MESSAGE`` on one line of stderr; returns the exit code 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is XLA failing to allocate device memory (RESOURCE_EXHAUSTED)."""
    return type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "RESOURCE_EXHAUSTED" in str(err)


def run(prog: str, body: Callable[[list[str]], int | None], argv: Sequence[str] | None = None, *,
        out_of_memory_hint: str = "") -> int:
    """``body(argv)`` (argv: ``sys.argv[1:]`` when None) -> its exit code (None counts as 0).

    UsageError -> one line on stderr, 2. ``--help`` (argparse's SystemExit 0) -> 0. A device
    out of memory -> one line (XLA's first line, then ``out_of_memory_hint``), 2.
    """
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        return body(argv) or 0
    except UsageError as err:
        return fail(prog, err)
    except SystemExit as exit_:
        if exit_.code in (0, None):  # --help
            return 0
        raise
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        first = one_line(str(err).strip().splitlines()[0])[:300]
        return fail(prog, f"out of device memory ({first})" + (f"; {out_of_memory_hint}" if out_of_memory_hint else ""))


def flag_error(err: Exception, flags: Mapping[str, str], default: str | None = None) -> UsageError:
    """A library ValueError ("name: ...", naming a Python argument) as a UsageError naming the
    flag ``flags[name]`` instead; a message naming no known argument is prefixed with
    ``default`` (when given) or kept as it is."""
    message = one_line(err)
    name, sep, rest = message.partition(": ")
    if sep and name in flags:
        return UsageError(f"{flags[name]}: {rest}")
    return UsageError(f"{default}: {message}" if default else message)


def add_fp8_min_elements(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--fp8-min-elements N`` beside ``--fp8-weights`` (``quantize_weights(min_elements=N)``),
    ``note`` ending its help; check it with ``check_fp8_min_elements``."""
    parser.add_argument("--fp8-min-elements", type=int, default=0, metavar="N",
                        help="with --fp8-weights: weights of fewer than N elements (a routed-expert stack counted "
                             "whole) in the parameter dtype instead; 16777216 (DECODE_MIN_FP8_ELEMENTS): those "
                             "whose FP8 products are slower than bf16 in a decode step on an H100 (default 0: "
                             f"none){note}")


def check_fp8_min_elements(args) -> None:
    """``--fp8-min-elements``: an int >= 0, and only beside ``--fp8-weights``."""
    if args.fp8_min_elements < 0:
        raise UsageError(f"--fp8-min-elements: expected an int >= 0, got {args.fp8_min_elements}")
    if args.fp8_min_elements and not args.fp8_weights:
        raise UsageError("--fp8-min-elements: chooses among the weights --fp8-weights makes FP8; add --fp8-weights")


def backend(value: str, flag: str = "--backend") -> str:
    """``snapmla_jax.backend.resolve_backend(value)``, its errors naming ``flag`` (e.g. "pallas"
    on a machine without a CUDA GPU, or "interpret" where the decode kernels' interpreter lacks
    CPU devices: ``decode.check_interpreter_devices``)."""
    from snapmla_jax.backend import resolve_backend
    from snapmla_jax.decode import check_interpreter_devices

    try:
        resolved = resolve_backend(value)
        if resolved == "interpret":
            check_interpreter_devices()
        return resolved
    except ValueError as err:
        raise flag_error(err, {"backend": flag}) from err


def check_positive(args: argparse.Namespace, *dests: str) -> None:
    """UsageError naming the first of the int flags ``dests`` (argparse dests) that is below 1."""
    for dest in dests:
        if getattr(args, dest) < 1:
            raise UsageError(f"--{dest.replace('_', '-')}: expected an int >= 1, got {getattr(args, dest)}")


def check_output_file(flag: str, path: str | os.PathLike | None) -> None:
    """UsageError unless ``path`` (None: no output asked for) can be written as a new or
    replaced file: it is not a directory and its parent directory exists."""
    if path is None:
        return
    path = pathlib.Path(path)
    if path.is_dir():
        raise UsageError(f"{flag}: {path} is a directory; expected a file path")
    parent = path.parent if str(path.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag}: the directory {parent} does not exist")


def check_output_dir(flag: str, path: pathlib.Path) -> None:
    """UsageError unless ``path`` is a directory or can be created as one (no file in the way)."""
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise UsageError(f"{flag}: {ancestor} is a file; expected a directory")
            return


# ---------------------------------------------------------------- benchmark output


def default_bench_dir() -> pathlib.Path:
    """Where a benchmark writes when neither --out nor --publish is given:
    ``$XDG_CACHE_HOME/snapmla-jax/bench`` (``~/.cache/snapmla-jax/bench`` without it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "snapmla-jax" / "bench"


def add_bench_output_flags(parser: argparse.ArgumentParser, files: str) -> None:
    """--out and --publish for a benchmark writing ``files`` (e.g. "write.json / write.md")."""
    parser.add_argument("--out", default=None,
                        help=f"directory for {files} (default: {default_bench_dir()}, outside the source tree; "
                             "created if missing)")
    parser.add_argument("--publish", action="store_true",
                        help=f"write {files} into the repository's docs/benchmarks/, replacing the published "
                             "tables: only for a run on the hardware those pages report")


def bench_output_dir(args: argparse.Namespace) -> pathlib.Path:
    """The directory a benchmark writes to, from ``args.out`` / ``args.publish``
    (``add_bench_output_flags``), which it names on stdout; UsageError for both at once, a
    file in the way, or --publish outside a source checkout. Nothing is created here."""
    if args.publish and args.out is not None:
        raise UsageError("--publish: writes to the repository's docs/benchmarks/; not together with --out")
    if args.publish:
        if not PUBLISHED_BENCH_DIR.is_dir():
            raise UsageError(f"--publish: no published tables at {PUBLISHED_BENCH_DIR} (it needs a source "
                             "checkout of snapmla-jax); use --out DIR")
        print(f"results go to {PUBLISHED_BENCH_DIR} (--publish)", flush=True)
        return PUBLISHED_BENCH_DIR
    path = default_bench_dir() if args.out is None else pathlib.Path(args.out)
    check_output_dir("--out", path)
    print(f"results go to {path}", flush=True)
    return path
