"""The test suite's own options (tests/conftest.py)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _collected(*options):
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *options, "tests/test_split_plan.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    return [line for line in listed.splitlines() if "::" in line]


def test_one_case_each_keeps_the_first_case_of_every_test_function():
    everything, one_each = _collected(), _collected("--one-case-each")
    functions = list(dict.fromkeys(item.split("[")[0] for item in everything))
    firsts = [next(item for item in everything if item.split("[")[0] == f) for f in functions]
    assert len(everything) > len(functions)  # the file has parametrized tests to thin out
    assert one_each == firsts
