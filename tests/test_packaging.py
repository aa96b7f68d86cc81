"""What a new user meets before any code runs: the install script on a machine with any
Python >= 3.11, the package's version, license, console scripts, and import names that do not
clash with a project's own."""

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

import snapmla_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_installed_distributions():
    assert snapmla_jax.__version__ == importlib.metadata.version("snapmla-jax") == PYPROJECT["project"]["version"]


def test_license_file_holds_the_apache_2_0_text_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and "LICENSE" in PYPROJECT["project"]["license-files"]
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000  # the full text, not a pointer to it


@pytest.mark.parametrize("script, module", [("snapmla-generate", "snapmla_jax.generate"),
                                            ("snapmla-convert", "snapmla_jax.convert"),
                                            ("snapmla-bench", "snapmla_jax.bench.__main__")])
def test_console_scripts_run_the_modules_mains(script, module):
    [entry] = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == script]
    assert entry.load() is importlib.import_module(module).main


def test_import_works_from_a_project_with_its_own_models_package(tmp_path):
    for name in ("models", "pallas_kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("MINE = True\n")
    code = "import snapmla_jax, models; assert models.MINE; print(snapmla_jax.MLAConfig.__module__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "snapmla_jax.models.config"


# ---------------------------------------------------------------- scripts/install.sh

MINIMUM = PYPROJECT["project"]["requires-python"].removeprefix(">=")


def _fake_python(path: pathlib.Path, version: str) -> None:
    """An executable at ``path`` that answers the script's probes like Python ``version``."""
    major, minor = map(int, version.split(".")[:2])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n"
                    f"case \"$1\" in --version) echo 'Python {version}' ;; "
                    f"-c) exec {sys.executable} -c \"import sys; sys.version_info = ({major}, {minor}); $2\" ;; "
                    f"esac\n")
    path.chmod(0o755)


def _install(tmp_path: pathlib.Path, pythons: dict[str, str], *args: str,
             pyenv: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """scripts/install.sh and pyproject.toml copied into an empty tree (nothing of this checkout
    can change), run with a PATH that holds only ``pythons`` (name -> version), the tools the
    script calls, and with ``pyenv`` (version -> its Python's version) a fake pyenv."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "install.sh", repo / "scripts" / "install.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "awk", "sed", "sort", "sh"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    for name, version in pythons.items():
        _fake_python(bin_dir / name, version)
    if pyenv is not None:
        root = tmp_path / "pyenv"
        for name, version in pyenv.items():
            _fake_python(root / "versions" / name / "bin" / "python", version)
        (bin_dir / "pyenv").write_text(f"#!/bin/sh\ncase \"$1\" in root) echo {root} ;; "
                                       f"versions) printf '%s\\n' {' '.join(pyenv)} ;; esac\n")
        (bin_dir / "pyenv").chmod(0o755)
    return subprocess.run([shutil.which("bash"), str(repo / "scripts" / "install.sh"), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(bin_dir), "HOME": str(tmp_path)})


def test_install_requires_the_python_pyproject_and_the_jax_range_require():
    assert MINIMUM == "3.12"  # jax's and jaxlib's 0.11 and 0.12 wheels start at 3.12
    dependencies = PYPROJECT["project"]["dependencies"]
    # A range, jaxlib's the same as jax's: the kernels import jaxlib.mlir themselves.
    assert "jax>=0.11.2,<0.13" in dependencies and "jaxlib>=0.11.2,<0.13" in dependencies
    # The GPU extra is jax's own, within the same range: it holds the plugin to jax's version.
    assert PYPROJECT["project"]["optional-dependencies"]["cuda13"] == ["jax[cuda13]>=0.11.2,<0.13"]


def test_install_takes_the_first_python_on_path_that_is_new_enough(tmp_path):
    only = _install(tmp_path / "a", {"python3.12": "3.12.4"}, "--dry-run")
    assert only.returncode == 0, only.stderr
    assert only.stdout.splitlines() == [".venv: python3.12 (Python 3.12.4), pip install -e .[test,train] "
                                        "jax==0.11.2 jaxlib==0.11.2"]
    newer = _install(tmp_path / "b", {"python3.11": "3.11.2", "python3": "3.13.1"}, "--dry-run")
    assert newer.stdout.startswith(".venv: python3 (Python 3.13.1)"), newer.stderr


def test_install_falls_back_to_pyenvs_interpreters(tmp_path):
    # As on a machine whose pyenv selects 3.11 globally: its python3.12 shim does not run.
    result = _install(tmp_path, {"python3": "3.11.2"}, "--dry-run",
                      pyenv={"3.10.4": "3.10.4", "3.11.2": "3.11.2", "3.12.9": "3.12.9", "3.13.1": "3.13.1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f".venv: {tmp_path}/pyenv/versions/3.12.9/bin/python (Python 3.12.9)")


def test_install_refuses_a_python_older_than_pyprojects_requirement(tmp_path):
    result = _install(tmp_path, {"python3.11": "3.11.2", "python3": "3.11.2"}, "--dry-run")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("install.sh: error: no Python >= 3.12 on PATH (tried python3.12, python3.13, "
                                     "python3.14, python3 and pyenv's); set PYTHON=...")


def test_install_builds_the_torch_reference_only_for_the_tests(tmp_path):
    plain = _install(tmp_path / "a", {"python3.12": "3.12.4", "python3.11": "3.11.2"}, "--dry-run")
    assert ".venv-ref" not in plain.stdout
    tests = _install(tmp_path / "b", {"python3.12": "3.12.4", "python3.11": "3.11.2"}, "--dry-run", "--tests")
    assert tests.stdout.splitlines()[1] == ".venv-ref: python3.11 (Python 3.11.2), pip install torch transformers"
    bad = _install(tmp_path / "c", {"python3.12": "3.12.4"}, "--test")
    assert bad.returncode == 2 and bad.stderr.strip() == ("install.sh: error: --test: expected --tests, --jax, "
                                                          "--cuda13, --dry-run or --help")


def test_install_builds_a_second_environment_on_another_jax(tmp_path):
    """.venv stays on the lowest jax pyproject.toml accepts; --jax puts another in its own folder."""
    python = {"python3.12": "3.12.4"}
    newest = _install(tmp_path / "a", python, "--jax", "newest", "--dry-run")
    assert newest.stdout.splitlines() == [".venv-jax-newest: python3.12 (Python 3.12.4), pip install -e .[test,train] "
                                          "--upgrade jax jaxlib"], newest.stderr
    exact = _install(tmp_path / "b", python, "--dry-run", "--cuda13", "--jax", "0.12.0")
    assert exact.stdout.splitlines() == [".venv-jax-0.12.0: python3.12 (Python 3.12.4), "
                                         "pip install -e .[test,train,cuda13] jax==0.12.0 jaxlib==0.12.0"], exact.stderr
    for i, args in enumerate((["--jax"], ["--jax", "--tests"], ["--jax", "latest"])):
        bad = _install(tmp_path / f"c{i}", python, "--dry-run", *args)
        assert bad.returncode == 2 and bad.stdout == ""
        assert bad.stderr.strip() == "install.sh: error: --jax: expected newest or a version such as 0.12.0"
    for venv in (".venv-jax-newest", ".venv-jax-0.12.0"):  # never committed
        assert subprocess.run(["git", "check-ignore", "-q", venv], cwd=ROOT).returncode == 0, venv


def test_install_comments_make_no_claim_about_this_machine():
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert "/root/" not in text and ".pyenv/versions" not in text and "these machines" not in text
    assert re.search(r"torch==\d", text) and "transformers==" in text  # pinned, each with its reason above


def test_ci_runs_the_readmes_test_command_then_one_case_each_on_the_newest_jax():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    readme_command = "bash scripts/install.sh --tests && .venv/bin/python -m pytest -q -n 2"
    assert lines[-2:] == [readme_command,
                          "bash scripts/install.sh --jax newest && .venv-jax-newest/bin/python -m pytest -q -n 2 "
                          "--one-case-each"]
    assert f"\n{readme_command}\n" in (ROOT / "README.md").read_text()


def test_parity_tests_skip_with_a_reason_without_the_reference_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["SNAPMLA_REF_PYTHON"] = str(tmp_path / "no-python")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                             str(ROOT / "tests" / "test_model_hf.py"), "-k", "full_forward_matches_transformers"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "3 skipped" in result.stdout and "bash scripts/install.sh --tests" in result.stdout
