"""The byte-level stdlib corpus: deterministic split, encoding, windows, tokenizer file."""

import json
import subprocess
import sys

import numpy as np
import pytest

from snapmla_jax import byte_corpus as bc
from snapmla_jax.tokenizer import load_tokenizer


def _make_tree(root, files):
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def test_split_is_disjoint_complete_and_stable_across_processes():
    split = bc.split_files()
    assert not set(split.train_files) & set(split.heldout_files)
    assert sorted(split.train_files + split.heldout_files) == bc.list_source_files()
    # A fresh interpreter has a different str-hash salt; the split must not depend on it.
    code = "from snapmla_jax import byte_corpus as bc; print('\\n'.join(bc.split_files().heldout_files))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert tuple(other) == split.heldout_files


def test_heldout_fraction_is_close_to_requested():
    files = bc.list_source_files()
    held = sum(bc.is_heldout(f, 0.05) for f in files)
    # Binomial(n, 0.05): 5 standard deviations either side.
    sd = (len(files) * 0.05 * 0.95) ** 0.5
    assert abs(held - 0.05 * len(files)) < 5 * sd


def test_heldout_set_grows_monotonically_with_fraction():
    files = bc.list_source_files()
    small = {f for f in files if bc.is_heldout(f, 0.05)}
    large = {f for f in files if bc.is_heldout(f, 0.2)}
    assert small < large


def test_listing_skips_site_packages_caches_empty_and_large_files(tmp_path):
    _make_tree(tmp_path, {"a.py": b"x = 1\n", "pkg/b.py": b"y = 2\n", "site-packages/c.py": b"z\n",
                          "__pycache__/d.py": b"w\n", "empty.py": b"", "big.py": b"#" * 100, "notes.txt": b"t"})
    assert bc.list_source_files(tmp_path, max_file_bytes=50) == ["a.py", "pkg/b.py"]


def test_listing_rejects_missing_root(tmp_path):
    with pytest.raises(ValueError, match="root"):
        bc.list_source_files(tmp_path / "nope")


def test_token_stream_wraps_each_file_in_bos_eos_and_keeps_bytes(tmp_path):
    _make_tree(tmp_path, {"a.py": "é = 1\n".encode(), "b.py": b"\x00\xff"})
    stream = bc.token_stream(tmp_path, ["a.py", "b.py"])
    expected = [bc.BOS_ID, *"é = 1\n".encode(), bc.EOS_ID, bc.BOS_ID, 0, 255, bc.EOS_ID]
    assert stream.dtype == np.int32 and stream.tolist() == expected


def test_token_stream_names_a_missing_file(tmp_path):
    _make_tree(tmp_path, {"a.py": b"x\n"})
    with pytest.raises(ValueError, match="gone.py"):
        bc.token_stream(tmp_path, ["a.py", "gone.py"])
    assert bc.present_files(tmp_path, ["a.py", "gone.py"]) == (["a.py"], ["gone.py"])


def test_encode_decode_round_trip_drops_specials():
    text = "def f(x):\n    return 'ünïcode' + \"\\t\"\n"
    ids = bc.encode(text)
    assert ids[0] == bc.BOS_ID and (ids[1:] < bc.NUM_BYTES).all()
    assert bc.decode([*ids, bc.EOS_ID, bc.PAD_ID]) == text


def test_sample_windows_are_contiguous_slices():
    stream = np.arange(1000, dtype=np.int32)
    windows = bc.sample_windows(stream, 16, 33, np.random.default_rng(0))
    assert windows.shape == (16, 33)
    np.testing.assert_array_equal(np.diff(windows, axis=1), 1)  # consecutive tokens of the stream
    with pytest.raises(ValueError, match="stream"):
        bc.sample_windows(stream[:10], 1, 33, np.random.default_rng(0))


def test_tokenizer_config_loads_as_the_byte_vocabulary(tmp_path):
    bc.write_tokenizer_config(tmp_path / "tokenizer_config.json")
    tok = load_tokenizer(tmp_path)
    text = "def π(x):\n\t return x  # 😀\r\n"
    assert tok.encode(text) == bc.encode(text).tolist()
    assert tok.decode([*bc.encode(text), bc.EOS_ID]) == text
    assert tok.eos_id == bc.EOS_ID


def test_file_list_round_trip(tmp_path):
    bc.write_file_list(tmp_path / "held.json", ["a.py", "x/b.py"], heldout_fraction=0.05)
    files, version = bc.read_file_list(tmp_path / "held.json")
    assert files == ["a.py", "x/b.py"] and version == sys.version.split()[0]
    (tmp_path / "bad.json").write_text(json.dumps({"nope": 1}))
    with pytest.raises(ValueError, match="path"):
        bc.read_file_list(tmp_path / "bad.json")
