"""``python -m snapmla_jax.bench decode|ragged|write|e2e [options]`` (each accepts --help)."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "decode": "snapmla_jax.bench.decode",
    "ragged": "snapmla_jax.bench.ragged",
    "write": "snapmla_jax.bench.write",
    "e2e": "snapmla_jax.bench.e2e",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m snapmla_jax.bench {{{'|'.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
