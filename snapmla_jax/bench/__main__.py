"""``python -m snapmla_jax.bench SUITE [options]`` (``snapmla-bench``): the benchmarks.

Each suite writes SUITE.json and SUITE.md: to ``--out DIR`` when given, with ``--publish``
to the repository's docs/benchmarks/ (the published tables), and otherwise to a directory
outside the source tree that it prints (``snapmla_jax.cli.default_bench_dir``).
``python -m snapmla_jax.bench SUITE --help`` describes a suite's flags.
"""

from __future__ import annotations

import importlib
import sys

from snapmla_jax import cli

PROG = "snapmla_jax.bench"
SUITES = {
    "decode": ("snapmla_jax.bench.decode",
               "MLA decode: the FP8 kernel against FlashMLA (when installed), its BF16 twin, the XLA path and "
               "JAX's stock kernel (CUDA GPU)"),
    "ragged": ("snapmla_jax.bench.ragged",
               "decode over rows of different lengths: the balanced split plan against uniform splits (CUDA GPU)"),
    "write": ("snapmla_jax.bench.write",
              "the fused quantize + paged cache write against XLA's scatter (CUDA GPU; elsewhere "
              "--backends interpret xla)"),
    "e2e": ("snapmla_jax.bench.e2e",
            "end-to-end decode throughput of a DeepSeek-V2-Lite-shaped model, FP8 against BF16 cache "
            "(CUDA GPU; --tiny anywhere)"),
    "capacity": ("snapmla_jax.bench.capacity",
                 "decode throughput at the largest batch each cache format fits, on one device or data-parallel "
                 "over several (CUDA GPUs; --tiny anywhere)"),
}


def usage() -> str:
    """The --help text: the suites and where they write."""
    width = max(map(len, SUITES))
    lines = [f"usage: python -m snapmla_jax.bench {{{','.join(SUITES)}}} [options]", "", __doc__.split("\n\n")[1], "",
             "suites:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in SUITES.items()]
    lines += ["", "options:", "  -h, --help  show this help message and exit"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one suite; returns the exit code (0 ok, 2 bad input, no GPU where one is needed,
    or out of memory)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv:
        return cli.fail(PROG, f"expected a suite, one of {', '.join(SUITES)} (--help describes them)")
    if argv[0] not in SUITES:
        return cli.fail(PROG, f"{argv[0]}: expected a suite, one of {', '.join(SUITES)} (--help describes them)")
    suite = importlib.import_module(SUITES[argv[0]][0])
    return cli.run(f"{PROG} {argv[0]}", suite.main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
