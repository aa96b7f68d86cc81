"""scripts/probe_call_parts.py on the CPU: without a GPU it exits 2, names itself, writes nothing."""

from script_loader import load_script

probe_call_parts = load_script("probe_call_parts")


def test_without_a_gpu_it_exits_2(tmp_path, capsys):
    assert probe_call_parts.main(["--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == "probe_call_parts: needs a CUDA GPU"
    assert not (tmp_path / "out").exists()
