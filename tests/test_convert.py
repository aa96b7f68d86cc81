"""The convert CLI's handling of its paths, on a tiny Hugging Face checkpoint written without
torch (tests/hf_tiny.py): it never writes into or around --hf-dir, --overwrite replaces only
our own checkpoints and only once the new one is complete, and bad input is one line, exit 2."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from cli_checks import tree_snapshot
from hf_tiny import write_tiny_hf_checkpoint
from snapmla_jax.convert import main
from snapmla_jax.models import load_checkpoint
from snapmla_jax.models import checkpoint as ckpt

IDS = jnp.asarray([[1, 5, 9, 2, 7]])


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    return path, write_tiny_hf_checkpoint(path)


@pytest.fixture
def work(tmp_path, monkeypatch, hf_model):
    """A working directory holding a copy of the HF checkpoint (hf/) and a converted one (ours/)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_model[0], tmp_path / "hf")
    assert main(["--hf-dir", "hf", "--out", "ours", "--quiet", "--dtype", "float32"]) == 0
    return tmp_path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_converted_checkpoint_computes_what_the_hf_weights_do(work, hf_model):
    got = np.asarray(load_checkpoint(work / "ours")(IDS))
    np.testing.assert_allclose(got, np.asarray(hf_model[1](IDS)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("argv, needle", [
    (["--hf-dir", "hf", "--out", "hf", "--overwrite"], "--out: hf is the --hf-dir directory"),
    (["--hf-dir", "hf", "--out", "hf/sub"], "--out: hf/sub is inside the --hf-dir directory"),
    (["--hf-dir", "hf", "--out", ".", "--overwrite"], "contains the --hf-dir directory"),
    (["--hf-dir", "hf", "--out", "hf/config.json"], "is inside the --hf-dir"),
    (["--hf-dir", "hf", "--out", "file.txt"], "--out: file.txt is a file"),
    (["--hf-dir", "hf", "--out", "file.txt/x"], "--out: file.txt/x cannot be created: "),
    (["--hf-dir", "hf", "--out", "other", "--overwrite"], "--out: other is a non-empty directory and not a "
                                                          "snapmla-jax checkpoint"),
    (["--hf-dir", "hf", "--out", "ours"], "--out: ours holds a snapmla-jax checkpoint (pass --overwrite"),
    (["--hf-dir", "ours", "--out", "new"], "--hf-dir: ours is already a snapmla-jax checkpoint"),
    (["--hf-dir", "other", "--out", "new"], "--hf-dir: other has no config.json"),
    (["--hf-dir", "nowhere", "--out", "new"], "--hf-dir: nowhere is not a directory"),
    (["--hf-dir", "broken", "--out", "new"], "--hf-dir: broken"),
    (["--hf-dir", "hf", "--out", "new", "--dtype", "int8"], "--dtype: expected one of"),
    (["--out", "new"], "--hf-dir"),
    (["--hf-dir", "hf", "--out", "new", "--bogus"], "--bogus"),
])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(work, capsys, argv, needle):
    (work / "file.txt").write_text("not a directory")
    (work / "other").mkdir()
    (work / "other" / "notes.txt").write_text("someone's files")
    (work / "broken").mkdir()
    (work / "broken" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    before = tree_snapshot(work)
    code, out, err = _run(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("snapmla_jax.convert: error: ") and "Traceback" not in err
    assert needle in err, err
    assert tree_snapshot(work) == before


def test_converting_a_directory_onto_itself_keeps_its_hugging_face_config(work, capsys):
    config = (work / "hf" / "config.json").read_bytes()
    assert _run(capsys, "--hf-dir", "hf", "--out", "hf", "--overwrite")[0] == 2
    assert (work / "hf" / "config.json").read_bytes() == config


def test_overwrite_replaces_our_checkpoint_with_the_new_conversion(work, capsys, hf_model):
    code, _, err = _run(capsys, "--hf-dir", "hf", "--out", "ours", "--overwrite", "--quiet", "--dtype", "bfloat16")
    assert code == 0, err
    assert load_checkpoint(work / "ours").embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert sorted(p.name for p in work.iterdir()) == ["hf", "ours"]  # no staging directory left


def test_an_interrupted_overwrite_leaves_the_old_checkpoint_intact(work, capsys, monkeypatch):
    before = tree_snapshot(work / "ours")

    def dies_half_way(model, directory):
        (directory / "state").mkdir()
        raise KeyboardInterrupt  # what a user's Ctrl-C raises in the middle of the write

    monkeypatch.setattr(ckpt, "write_checkpoint", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        main(["--hf-dir", "hf", "--out", "ours", "--overwrite", "--quiet"])
    assert tree_snapshot(work / "ours") == before
    assert sorted(p.name for p in work.iterdir()) == ["hf", "ours"]
    load_checkpoint(work / "ours")


def test_help_exits_0_and_describes_the_out_rules(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "--overwrite" in out and "--hf-dir" in out
