"""scripts/profile_decode_launches.py: its case parsing, and a clean exit without a GPU."""

import argparse
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("profile_decode_launches", ROOT / "scripts/profile_decode_launches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
